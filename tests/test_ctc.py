"""The CTC loss (``F.ctc_loss``) on torch's kernel inside the training graph (orttrainer/runtime/torch_ctc.py).

The exporter refuses aten::ctc_loss; orttrainer writes it as one ATen node that torch runs recorded, and its
gradient as a placeholder that torch's autograd runs. Models train like a plain torch loop (loss and every
state_dict key, step by step, as close to a float64 loop as float32 torch is), at the boundaries torch defines:
another blank, each reduction, padded and concatenated targets, lengths as tensors or lists, empty targets,
targets the input cannot hold (inf, or 0 with zero_infinity). Wav2Vec2ForCTC trains the same.
"""

import copy
import functools

import onnx
import onnxruntime
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from parity import assert_within_float32_error, cpu_options, float64_batch, run_parity, train_keywords_like_torch

from orttrainer import ORTTrainer, optim
from orttrainer.graph import training_graph
from orttrainer.graph.nodes_for_torch import CTC_GRADIENT, CTC_LOSS
from orttrainer.runtime import torch_ctc
from orttrainer.graph.graph_errors import GradientBuildError
from orttrainer.runtime.torch_convolutions import SplitSession

CLASSES, FEATURES, BATCH = 6, 4, 3
LR = 0.2
SGD = functools.partial(torch.optim.SGD, lr=LR)


class Recognizer(nn.Module):
    """Conv1d (or none) over [batch, features, time] -> Linear -> log_softmax -> F.ctc_loss (``ctc`` keywords).

    ``lengths``: "tensors" as the batch gives them, "sizes" lists of traced sizes (every sequence and target whole),
    "constants" lists of Python numbers (``constant_lengths``). With reduction='none' the per-sequence losses are
    weighted 1, 2, 3, so that each sequence's gradient is told apart.
    """

    def __init__(self, conv=True, lengths="tensors", constant_lengths=None, **ctc):
        super().__init__()
        self.conv = nn.Conv1d(FEATURES, 8, 3, padding=1) if conv else None
        self.head = nn.Linear(8 if conv else FEATURES, CLASSES)
        self.lengths, self.constant_lengths, self.ctc = lengths, constant_lengths, ctc

    def forward(self, x, targets, input_lengths, target_lengths):
        features = torch.relu(self.conv(x)) if self.conv is not None else x
        log_probs = F.log_softmax(self.head(features.transpose(1, 2)), -1).transpose(0, 1)  # [time, batch, classes]
        if self.lengths == "sizes":
            input_lengths = [log_probs.shape[0]] * log_probs.shape[1]
            target_lengths = [targets.shape[1]] * targets.shape[0]
        elif self.lengths == "constants":
            input_lengths, target_lengths = self.constant_lengths
        loss = F.ctc_loss(log_probs, targets, input_lengths, target_lengths, **self.ctc)
        return loss if loss.dim() == 0 else (loss * torch.arange(1.0, loss.shape[0] + 1)).sum()


def _batches(times=(12, 9, 12), target=4, blank=0, concatenated=False, dtype=torch.int64, target_lengths=None,
             input_lengths=None):  # fmt: skip
    """(x, targets, input_lengths, target_lengths) per time length; labels drawn without the blank, the last target
    empty; targets padded to ``target`` (or concatenated, 1-D)."""
    generator = torch.Generator().manual_seed(0)
    labels = torch.tensor([label for label in range(CLASSES) if label != blank])
    batches = []
    for time in times:
        lengths = torch.tensor(target_lengths or [target, target - 1, 0])
        inputs = torch.tensor(input_lengths or [time, time - 2, time - 5])
        targets = labels[torch.randint(0, len(labels), (BATCH, target), generator=generator)]
        if concatenated:
            targets = torch.cat([row[:length] for row, length in zip(targets, lengths)])
        batches.append((torch.randn(BATCH, FEATURES, time, generator=generator), targets.to(dtype), inputs.to(dtype),
                        lengths.to(dtype)))  # fmt: skip
    return batches


def _module_loss(module, batch):
    return module(*batch)


def _train(model, batches, options=None):
    torch.manual_seed(0)
    return run_parity(model, batches, optim.SGDConfig(lr=LR), SGD, reference_loss=_module_loss, options=options, float64=True)


def _ctc_nodes_on_torch(trainer) -> set:
    """The op names ('ctc_loss', its gradient's) of the ATen nodes the last graph's training session ran on torch."""
    session = list(trainer._graphs._graphs.values())[-1].runtime.train_session
    assert isinstance(session, SplitSession), "the CTC loss must run in a split session"
    return {onnx.helper.get_attribute_value(node.attribute[0]).decode() for node in session._model.graph.node
            if node.name in session.on_torch and node.op_type == "ATen"}  # fmt: skip


CASES = {
    "mean": ({}, {}),
    "sum": ({"reduction": "sum"}, {}),
    "none": ({"reduction": "none"}, {}),
    "blank-last": ({"blank": CLASSES - 1}, {"blank": CLASSES - 1}),
    "blank-middle-sum": ({"blank": 2, "reduction": "sum"}, {"blank": 2}),
    "concatenated-targets": ({}, {"concatenated": True}),
    "concatenated-targets-none": ({"reduction": "none"}, {"concatenated": True}),
    "int32": ({}, {"dtype": torch.int32}),
    "lengths-from-sizes": ({"lengths": "sizes"}, {}),
    "lengths-as-constants": ({"lengths": "constants", "constant_lengths": ([12, 10, 7], [4, 3, 0])}, {"times": (12, 12)}),
}


@pytest.mark.parametrize("name", CASES)
def test_ctc_model_trains_like_torch(name):
    """Conv1d -> Linear -> log_softmax -> ctc_loss over batches of two time lengths, the last sequence's target
    empty: every step's loss and weights as torch's; both CTC nodes run on torch."""
    settings, batch_settings = CASES[name]
    trainer, _, _ = _train(Recognizer(**settings), _batches(**batch_settings))
    assert _ctc_nodes_on_torch(trainer) == {CTC_LOSS, CTC_GRADIENT}


class UnbatchedRecognizer(nn.Module):
    """One sequence: log_probs [time, classes], a 1-D target, 0-d lengths (torch's unbatched form)."""

    def __init__(self, reduction):
        super().__init__()
        self.head, self.reduction = nn.Linear(FEATURES, CLASSES), reduction

    def forward(self, x, targets, input_lengths, target_lengths):
        log_probs = F.log_softmax(self.head(x), -1)
        return F.ctc_loss(log_probs, targets, input_lengths, target_lengths, reduction=self.reduction) * 2.0


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_an_unbatched_sequence_trains_like_torch(reduction):
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(10, FEATURES, generator=generator), torch.randint(1, CLASSES, (3,), generator=generator),
                torch.tensor(10), torch.tensor(3)) for _ in range(3)]  # fmt: skip
    _train(UnbatchedRecognizer(reduction), batches)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("zero_infinity", [False, True])
def test_targets_the_input_cannot_hold(reduction, zero_infinity):
    """The second sequence's target is longer than its input, the third's needs a blank between its repeated labels
    that its 2 frames have no room for: torch's loss is inf for them (NaN gradients, then NaN weights), or 0 with no
    gradient under zero_infinity; the same here. (No convolution: where a gradient is NaN, ONNX Runtime's and
    torch's convolution gradients spread the NaNs over other weights.)"""
    batches = _batches(times=(6, 6), target=3, target_lengths=[3, 3, 2], input_lengths=[6, 2, 2])
    for _, targets, _, _ in batches:
        targets[2, 1] = targets[2, 0]
    model = Recognizer(conv=False, reduction=reduction, zero_infinity=zero_infinity)
    with torch.no_grad():
        expected = model(*batches[0])
    assert expected.isinf().item() != zero_infinity, expected
    _train(model, batches)


@pytest.mark.parametrize("reduction", [0, 1, 2], ids=["none", "mean", "sum"])
@pytest.mark.parametrize("zero_infinity", [False, True])
def test_the_steps_are_torchs_kernel_to_the_bit(reduction, zero_infinity):
    """The forward step (recorded), its gradient step and the inference step on one batch: torch's loss and log_probs'
    gradient exactly, for a target longer than its input, one whose repeats leave no room for blanks, an empty one, a
    blank-only input length, and -inf log-probabilities."""
    log_probs = F.log_softmax(torch.randn(5, 4, CLASSES, generator=torch.Generator().manual_seed(0)), -1)
    log_probs[0, 1, 3] = -float("inf")
    targets = torch.tensor([[1, 2, 3], [2, 2, 2], [3, 0, 0], [1, 1, 0]])
    values = {"log_probs": log_probs, "targets": targets, "input_lengths": torch.tensor([5, 4, 1, 2]),
              "target_lengths": torch.tensor([3, 3, 0, 2]), "blank": torch.tensor(0), "reduction": torch.tensor(reduction),
              "zero_infinity": torch.tensor(zero_infinity)}  # fmt: skip
    forward = onnx.helper.make_node("ATen", list(values), ["loss"], "ctc", domain="org.pytorch.aten", operator=CTC_LOSS)
    backward = onnx.helper.make_node("ATen", ["loss", "loss_grad"], ["log_probs_grad"], "ctc_grad", domain="org.pytorch.aten",
                                     operator=CTC_GRADIENT)  # fmt: skip
    assert torch_ctc.torch_nodes([forward, backward]) == {"ctc", "ctc_grad"}
    assert torch_ctc.recorded([forward, backward]) == {"ctc"}, "a forward whose loss the placeholder reads runs recorded"
    recordings = {}
    loss = torch_ctc.CTCLossForward(forward, recordings).run(values)["loss"]
    incoming = torch.linspace(0.5, 2.0, loss.numel()).reshape(loss.shape)
    gradient = torch_ctc.CTCLossBackward(backward, recordings).run({"loss": loss, "loss_grad": incoming})["log_probs_grad"]
    assert not recordings
    leaf = log_probs.clone().requires_grad_()
    expected = F.ctc_loss(leaf, targets, values["input_lengths"], values["target_lengths"],
                          reduction=("none", "mean", "sum")[reduction], zero_infinity=zero_infinity)  # fmt: skip
    (expected_gradient,) = torch.autograd.grad(expected, leaf, incoming)
    assert torch.equal(torch_ctc.CTCLossInference(forward).run(values)["loss"], loss)
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(gradient, expected_gradient, rtol=0, atol=0, equal_nan=True)


def test_eval_step_computes_torchs_loss():
    """The eval graph's CTC node is torch's call too: eval_step's loss is the module's in eval mode."""
    torch.manual_seed(0)
    model = Recognizer()
    reference, reference64 = copy.deepcopy(model).eval(), copy.deepcopy(model).double().eval()
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.5), options=cpu_options())
    for batch in _batches(times=(12, 9)):
        with torch.no_grad():
            expected, expected64 = reference(*batch), reference64(*float64_batch(batch))
        loss = trainer.eval_step(*batch)
        assert_within_float32_error(loss[0] if isinstance(loss, list) else loss, expected, expected64, "eval_step loss")


@pytest.mark.parametrize("options", [{"mixed_precision": {"enabled": True}},
                                     {"debug": {"graph_save_paths": {"model_with_training_graph_after_optimization_path": "x"}}}],
                         ids=["mixed-precision", "optimized-graph-saved"])  # fmt: skip
def test_refused_where_the_graph_is_not_split_for_torch(options):
    """ONNX Runtime has no CTC loss: where the graphs are not split for torch's kernels (as under mixed precision or on
    a GPU) the model is refused, naming ctc_loss, its node and what would let it train, before anything is built, at
    every step; the user's module is left as it was."""
    model = Recognizer()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), options=cpu_options(options))
    for _ in range(2):
        with pytest.raises(GradientBuildError, match=r"ctc_loss \(node '/model/ATen'\): ONNX Runtime has no CTC loss; "
                                                     r"orttrainer runs it on torch's kernel.*on the CPU only, without mixed "
                                                     "precision or debug.graph_save_paths"):  # fmt: skip
            trainer.train_step(*_batches(times=(12,))[0])
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items()), "the user's module changed"


def test_a_graph_left_whole_is_refused_before_onnx_runtime_runs_the_loss(tmp_path):
    """A training or eval graph that the split cannot cut stays on ONNX Runtime, which cannot run the CTC loss: it is
    refused by its node, not left to fail inside a run (build._open_sessions calls this check for such graphs)."""
    path = tmp_path / "train.onnx"
    options = cpu_options({"debug": {"graph_save_paths": {"model_with_training_graph_path": str(path)}}})
    trainer = ORTTrainer(Recognizer(), None, optim.SGDConfig(lr=0.1), options=options)
    trainer.train_step(*_batches(times=(12,))[0])
    with pytest.raises(GradientBuildError, match=r"ctc_loss \(node '/model/ATen'\): ONNX Runtime has no CTC loss; .*this one "
                                                 r"cannot be split \(it holds control flow"):  # fmt: skip
        training_graph.refuse_recurrent_layers_onnx_runtime_cannot_train(onnx.load(path))


def test_save_as_onnx_leaves_the_loss_out_or_is_refused(tmp_path):
    """The saved model with its CTC loss would hold the ATen node a plain InferenceSession cannot run: refused, naming
    the way out; without the loss it runs and gives the module's output."""

    class Recognition(nn.Module):  # the log-probabilities as an output beside the loss
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(FEATURES, CLASSES)

        def forward(self, x, targets, input_lengths, target_lengths):
            log_probs = F.log_softmax(self.head(x.transpose(1, 2)), -1).transpose(0, 1)
            return F.ctc_loss(log_probs, targets, input_lengths, target_lengths), log_probs

    torch.manual_seed(0)
    model = Recognition()
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), options=cpu_options())
    batch = _batches(times=(12,))[0]
    trainer.train_step(*batch)
    with pytest.raises(ValueError, match=r"ctc_loss \(node '/model/ATen'\): ONNX Runtime has no CTC loss; a plain "
                                         r"onnxruntime.InferenceSession cannot run the saved graph \(save_as_onnx\(path, "
                                         r"with_loss=False\) leaves the loss out\)"):  # fmt: skip
        trainer.save_as_onnx(str(tmp_path / "with_loss.onnx"))
    trainer.save_as_onnx(str(tmp_path / "model.onnx"), with_loss=False)
    session = onnxruntime.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    (log_probs,) = session.run(None, {session.get_inputs()[0].name: batch[0].numpy()})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(log_probs), model.eval()(*batch)[1], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ Wav2Vec2ForCTC
def wav2vec2_for_ctc(**config_changes):
    """Wav2Vec2 with a CTC head over 12 tokens (pad 0, the blank), on the zoo's tiny config: dropout, LayerDrop and
    SpecAugment masking off (a trace would freeze their Python and numpy draws; with them on the model is refused,
    test_hf_models.test_random_layer_skips_and_masks_drawn_in_python_are_refused)."""
    transformers = pytest.importorskip("transformers", reason="Wav2Vec2ForCTC needs transformers (the test extra)")
    import zoo

    config = zoo.wav2vec2_audio_classifier().config
    for key, value in {"vocab_size": 12, "pad_token_id": 0, **config_changes}.items():
        setattr(config, key, value)
    return transformers.Wav2Vec2ForCTC(config)


def _speech_batches(batches, label_length=6, unreachable=False):
    """400 samples of audio (39 frames) and labels padded with -100; with ``unreachable`` the second row's label is
    longer than its 39 frames."""
    generator = torch.Generator().manual_seed(1)
    made = []
    for batch in batches:
        width = 45 if unreachable else label_length
        labels = torch.randint(1, 12, (batch, width), generator=generator)
        labels[0, label_length - 2 :] = -100
        if unreachable:
            labels[2:, label_length:] = -100
        made.append({"input_values": torch.randn(batch, 400, generator=generator), "labels": labels})
    return made


def _compare_loss_and_logits(outputs, expected, expected64, where):
    for field in ("loss", "logits"):
        assert_within_float32_error(outputs[field], expected[field], expected64[field], f"{where} {field}")


@pytest.mark.parametrize("config, unreachable, frozen", [
    ({}, False, False),
    ({"ctc_loss_reduction": "mean", "ctc_zero_infinity": True}, True, False),
    ({"ctc_loss_reduction": "mean"}, False, True),
], ids=["sum", "mean-zero-infinity-unreachable-label", "mean-frozen-feature-encoder"])  # fmt: skip
def test_wav2vec2_for_ctc_trains_like_torch(config, unreachable, frozen):
    """Steps over batches of 2, 3 and 2 clips: the loss, the logits and every state_dict key as torch's, then eval_step
    as the module in eval mode. transformers' default reduction ("sum"), and the "mean" of its fine-tuning recipes with
    zero_infinity (a label too long for its clip adds 0) or with the feature encoder frozen (freeze_feature_encoder)."""
    torch.manual_seed(0)
    model = wav2vec2_for_ctc(**config)
    if frozen:
        model.freeze_feature_encoder()
    reference, reference64 = copy.deepcopy(model), copy.deepcopy(model).double()
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.05), options=cpu_options())
    *batches, eval_batch = _speech_batches([2, 3, 2, 3], unreachable=unreachable)
    train_keywords_like_torch(trainer, reference, reference64, batches, 0.05, _compare_loss_and_logits)
    assert _ctc_nodes_on_torch(trainer) == {CTC_LOSS, CTC_GRADIENT}
    reference.eval()
    reference64.eval()
    with torch.no_grad():
        expected, expected64 = reference(**eval_batch), reference64(**float64_batch(eval_batch))
    _compare_loss_and_logits(trainer.eval_step(**eval_batch), expected, expected64, "eval_step")
