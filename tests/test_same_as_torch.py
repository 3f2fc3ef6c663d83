"""Models from ordinary PyTorch code train exactly as torch trains them, or are refused with a
clear error before training: never silently different. Each case goes through the public API."""

import argparse
import collections
import copy
import functools
import math
import random
import re
import sys
import types
import warnings

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import CNN, MLP, VOCAB, Encoder, NoGradTarget, StraightThrough, cnn_batch, mlp_batch, token_batch
from parity import assert_close_state, assert_within_float32_error, cpu_options, run_parity, step_both

from orttrainer import GradientBuildError, ORTTrainer, ORTTrainerOptions, amp, optim
from orttrainer.runtime import build
from orttrainer.export import refusals
from orttrainer.export.refusals import ExportError
from orttrainer.export.verify import TorchMismatchError


def sgd(parameters):
    return torch.optim.SGD(parameters, lr=0.1)


def batches(make, count=3, seed=0, **kwargs):
    generator = torch.Generator().manual_seed(seed)
    return [make(generator=generator, **kwargs) for _ in range(count)]


# ------------------------------------------------------------------ embeddings
class Tagger(nn.Module):
    """Token embedding (padding row 0) -> Linear, optionally tied to the output projection."""

    def __init__(self, padding_idx=0, scale_grad_by_freq=False, tied=False):
        super().__init__()
        self.tokens = nn.Embedding(20, 8, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq)
        self.hidden = nn.Linear(8, 8)
        self.out = nn.Linear(8, 20)
        if tied:
            self.out.weight = self.tokens.weight

    def forward(self, tokens):
        return self.out(torch.tanh(self.hidden(self.tokens(tokens))))


def token_batches(count=3, seed=0):
    generator = torch.Generator().manual_seed(seed)
    result = []
    for _ in range(count):
        tokens = torch.randint(0, 20, (4, 6), generator=generator)
        tokens[:, -2:] = 0  # padding, as a collator pads
        result.append((tokens, torch.randint(0, 20, (4, 6), generator=generator)))
    return result


def tagger_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


@pytest.mark.parametrize(
    "kwargs",
    [{"padding_idx": 0}, {"padding_idx": 0, "scale_grad_by_freq": True}, {"padding_idx": None, "scale_grad_by_freq": True},
     {"padding_idx": 0, "tied": True}],
    ids=["padding_idx", "padding_idx+scale_grad_by_freq", "scale_grad_by_freq", "padding_idx+tied_output"],
)  # fmt: skip
def test_embedding_gradient_rules_match_torch(kwargs):
    torch.manual_seed(0)
    model = Tagger(**kwargs)
    trainer, reference = run_parity(model, token_batches(), optim.SGDConfig(lr=0.5), lambda p: torch.optim.SGD(p, lr=0.5),
                                    loss_fn=tagger_loss)  # fmt: skip
    if kwargs.get("padding_idx") == 0 and not kwargs.get("tied"):
        torch.testing.assert_close(trainer.state_dict(pytorch_format=True)["tokens.weight"][0], model.tokens.weight[0])


def test_embedding_max_norm_is_refused():
    model = Tagger()
    model.tokens.max_norm = 1.0
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=tagger_loss, options=cpu_options())
    with pytest.raises(ExportError, match=r"module 'tokens' \(Embedding\) has max_norm=1.0"):
        trainer.train_step(*token_batches(1)[0])


class Bagger(nn.Module):
    """nn.EmbeddingBag -> tanh -> Linear: a bag of words classifier."""

    def __init__(self, **bag):
        super().__init__()
        self.bag = nn.EmbeddingBag(20, 8, **bag)
        self.head = nn.Linear(8, 4)

    def forward(self, tokens, offsets=None, per_sample_weights=None):
        return self.head(torch.tanh(self.bag(tokens, offsets, per_sample_weights=per_sample_weights)))


def bag_batches(weighted, count=3, seed=0):
    """Bags of one length as a 2-D batch; or, ``weighted``, bags of 0-5 tokens concatenated, with
    their offsets (the total length last) and a weight per token."""
    generator = torch.Generator().manual_seed(seed)
    result = []
    for index in range(count):
        labels = torch.randint(0, 4, (3 + index,), generator=generator)
        if not weighted:
            tokens = torch.randint(0, 20, (3 + index, 5), generator=generator)
            tokens[0, :2] = tokens[1] = 0  # padding: a bag partly, a bag wholly of padding_idx
            result.append((tokens, labels))
            continue
        lengths = torch.randint(0, 6, (3 + index,), generator=generator)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        tokens = torch.randint(0, 20, (int(lengths.sum()),), generator=generator)
        result.append((tokens, offsets, torch.randn(tokens.shape, generator=generator), labels))
    return result


@pytest.mark.parametrize("bag, weighted", [({"mode": "max", "padding_idx": 0}, False), ({"mode": "mean", "padding_idx": 0}, False),
                                          ({"mode": "sum", "include_last_offset": True}, True)],
                         ids=["max, padding_idx, 2-D", "mean, padding_idx, 2-D", "sum, per_sample_weights, include_last_offset"])  # fmt: skip
def test_embedding_bag_trains_as_torch(bag, weighted):
    """The exporter writes nn.EmbeddingBag as a Loop over the bags, which onnxruntime-training cannot
    differentiate; orttrainer's symbolic gathers the bags instead (symbolics.indexing.embedding_bag)."""
    torch.manual_seed(0)
    run_parity(Bagger(**bag), bag_batches(weighted), optim.SGDConfig(lr=0.5), lambda p: torch.optim.SGD(p, lr=0.5),
               loss_fn=F.cross_entropy)  # fmt: skip


@pytest.mark.parametrize("setting, message", [("scale_grad_by_freq", r"nn\.EmbeddingBag 'bag' with scale_grad_by_freq=True"),
                                              ("max_norm", r"module 'bag' \(EmbeddingBag\) has max_norm=1\.0")])  # fmt: skip
def test_embedding_bag_settings_that_do_not_train_are_refused(setting, message):
    model = Bagger(**{setting: True if setting == "scale_grad_by_freq" else 1.0})
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=cpu_options())
    with pytest.raises(ExportError, match=message):
        trainer.train_step(*bag_batches(weighted=False, count=1)[0])
    assert trainer._training_session is None


# ------------------------------------------------------------------ tied weights, unused and absent parameters
def test_tied_weights_appear_under_every_name_and_load_strictly():
    torch.manual_seed(0)
    model = Tagger(padding_idx=None, tied=True)
    trainer, _ = run_parity(model, token_batches(), optim.SGDConfig(lr=0.5), lambda p: torch.optim.SGD(p, lr=0.5),
                            loss_fn=tagger_loss)  # fmt: skip
    state = trainer.state_dict(pytorch_format=True)
    assert set(state) == set(model.state_dict())
    fresh = Tagger(padding_idx=None, tied=True)
    fresh.load_state_dict(state, strict=True)
    assert fresh.out.weight is fresh.tokens.weight
    torch.testing.assert_close(fresh.out.weight, state["out.weight"])


class WithAuxiliaryHead(nn.Module):
    """Returns (main, auxiliary); only main reaches the loss, as an eval-only head does."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(32, 16)
        self.main = nn.Linear(16, 10)
        self.auxiliary = nn.Linear(16, 3)
        self.register_buffer("unused_table", torch.arange(5.0))  # in state_dict, never read by forward

    def forward(self, x):
        hidden = torch.relu(self.trunk(x))
        return self.main(hidden), self.auxiliary(hidden)


def test_parameter_reaching_only_another_output_stays_untouched_like_torch():
    torch.manual_seed(0)
    model = WithAuxiliaryHead()
    initial = copy.deepcopy(model.auxiliary.state_dict())
    trainer, reference = run_parity(model, batches(mlp_batch), optim.AdamConfig(lr=1e-2, lambda_coef=0.1),
                                    lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),  # decay skips grad-less weights
                                    options=cpu_options({"utils": {"grad_norm_clip": False}}),
                                    loss_fn=lambda outputs, label: F.cross_entropy(outputs[0], label),
                                    reference_loss=lambda module, batch: F.cross_entropy(module(batch[0])[0], batch[1]))  # fmt: skip
    state = trainer.state_dict(pytorch_format=True)
    for name, value in initial.items():
        torch.testing.assert_close(state[f"auxiliary.{name}"], value, rtol=0, atol=0)
    assert reference.auxiliary.weight.grad is None


class UnusedInputModel(nn.Module):
    """The legacy suite's model without parameters, whose second input reaches nothing (IO binding must not mind)."""

    def forward(self, x, y):
        return torch.mean(x)


def test_model_without_parameters_steps_with_one_warning():
    """As the legacy trainer: train_step runs the forward and returns its outputs, the update has nothing to do, and
    one warning says so (not one per step)."""
    trainer = ORTTrainer(UnusedInputModel(), None, optim.AdamConfig(lr=0.1), options=cpu_options())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for step in range(3):
            x, y = torch.randn(4, 3), torch.randn(2)
            torch.testing.assert_close(trainer.train_step(x, y), torch.mean(x))
    told = [str(warning.message) for warning in caught if "no parameter to train" in str(warning.message)]
    assert len(told) == 1 and "UnusedInputModel" in told[0] and "updates nothing" in told[0]
    torch.testing.assert_close(trainer.eval_step(x, y), torch.mean(x))
    assert trainer.state_dict()["train_step_info"]["step"] == 3


def test_model_with_every_weight_frozen_updates_batchnorm_statistics_like_torch():
    """Every parameter requires_grad=False: nothing is trained, the BatchNorm running statistics still move as the
    module's forward in train mode moves them."""
    torch.manual_seed(0)
    model = CNN()
    model.requires_grad_(False)
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=cpu_options())
    generator = torch.Generator().manual_seed(0)
    with pytest.warns(UserWarning, match="CNN has no parameter to train"):
        for step in range(2):
            x, label = cnn_batch(generator=generator)
            loss = trainer.train_step(x, label)[0]  # the loss, then the module's output
            torch.testing.assert_close(loss, F.cross_entropy(reference(x), label), atol=1e-5, rtol=1e-5)
    assert_close_state(trainer, reference)


# ------------------------------------------------------------------ batch norm
def test_frozen_batchnorm_in_a_training_model_keeps_its_statistics_like_torch():
    """Fine-tuning recipe: the backbone's BatchNorm in eval() (running statistics used and kept),
    its affine weights still trained, the rest of the model in train()."""
    torch.manual_seed(0)
    model = CNN()
    with torch.no_grad():
        model.features[1].running_mean.uniform_(-0.5, 0.5)
        model.features[1].running_var.uniform_(0.5, 2.0)
    model.features[1].eval()
    frozen_mean = model.features[1].running_mean.clone()
    trainer, reference = run_parity(model, batches(cnn_batch), optim.SGDConfig(lr=0.1), sgd, loss_fn=F.cross_entropy)
    state = trainer.state_dict(pytorch_format=True)
    torch.testing.assert_close(state["features.1.running_mean"], frozen_mean, rtol=0, atol=0)
    assert int(state["features.1.num_batches_tracked"]) == 0 and int(state["features.5.num_batches_tracked"]) == 3


def test_batchnorm_over_one_value_per_channel_is_refused_and_changes_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=cpu_options())
    trainer.train_step(torch.randn(8, 6), torch.randint(0, 2, (8,)))
    before = trainer.state_dict(pytorch_format=True)
    # a new batch size is exported first, and torch's own forward refuses it; at a known size the trainer does
    with pytest.raises(ValueError, match=r"Expected more than 1 value per channel when training"):
        trainer.train_step(torch.randn(1, 6), torch.randint(0, 2, (1,)))
    after = trainer.state_dict(pytorch_format=True)
    for name, value in before.items():
        torch.testing.assert_close(after[name], value, rtol=0, atol=0, msg=name)
    assert trainer._train_step_info.step == 1
    assert torch.isfinite(trainer.eval_step(torch.randn(3, 6), torch.randint(0, 2, (3,)))[1]).all()


# ------------------------------------------------------------------ layers the exporter refuses
class RMSNormBlock(nn.Module):
    """A pre-norm decoder block as modern plain-torch code writes it: nn.RMSNorm, causal
    scaled-dot-product attention, a SiLU-gated MLP, residuals; a tied-free LM head."""

    def __init__(self, vocab=20, width=16, heads=2):
        super().__init__()
        self.heads = heads
        self.tokens = nn.Embedding(vocab, width)
        self.norm1, self.norm2, self.final = nn.RMSNorm(width), nn.RMSNorm(width, eps=1e-6), nn.RMSNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width, bias=False), nn.Linear(width, width, bias=False)
        self.gate, self.up, self.down = nn.Linear(width, 32, bias=False), nn.Linear(width, 32, bias=False), nn.Linear(32, width, bias=False)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens):
        x = self.tokens(tokens)
        q, k, v = self.qkv(self.norm1(x)).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        x = x + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))
        h = self.norm2(x)
        x = x + self.down(F.silu(self.gate(h)) * self.up(h))
        return self.head(self.final(x))


def test_rms_norm_model_trains_as_torch():
    """nn.RMSNorm, which the exporter refuses, is exported as torch's formula (symbolics.layers.rms_norm)."""
    torch.manual_seed(0)
    run_parity(RMSNormBlock(), token_batches(), optim.SGDConfig(lr=0.5), lambda p: torch.optim.SGD(p, lr=0.5), loss_fn=tagger_loss)


def test_batches_whose_kept_labels_weigh_nothing_train_as_torch():
    """cross_entropy's mean divides by the class weights of the labels kept: a batch of ignored labels only gives
    torch's loss NaN (0 / 0) and gradients of 0, one of weight-0 classes only NaN gradients as well. orttrainer
    reported 0 and trained on with gradients of 0 (symbolics.losses._loss_over_targets)."""
    weights = torch.ones(VOCAB)
    weights[:5] = 0

    def weighted_lm_loss(logits, labels):
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), weight=weights)

    torch.manual_seed(0)
    tokens, labels = token_batch(generator=torch.Generator().manual_seed(0))
    batches = [(tokens, labels), (tokens, torch.full_like(labels, -100)), (tokens, labels), (tokens, labels % 5)]
    trainer, _ = run_parity(Encoder(), batches, optim.SGDConfig(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1),
                            loss_fn=weighted_lm_loss)  # fmt: skip
    assert trainer.state_dict(pytorch_format=True)["head.weight"].isnan().all(), "the last batch's NaN gradients trained"


class AveragedHeads(nn.Module):
    """Two heads averaged by constant weights (``a / 2 + b / 4``), plus a third term: the pattern ONNX Runtime's
    training optimizer fuses into a ScaledSum (rewrites.arithmetic.sum_of_quotients)."""

    def __init__(self, third):
        super().__init__()
        self.trunk, self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 10), nn.Linear(32, 10), nn.Linear(32, 10)
        self.third = third

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        averaged = self.a(h) / 2 + self.b(h) / 4
        return averaged + torch.relu(self.c(h)) if self.third else averaged


@pytest.mark.parametrize("third", [False, True], ids=["two heads", "and a third term"])
def test_heads_averaged_by_constant_divisions_train_as_torch(third):
    """Refused before ("no CPU kernel for ScaledSum"); on CUDA the fused node multiplied by reciprocals, and with a
    third term read relu's input instead of its output."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 16, generator=generator), torch.randint(0, 10, (8,), generator=generator)) for _ in range(4)]
    trainer, reference = run_parity(AveragedHeads(third), batches, optim.SGDConfig(lr=0.5),
                                    lambda p: torch.optim.SGD(p, lr=0.5), loss_fn=F.cross_entropy)  # fmt: skip
    with torch.no_grad():
        torch.testing.assert_close(trainer.eval_step(*batches[0])[1], reference(batches[0][0]), atol=1e-5, rtol=1e-5)


class PaddedPool(nn.Module):
    """A ZeroPad2d before a pool: ONNX Runtime's Pad_Fusion folds the zeros into the pool's own padding."""

    def __init__(self, pool, side):
        super().__init__()
        self.conv, self.pad, self.pool = nn.Conv2d(2, 4, 3, padding=1), nn.ZeroPad2d(1), pool
        self.head = nn.Linear(4 * side * side, 3)

    def forward(self, x):
        return self.head(self.pool(self.pad(self.conv(x) - 1.0)).flatten(1))  # mostly negative: the padding's zeros win


@pytest.mark.parametrize("mixed_precision", [False, True], ids=["float32", "mixed-precision"])
@pytest.mark.parametrize("pool, side", [(nn.MaxPool2d(2, 2), 4), (nn.AvgPool2d(2, 2, padding=1, count_include_pad=False), 5)],
                         ids=["max-pool", "average-pool-without-padding-count"])  # fmt: skip
def test_a_zero_pad_before_a_pool_evaluates_as_torch(pool, side, mixed_precision):
    """Pad_Fusion (off in every session now) made the zeros the pool's own padding, which a MaxPool takes as -inf and
    an AveragePool without count_include_pad leaves out: the mixed-precision eval graph (ONNX Runtime's MaxPool) was
    0.57 off torch, and the average pool's failed to open."""
    torch.manual_seed(0)
    model = PaddedPool(pool, side)
    reference = copy.deepcopy(model).eval()
    options = cpu_options({"mixed_precision": {"enabled": mixed_precision}})
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.0), loss_fn=F.cross_entropy, options=options)
    batch = (torch.randn(4, 2, 6, 6, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 2, 0]))
    trainer.train_step(*batch)
    with torch.no_grad():
        expected = reference(batch[0])
    tolerance = 2e-3 if mixed_precision else 1e-5  # float16 products
    torch.testing.assert_close(trainer.eval_step(*batch)[1].float(), expected, atol=tolerance, rtol=tolerance)


class NormalizedFeatures(nn.Module):
    """A LayerNorm over raw features (prices, timestamps: a large mean against their spread), then an MLP head."""

    def __init__(self):
        super().__init__()
        self.norm, self.hidden, self.head = nn.LayerNorm(16), nn.Linear(16, 32), nn.Linear(32, 3)

    def forward(self, x):
        return self.head(torch.relu(self.hidden(self.norm(x))))


def test_a_layer_norm_over_features_with_a_large_mean_trains_as_torch():
    """ONNX Runtime's CPU LayerNormalization cancels in E[x^2] - mean^2: features of mean 100 evaluated 9e-4 off torch
    (cpu_kernels.centered_layer_norms gives it the rows minus their mean). Against a float64 run: rows of mean 100
    cancel in float32 torch too, by an amount that moves with the CPU's kernels."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 16, generator=generator) + 100.0, torch.randint(0, 3, (8,), generator=generator))
               for _ in range(4)]  # fmt: skip
    trainer, reference, reference64 = run_parity(NormalizedFeatures(), batches, optim.SGDConfig(lr=0.5),
                                                 lambda p: torch.optim.SGD(p, lr=0.5), loss_fn=F.cross_entropy, float64=True)  # fmt: skip
    with torch.no_grad():
        assert_within_float32_error(trainer.eval_step(*batches[0])[1], reference.eval()(batches[0][0]),
                                    reference64.eval()(batches[0][0].double()), "eval_step")  # fmt: skip


def test_confident_logits_train_as_torch_with_bce_with_logits():
    """Logits of +-20 to +-60 (a confident classifier): torch's loss is about |x| where the target
    disagrees; the exporter's log(sigmoid) form made it inf (symbolics.losses.binary_cross_entropy_with_logits)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    with torch.no_grad():
        model[2].weight.mul_(40.0)
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(6, 8, generator=generator), torch.randint(0, 2, (6, 3), generator=generator).float()) for _ in range(3)]
    loss_fn = functools.partial(F.binary_cross_entropy_with_logits, pos_weight=torch.tensor([1.0, 2.0, 0.5]))
    run_parity(model, data, optim.SGDConfig(lr=0.01), lambda p: torch.optim.SGD(p, lr=0.01), loss_fn=loss_fn)


# ------------------------------------------------------------------ what the graph cannot hold
class DataDependentBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        if x.sum() > 0:
            y = y * 2
        return y


class BakedInteger(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * int(x.abs().sum())


class MutatesBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return self.fc(x)


class WritesIntoBuffer(nn.Module):
    """``buffer[mask] = value`` (an index_put_ on the buffer itself), as a memory bank of features does."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("bank", torch.zeros(3, 4))

    def forward(self, x):
        self.bank[x[:, 0] > 0] = self.fc(x).detach().mean(0)
        return self.fc(x) + self.bank.sum()


class MutatesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        x.mul_(2.0)
        return self.fc(x)


@pytest.mark.parametrize(
    "module, message",
    [(MutatesBuffer, r"forward writes the buffers \['calls'\] in place in eval mode too"),
     (WritesIntoBuffer, r"forward writes the buffers \['bank'\] in place in eval mode too"),
     (MutatesItsInput, r"forward changes its input 'x' in place \(aten::mul_\): torch's caller sees the change")],
    ids=["buffer-mutated-in-forward", "buffer-written-by-mask", "input-mutated-in-forward"],
)  # fmt: skip
def test_trace_that_would_differ_from_the_module_is_refused_naming_the_line(module, message):
    trainer = ORTTrainer(module(), None, optim.SGDConfig(lr=0.1), loss_fn=F.mse_loss, options=cpu_options())
    batch = (torch.randn(3, 4), torch.randn(3, 4))
    given = [tensor.clone() for tensor in batch]
    with pytest.raises(ExportError, match=message):
        trainer.train_step(*batch)
    assert trainer._training_session is None
    for tensor, before in zip(batch, given):
        torch.testing.assert_close(tensor, before, rtol=0, atol=0)  # the export ran forward on copies


class PaddedAttention(nn.Module):
    """nn.MultiheadAttention with a bool key_padding_mask, which torch turns into a float mask by an
    in-place fill of a tensor made from it: the exporter reports a mutation of the input 'mask'."""

    def __init__(self):
        super().__init__()
        self.embed, self.attention, self.head = nn.Linear(8, 16), nn.MultiheadAttention(16, 2, batch_first=True), nn.Linear(16, 3)

    def forward(self, x, mask):
        h = self.embed(x)
        attended, _ = self.attention(h, h, h, key_padding_mask=mask)
        return self.head(attended.mean(1))


def test_attention_with_a_bool_padding_mask_trains_like_torch():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(3):
        mask = torch.rand(4, 5, generator=generator) < 0.3
        mask[:, 0] = False  # every sequence keeps a position
        batches.append((torch.randn(4, 5, 8, generator=generator), mask, torch.randint(0, 3, (4,), generator=generator)))
    run_parity(PaddedAttention(), batches, optim.SGDConfig(lr=0.1), functools.partial(torch.optim.SGD, lr=0.1),
               loss_fn=F.cross_entropy)  # fmt: skip


class WidthAsPythonNumber(nn.Module):
    """Python numbers from a shape that never changes (the feature width), as many attention layers have."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        width = x.shape[-1]
        first, second = self.fc(x).split(width // 2, dim=-1)  # split converts the traced width with int()
        return torch.cat([first * second, second], dim=-1) / math.sqrt(width)


class WeightDependentBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if self.fc.weight.mean() > 0:
            return self.fc(x)
        return -self.fc(x)


@pytest.mark.parametrize(
    "module, line",
    [(BakedInteger, r"return self.fc\(x\) \* int\(x.abs\(\).sum\(\)\)"),
     (DataDependentBranch, r"if x.sum\(\) > 0:"),
     (WeightDependentBranch, r"if self.fc.weight.mean\(\) > 0:")],
    ids=["python-number", "python-if", "python-if-on-a-weight"],
)  # fmt: skip
def test_python_value_from_the_data_or_weights_is_refused_at_the_first_batch_naming_the_line(module, line):
    """Traced, the branch or number of the first batch would hold for every batch; a value computed
    from shapes alone (WidthAsPythonNumber, shape-dependent ifs in test_shapes.py) is allowed."""
    trainer = ORTTrainer(module(), None, optim.SGDConfig(lr=0.1), loss_fn=F.mse_loss, options=cpu_options())
    with pytest.raises(ExportError, match=rf"test_same_as_torch.py:\d+: {line}: a Python value .* computed from the values "
                                          r"of the batch or the weights"):
        trainer.train_step(torch.randn(3, 4), torch.randn(3, 4))
    assert trainer._training_session is None


class LayerDrop(nn.Module):
    """Skips its second layer at random in training, as transformers' LayerDrop does (``torch.rand([]) < p``)."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        x = torch.relu(self.first(x))
        if self.training and torch.rand([]) < 0.5:
            return x
        return self.second(x)


def test_python_branch_on_a_random_draw_is_refused_naming_the_line():
    """The trace keeps the first draw's branch for every step: the layer was never skipped, or always. The draw's
    value depends on no input, so it passed as a value of shapes alone, and the values check (a second export of the
    same shapes) drew the same branch again half the time."""
    trainer = ORTTrainer(LayerDrop(), None, optim.SGDConfig(lr=0.1), loss_fn=F.mse_loss, options=cpu_options())
    with pytest.raises(ExportError, match=r"test_same_as_torch.py:\d+: if self.training and torch.rand\(\[\]\) < 0.5:: a "
                                          r"Python value .* computed from a random draw .* every step would take the same "
                                          r"branch"):  # fmt: skip
        trainer.train_step(torch.randn(3, 4), torch.randn(3, 4))


Scores = collections.namedtuple("Scores", ["logits", "hidden"])


class ReturnsNamedTuple(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden, self.out = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x):
        hidden = torch.tanh(self.hidden(x))
        return Scores(self.out(hidden), hidden)


class SparseTagger(Tagger):
    """Tagger whose embedding gives sparse gradients (nn.Embedding(sparse=True)), as torch's SGD takes them."""

    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(20, 8, padding_idx=0, sparse=True)


class StateDictWithExtraEntry(nn.Module):
    """A module whose state_dict hook adds an entry (a version tag), which its load_state_dict does not take."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self._register_state_dict_hook(lambda module, state, prefix, local: state.update({prefix + "version": torch.ones(1)}))

    def forward(self, x):
        return self.fc(x)


def _random_pairs(inputs, outputs, count=3):
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(4, inputs, generator=generator), torch.randn(4, outputs, generator=generator)) for _ in range(count)]


@pytest.mark.parametrize("case", ["namedtuple-output", "sparse-embedding", "state-dict-hook"])
def test_modules_that_were_refused_without_a_cause_train_like_torch(case):
    """A namedtuple output reached the loss as a plain tuple (out.logits failed), the first-step check could not compare
    an embedding's sparse gradient, and a check's reset of the module went through its load_state_dict, which refused
    the entry its own state_dict hook adds."""
    torch.manual_seed(0)
    if case == "namedtuple-output":
        run_parity(ReturnsNamedTuple(), _random_pairs(4, 3), optim.SGDConfig(lr=0.1), sgd,
                   loss_fn=lambda scores, label: F.mse_loss(scores.logits, label))  # fmt: skip
    elif case == "sparse-embedding":
        run_parity(SparseTagger(), token_batches(), optim.SGDConfig(lr=0.1), sgd, loss_fn=tagger_loss)
    else:
        trainer = ORTTrainer(StateDictWithExtraEntry(), None, optim.SGDConfig(lr=0.1), loss_fn=F.mse_loss,
                             options=cpu_options())  # fmt: skip
        reference = copy.deepcopy(trainer._torch_model)
        for x, label in _random_pairs(4, 3):
            loss = trainer.train_step(x, label)[0]
            torch.testing.assert_close(loss, F.mse_loss(reference(x), label))
            reference.zero_grad()
            F.mse_loss(reference(x), label).backward()
            with torch.no_grad():
                for parameter in reference.parameters():
                    parameter -= 0.1 * parameter.grad
        trained = trainer.state_dict(pytorch_format=True)
        for name, parameter in reference.named_parameters():
            torch.testing.assert_close(trained[name], parameter.detach(), atol=1e-6, rtol=1e-5)


def _soft_labels(labels):
    return F.softmax(F.one_hot(labels, 20).float() * 3.0, dim=-1)


@pytest.mark.parametrize("loss_fn", [
    lambda logits, labels: F.cross_entropy(logits.reshape(-1, 20), labels.reshape(-1), label_smoothing=0.1),
    lambda logits, labels: F.cross_entropy(logits.reshape(-1, 20), _soft_labels(labels).reshape(-1, 20)),
    lambda logits, labels: F.cross_entropy(logits.reshape(-1, 20), _soft_labels(labels).reshape(-1, 20), label_smoothing=0.2),
    lambda logits, labels: F.cross_entropy(logits.reshape(-1, 20), labels.reshape(-1), weight=torch.linspace(0.5, 1.5, 20),
                                           label_smoothing=0.1),
], ids=["indices-smoothed", "probabilities", "probabilities-smoothed", "weighted-smoothed"])  # fmt: skip
def test_cross_entropy_over_logits_reshaped_to_classes_trains_like_torch(loss_fn):
    """``logits.view(-1, vocab)``, the usual form of a language model's loss: under a dynamic batch the trace knows
    no class count after the reshape, and label smoothing and class probabilities, whose formulas divide by it,
    were refused; the count is now read in the run."""
    torch.manual_seed(0)
    run_parity(Tagger(), token_batches(), optim.SGDConfig(lr=0.1), sgd, loss_fn=loss_fn)


class LayerDropDrawnWithPython(LayerDrop):
    """LayerDrop as transformers drew it before torch.rand (``random.uniform(0, 1) < layerdrop``), and as its MusicGen
    still draws it, at every layer whatever the probability."""

    def __init__(self, layerdrop=0.1, numpy=False):
        super().__init__()
        self.layerdrop, self.numpy = layerdrop, numpy

    def forward(self, x):
        x = torch.relu(self.first(x))
        drawn = np.random.random() if self.numpy else random.uniform(0, 1)
        if self.training and drawn < self.layerdrop:
            return x
        return self.second(x)


@pytest.mark.parametrize("numpy", [False, True], ids=["python", "numpy"])
def test_a_draw_that_decides_nothing_trains_like_torch(numpy):
    """MusicGen draws LayerDrop's number at every layer with layerdrop 0 (its default): the graph is the same whatever
    the draw (exported again with the draws forced to either end of their range), so it is not refused."""
    torch.manual_seed(0)
    random.seed(0)
    run_parity(LayerDropDrawnWithPython(layerdrop=0.0, numpy=numpy), _random_pairs(4, 4), optim.SGDConfig(lr=0.1), sgd,
               loss_fn=F.mse_loss)  # fmt: skip


class NoiseDrawnWithNumpy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        noise = np.random.standard_normal(tuple(x.shape)).astype(np.float32)
        return self.fc(x + 0.1 * torch.from_numpy(noise))


@pytest.mark.parametrize("module, line", [
    (LayerDropDrawnWithPython, r"Python's random module at:\n- \S*test_same_as_torch.py:\d+: drawn = np.random.random\(\) "
                               r"if self.numpy else random.uniform\(0, 1\)"),
    (NoiseDrawnWithNumpy, r"numpy's global generator \(np.random\) at:\n- \S*test_same_as_torch.py:\d+: noise = "
                          r"np.random.standard_normal"),
], ids=["python-random", "numpy-random"])  # fmt: skip
def test_draws_from_generators_the_trace_cannot_see_are_refused_naming_the_line(module, line):
    """The trace records such a draw's result as a constant: every step would reuse the first draw. LayerDrop at 0.1
    drew "keep" in both exports of the values check most of the time (with this seed always), so the layer was never
    skipped, without a word."""
    random.seed(0)
    trainer = ORTTrainer(module(), None, optim.SGDConfig(lr=0.1), loss_fn=F.mse_loss, options=cpu_options())
    with pytest.raises(ExportError, match=rf"(?s)forward or loss draws from {line}.*every step would reuse it"):
        trainer.train_step(torch.randn(3, 4), torch.randn(3, 4))


class StepCounter(nn.Module):
    """Forward keeps state of its own: a step count (a Python number or a buffer) that later takes a branch, a
    running value kept in a tensor attribute or updated through .data, a weight clamped or renormalised in forward."""

    def __init__(self, change):
        super().__init__()
        self.fc, self.change, self.calls = nn.Linear(4, 4), change, 0
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(4))
        self.scale = torch.ones(4)

    def forward(self, x):
        if self.change == "python-counter":
            self.calls += 1
            x = x * 0.5 if self.calls > 12 else x
        elif self.change == "reassigned-buffer":
            self.count = self.count + 1
            x = x * self.count
        elif self.change == "tensor-attribute":
            self.scale = self.scale * 0.9
            x = x * self.scale
        elif self.change == "buffer-through-data":
            self.ema.data.mul_(0.9).add_(0.1 * x.detach().mean(0))
            x = x - self.ema
        elif self.change == "clamped-weight":
            self.fc.weight.data.clamp_(-0.2, 0.2)
        elif self.change == "embedding-max-norm":
            x = F.embedding(torch.tensor([[0, 1, 2, 3]]).expand(x.shape[0], 4), self.fc.weight, max_norm=0.5).sum(-1)
        elif self.change == "same-value-each-step":
            self.width = x.shape[-1]
        elif self.change == "equal-tensor-each-step":  # Swin's window size, a tensor while traced
            self.width = torch.tensor(x.shape[-1]) if torch.jit.is_tracing() else x.shape[-1]
        return self.fc(x)


STATE_CHANGES = [
    ("python-counter", r"attribute 'calls': \d+ -> \d+"),
    ("reassigned-buffer", r"buffer 'count': reassigned or changed through .data"),
    ("tensor-attribute", r"tensor attribute 'scale': reassigned or changed through .data"),
    ("buffer-through-data", r"buffer 'ema': reassigned or changed through .data"),
    ("clamped-weight", r"parameter 'fc.weight': its values changed in forward"),
    ("embedding-max-norm", r"parameter 'fc.weight': its values changed in forward .*max_norm"),
]


@pytest.mark.parametrize("change, what", STATE_CHANGES, ids=[change for change, _ in STATE_CHANGES])
def test_forward_that_changes_its_own_state_is_refused_naming_what_changed(change, what):
    """torch carries each change into the next step, the graph starts every step from the state it was traced with.
    Each trained other than torch without a word: the counter's branch from step 13 on, the buffer and the attribute
    from step 2, the clamp and the renormalisation (whose first run changed the trainer's copy) from step 2."""
    trainer = ORTTrainer(StepCounter(change), None, optim.SGDConfig(lr=0.1), loss_fn=F.mse_loss, options=cpu_options())
    with pytest.raises(ExportError, match=rf"(?s)forward or loss changes its own state.*- {what}.*Keep such state out of "
                                          r"forward"):  # fmt: skip
        trainer.train_step(torch.randn(3, 4), torch.randn(3, 4))


class TableFilledAtTheFirstCall(nn.Module):
    """Fills a table at its first forward in training mode and keeps it, as older rotary embeddings filled their
    cos/sin caches: state set once, which a torch loop keeps as well."""

    def __init__(self):
        super().__init__()
        self.fc, self.filled, self.table = nn.Linear(4, 4), False, torch.ones(4)

    def forward(self, x):
        if self.training and not self.filled:
            self.filled, self.table = True, torch.linspace(0.5, 1.5, 4)
        return self.fc(x) * (self.table if self.training else 1.0)


def test_forward_that_sets_its_state_at_the_first_call_only_trains_like_torch():
    """The trace's forward is the module's first in training mode: the graph is traced again from the state it left
    (trace._export_from_the_state_of_a_first_call), not refused as a change of state."""
    torch.manual_seed(0)
    run_parity(TableFilledAtTheFirstCall(), _random_pairs(4, 4), optim.SGDConfig(lr=0.1), sgd, loss_fn=F.mse_loss)


class GrowingLoss:
    """A loss whose weight grows with its calls (a warm-up kept in the loss object)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, output, label):
        self.calls += 1
        return F.mse_loss(output, label) * min(self.calls, 3)


def test_a_loss_object_that_changes_its_own_state_is_refused_naming_it():
    """The trace froze the weight of the trainer's own calls (3 at the trace), torch's loop used 1, 2, 3."""
    trainer = ORTTrainer(nn.Linear(4, 4), None, optim.SGDConfig(lr=0.1), loss_fn=GrowingLoss(), options=cpu_options())
    with pytest.raises(ExportError, match=r"(?s)changes its own state.*- attribute 'loss_fn.calls': \d+ -> \d+"):
        trainer.train_step(torch.randn(3, 4), torch.randn(3, 4))


def _with_warm_up_hook(counting: bool) -> nn.Module:
    """An MLP whose head's output a forward hook scales: by a warm-up factor counted in the hook's closure (1.5, 2,
    2.5, then 2.5), or by a constant it closes over."""
    model, calls, scale = MLP(), {"count": 0}, 2.0

    def warm_up(module, inputs, output):
        calls["count"] += counting
        return output * (1.0 + 0.5 * min(calls["count"], 3) if counting else scale)

    model.head.register_forward_hook(warm_up)
    return model


def test_a_forward_hook_that_counts_in_its_closure_is_refused_naming_the_variable():
    trainer = ORTTrainer(_with_warm_up_hook(counting=True), None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy,
                         options=cpu_options())  # fmt: skip
    with pytest.raises(ExportError, match=r"(?s)changes its own state.*- calls\['count'\], a variable of the forward hook "
                                          r".*warm_up of module 'head': \d+ -> \d+"):  # fmt: skip
        trainer.train_step(*mlp_batch())


def test_a_forward_hook_over_constants_trains_like_torch():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    run_parity(_with_warm_up_hook(counting=False), [mlp_batch(generator=generator) for _ in range(3)],
               optim.SGDConfig(lr=0.1), sgd, loss_fn=F.cross_entropy)  # fmt: skip


@pytest.mark.parametrize("change", ["same-value-each-step", "equal-tensor-each-step"])
def test_forward_that_sets_an_attribute_to_the_same_value_every_step_trains_like_torch(change):
    """Not a change of state: transformers' Swin sets its window size from the input's resolution at every forward (a
    new but equal tensor at each trace; the values check's second export was refused for it)."""
    torch.manual_seed(0)
    run_parity(StepCounter(change), _random_pairs(4, 4), optim.SGDConfig(lr=0.1), sgd, loss_fn=F.mse_loss)


@pytest.mark.parametrize("frozen_first", [False, True], ids=["frozen-later", "unfrozen-later"])
def test_requires_grad_changed_on_the_module_after_the_first_step_is_refused_naming_the_weight(frozen_first):
    """Gradual unfreezing (fine-tuning schedules) in torch's loop changes which weights train; the trainer's graphs
    were built for the first step's, and trained a weight frozen since (or left one unfrozen since), without a word."""
    model = MLP()
    model.fc1.weight.requires_grad_(not frozen_first)
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=cpu_options())
    trainer.train_step(*mlp_batch())
    model.fc1.weight.requires_grad_(frozen_first)
    before = trainer.state_dict(pytorch_format=True)
    with pytest.raises(ValueError, match=rf"since the trainer's first step, requires_grad of 'fc1.weight' went "
                                         rf"{not frozen_first} -> {frozen_first}: the trainer's graphs hold the module"):  # fmt: skip
        trainer.train_step(*mlp_batch())
    assert_close_state_dicts(trainer.state_dict(pytorch_format=True), before)


@pytest.mark.parametrize("whole_model", [False, True], ids=["batch-norm-frozen-later", "model-in-eval-later"])
def test_a_module_put_in_eval_after_the_first_step_is_refused_unless_the_whole_model(whole_model):
    """A BatchNorm frozen after some steps (a detector's fine-tuning) runs on its running statistics in torch's loop;
    the trainer's graphs kept normalising by the batch, without a word. A whole model in eval() trains in train() mode,
    as the legacy ORTTrainer did (and as a model in eval() at the first step does), with a warning."""
    model = CNN()
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=cpu_options())
    trainer.train_step(*cnn_batch())
    (model if whole_model else model.features[1]).eval()
    if whole_model:
        with pytest.warns(UserWarning, match=r"train_step with the model \(CNN\) in eval mode"):
            trainer.train_step(*cnn_batch())
        return
    with pytest.raises(ValueError, match=r"since the trainer's first step, module 'features.1' was put in eval\(\): the "
                                         r"trainer's graphs hold the module as it was then"):  # fmt: skip
        trainer.train_step(*cnn_batch())


def test_a_model_put_in_eval_with_a_frozen_batchnorm_is_refused_saying_why():
    """A whole model in eval() trains every module in train(): a BatchNorm frozen at the first step would thaw. The
    refusal says so, where it said 'put in train()' of the module the user had left alone."""
    model = CNN()
    model.features[1].eval()
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=cpu_options())
    trainer.train_step(*cnn_batch())
    model.eval()
    refused = (r"module 'features.1' was put in train\(\) \(the model is in eval\(\), which trains every module in "
               r"train\(\), as the legacy ORTTrainer did: call model.train\(\) and eval\(\) on this module again\)")
    with pytest.warns(UserWarning, match=r"in eval mode"), pytest.raises(ValueError, match=refused):
        trainer.train_step(*cnn_batch())


def _normed_mlp():
    """A 3-layer MLP with BatchNorm and dropout, whose training differs between train() and eval() modes."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3),
                         nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))  # fmt: skip


def _normed_batches(count=3):
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(6, 8, generator=generator), torch.randint(0, 3, (6,), generator=generator))
            for _ in range(count)]  # fmt: skip


_EVAL_MODE_WARNING = (r"orttrainer: train_step with the model \(Sequential\) in eval mode \(model.eval\(\), and no "
                      r"model.train\(\) since\): orttrainer trains it in train\(\) mode, as the legacy ORTTrainer did "
                      r"\(dropout on, BatchNorm normalising by the batch and updating its running statistics\), where a "
                      r"torch loop would step it in eval mode. Call model.train\(\) before train_step to train as now "
                      r"without this warning; to train as torch does in eval mode, put its submodules in eval\(\) and the "
                      r"model in train\(\) before the first step: model.train\(\); \[child.eval\(\) for child in "
                      r"model.children\(\)\]. Said once per trainer")  # fmt: skip


@pytest.mark.parametrize("eval_from", ["first-step", "a-later-step"])
def test_a_model_in_eval_mode_trains_in_train_mode_and_says_so_once(eval_from):
    """After model.eval() (a validation pass) and no model.train(), a torch loop steps BatchNorm on its running
    statistics with dropout off; the trainer trains in train() mode, as the legacy ORTTrainer did: not silently."""
    model = _normed_mlp()
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=cpu_options())
    batches = _normed_batches(4)
    if eval_from == "a-later-step":
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a model in train() is not warned of
            trainer.train_step(*batches.pop())
    model.eval()
    with warnings.catch_warnings(record=True) as heard:
        warnings.simplefilter("always")
        for batch in batches:
            trainer.train_step(*batch)
    said = [warning for warning in heard if "in eval mode" in str(warning.message)]
    assert len(said) == 1 and said[0].category is UserWarning and said[0].filename == __file__, said
    assert re.fullmatch(_EVAL_MODE_WARNING, str(said[0].message)), str(said[0].message)
    assert int(model[1].num_batches_tracked) == 4  # every step in train(): BatchNorm counted each batch


def test_a_model_trained_as_the_eval_mode_warning_says_steps_like_torch_in_eval_mode():
    """The warning's recipe for torch's eval-mode training (the model in train(), its submodules in eval()) trains like
    a torch loop stepping the model in eval(): losses and every state_dict key."""
    model = _normed_mlp()
    reference = copy.deepcopy(model).eval()
    model.train()
    for child in model.children():
        child.eval()
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=cpu_options())
    optimizer = sgd(reference.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        for step, batch in enumerate(_normed_batches(), 1):
            step_both(trainer, reference, optimizer, batch, step, F.cross_entropy)


class Tempered(nn.Module):
    """An MLP whose scores are divided by a temperature the training loop anneals (``model.temperature = ...``)."""

    def __init__(self):
        super().__init__()
        self.body, self.temperature = MLP(), 1.0

    def forward(self, x):
        return self.body(x) / self.temperature


def _hook_doubling_output(module, inputs, output):
    return output * 2


@pytest.mark.parametrize("edit, message", [
    (lambda model, loss: setattr(model, "temperature", 0.5), "attribute 'temperature' of module 'the model' went 1.0 -> 0.5"),
    (lambda model, loss: setattr(model.body, "head", nn.Linear(64, 10)), "submodule 'head' of module 'body' was replaced"),
    (lambda model, loss: model.body.fc1.register_forward_hook(_hook_doubling_output), "a forward hook of module 'body.fc1' added"),
    (lambda model, loss: setattr(model.body.fc1, "bias", nn.Parameter(torch.zeros(64))),
     "parameter 'bias' of module 'body.fc1' was replaced"),
    (lambda model, loss: setattr(loss, "label_smoothing", 0.1), "attribute 'label_smoothing' of module 'loss_fn' went 0.0 -> 0.1"),
], ids=["attribute", "submodule", "forward-hook", "parameter", "loss-attribute"])  # fmt: skip
def test_the_module_edited_after_the_first_step_is_refused_naming_the_change(edit, message):
    """A torch loop that anneals a temperature, swaps a head, adds a hook or changes its loss between steps trains the
    changed module from the next step on; the trainer's copy of the module, taken at its first step, kept training the
    module as it was, without a word (module_edits.py). Refused by train_step and eval_step, the state left as it was."""
    torch.manual_seed(0)
    model, loss = Tempered(), nn.CrossEntropyLoss()
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=loss, options=cpu_options())
    trainer.train_step(*mlp_batch())
    edit(model, loss)
    before = trainer.state_dict(pytorch_format=True)
    for step in (trainer.train_step, trainer.eval_step):
        with pytest.raises(ValueError, match=rf"since the trainer's first step, {re.escape(message)}: the trainer's graphs hold the module"):
            step(*mlp_batch())
    assert_close_state_dicts(trainer.state_dict(pytorch_format=True), before)


def test_a_value_a_forward_hook_reads_changed_after_the_first_step_is_refused():
    """A hook scaling a layer's output by a value the loop anneals (``scaling["factor"] = ...``): the trace kept the
    first step's value, torch's loop uses the new one."""
    model = MLP()
    scaling = {"factor": 1.0}
    model.fc1.register_forward_hook(lambda module, inputs, output: output * scaling["factor"])
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=cpu_options())
    trainer.train_step(*mlp_batch())
    trainer.train_step(*mlp_batch())
    scaling["factor"] = 0.5
    with pytest.raises(ValueError, match=r"since the trainer's first step, scaling\['factor'\], a variable of the forward "
                                         r"hook .* of module 'fc1' went 1.0 -> 0.5"):  # fmt: skip
        trainer.train_step(*mlp_batch())


def test_a_variable_a_forward_hook_closes_over_rebound_after_the_first_step_is_refused():
    """A hook reading a local variable of the training script (``factor`` in its ``main``) that the loop anneals by
    assigning it again: torch's loop uses the new value, the trace kept the first step's."""
    model = MLP()
    factor = 1.0
    model.fc1.register_forward_hook(lambda module, inputs, output: output * factor)
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=cpu_options())
    trainer.train_step(*mlp_batch())
    factor = 0.5
    with pytest.raises(ValueError, match=r"since the trainer's first step, factor, a variable of the forward hook .* of "
                                         r"module 'fc1' went 1.0 -> 0.5"):  # fmt: skip
        trainer.train_step(*mlp_batch())
    factor = 1.0  # back to the value the graphs were built with: nothing changed
    trainer.train_step(*mlp_batch())


_TEMPERATURE = 1.0  # a training script's globals, read by ScriptTempered's forward
_ARGS = argparse.Namespace(tau=1.0, epoch=0)


class ScriptTempered(nn.Module):
    """An MLP scaled by what a training script keeps outside the module: a global, its parsed arguments, and
    hyper-parameters held as a namespace (``self.hparams``, as a Lightning module keeps them)."""

    def __init__(self):
        super().__init__()
        self.body, self.hparams = MLP(), types.SimpleNamespace(scale=2.0, name="run 1")

    def forward(self, x):
        return self.body(x) * self.hparams.scale / _TEMPERATURE / _ARGS.tau


@pytest.mark.parametrize("edit, message", [
    (lambda patch, model: patch.setattr(sys.modules[__name__], "_TEMPERATURE", 0.5),
     "global '_TEMPERATURE' read by ScriptTempered.forward of module 'the model' went 1.0 -> 0.5"),
    (lambda patch, model: patch.setattr(_ARGS, "tau", 0.5), "'_ARGS.tau' read by ScriptTempered.forward"),
    (lambda patch, model: setattr(model.hparams, "scale", 3.0), "'hparams.scale' read by ScriptTempered.forward"),
    (lambda patch, model: patch.setattr(_ARGS, "epoch", 1), None),
    (lambda patch, model: setattr(model.hparams, "name", "run 2"), None),
], ids=["global", "parsed-argument", "module-namespace", "argument-forward-does-not-read", "name-forward-does-not-read"])  # fmt: skip
def test_a_value_forward_reads_from_the_script_changed_after_the_first_step_is_refused(monkeypatch, edit, message):
    """A loop that anneals a temperature kept as a global or in ``args`` changes what torch's forward computes from the
    next step; the trace kept the first step's value (forward_effects.values_read_by_name). Values forward does not
    read (``args.epoch`` set by the loop) are no change."""
    torch.manual_seed(0)
    model = ScriptTempered()
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=cpu_options())
    trainer.train_step(*mlp_batch())
    edit(monkeypatch, model)
    if message is None:
        trainer.train_step(*mlp_batch())
        return
    with pytest.raises(ValueError, match=rf"since the trainer's first step, {re.escape(message)}.*: the trainer's graphs "
                                         r"hold the module as it was then, with the values its forward read then"):
        trainer.train_step(*mlp_batch())


def test_a_value_read_from_the_namespace_of_the_second_of_two_like_modules_changed_is_refused():
    """Modules of one class run one forward, but each holds its own namespace: the second's is compared too."""
    torch.manual_seed(0)
    model = nn.Sequential(ScriptTempered(), nn.Linear(10, 32), ScriptTempered())
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=cpu_options())
    trainer.train_step(*mlp_batch())
    model[2].hparams.scale = 3.0
    with pytest.raises(ValueError, match=r"'hparams.scale' read by ScriptTempered.forward of module '2' went 2.0 -> 3.0"):
        trainer.train_step(*mlp_batch())


def test_a_weight_frozen_after_the_first_step_is_no_reason_to_refuse_an_evaluation():
    """eval_step runs every module in eval mode and computes no gradient: requires_grad and modes changed since the first
    step do not change what it computes (train_step refuses them)."""
    model = MLP()
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=cpu_options())
    trainer.train_step(*mlp_batch())
    model.fc1.weight.requires_grad_(False)
    model.fc1.eval()
    trainer.sync_to_module()
    reference = copy.deepcopy(model).eval()
    batch = mlp_batch()
    with torch.no_grad():
        torch.testing.assert_close(trainer.eval_step(*batch)[1], reference(batch[0]), atol=1e-5, rtol=1e-5)


def test_the_module_run_and_synced_between_steps_trains_on():
    """What a loop does with the module between steps without changing it (sync_to_module, then a torch evaluation in
    eval() under no_grad, then train() again) is no edit; nor is an attribute that is NaN, unequal to itself."""
    torch.manual_seed(0)
    model = Tempered()
    model.unused = float("nan")
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=cpu_options())
    for _ in range(2):
        trainer.train_step(*mlp_batch())
        trainer.sync_to_module()
        model.eval()
        with torch.no_grad():
            model(mlp_batch()[0])
        model.train()


def _clip_weights(model, loss):
    with torch.no_grad():  # WGAN's weight clipping, after each update
        for parameter in model.parameters():
            parameter.clamp_(-0.01, 0.01)


def _run_in_train_mode(model, loss):
    with torch.no_grad():  # a forward for logging, the model left in train(): BatchNorm updates its statistics
        model(cnn_batch()[0])


def _scale_class_weights(model, loss):
    with torch.no_grad():
        loss.weight.mul_(2)


@pytest.mark.parametrize("write", [
    lambda model, loss: model.load_state_dict(CNN().state_dict()), _clip_weights, lambda model, loss: nn.init.zeros_(model.head.bias),
    _run_in_train_mode,
], ids=["load_state_dict", "clamp", "nn.init", "forward-in-train-mode"])  # fmt: skip
def test_values_written_into_the_weights_between_steps_take_effect_as_in_torch(write):
    """The trainer trains the module's own tensors, as a torch loop does, so values written into them between steps
    (weights loaded, WGAN's clipping, a re-initialised head, a forward in train mode that moves BatchNorm's statistics)
    are trained from the next step: the same writes in a torch loop, every state_dict key equal step by step."""

    def write_both(step, trainer, model, reference, batch):
        torch.manual_seed(step)  # the same new weights (load_state_dict), the same batch (_run_in_train_mode)
        write(model, None)
        torch.manual_seed(step)
        write(reference, None)

    _cnn_trained_alongside_torch(write_both)


@pytest.mark.parametrize("write, message", [
    (lambda model, loss: setattr(model.head.weight, "data", torch.zeros_like(model.head.weight)),
     "the memory of parameter 'weight' of module 'head' was replaced (.data =, .to(), .half()); write into it instead"),
    (_scale_class_weights, "the values of buffer 'weight' of module 'loss_fn' were written (the graphs hold them as "
                           "constants)"),
], ids=["data-assigned", "loss-buffer"])  # fmt: skip
def test_what_the_graphs_do_not_read_in_place_changed_after_the_first_step_is_refused_naming_it(write, message):
    """The sessions read the memory the weights had at the build, and the graphs hold the loss's tensors as constants:
    a weight given new memory (``p.data = ...``) or the loss's class weights scaled would not reach the next step,
    where a torch loop trains with them. Refused by train_step and eval_step, the trainer's state left as it was."""
    torch.manual_seed(0)
    model, loss = CNN(), nn.CrossEntropyLoss(weight=torch.linspace(0.5, 1.5, 10))
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=loss, options=cpu_options())
    trainer.train_step(*cnn_batch())
    before = trainer.state_dict(pytorch_format=True)
    write(model, loss)
    for step in (trainer.train_step, trainer.eval_step):
        with pytest.raises(ValueError, match=rf"since the trainer's first step, {re.escape(message)}.*: the trainer's "
                                             r"graphs hold the module as it was then"):
            step(*cnn_batch())
    assert_close_state_dicts(trainer.state_dict(pytorch_format=True), before)


def test_the_module_loaded_with_the_trained_state_between_steps_trains_like_torch():
    """The legacy ORTTrainer had no sync_to_module: its users loaded state_dict(pytorch_format=True) into the module to
    evaluate it in torch between epochs. That writes the module's tensors with the values they hold already."""

    def evaluate_in_torch(step, trainer, model, reference, batch):
        model.load_state_dict(trainer.state_dict(pytorch_format=True), strict=False)
        model.eval()
        with torch.no_grad():
            torch.testing.assert_close(model(batch[0]), reference.eval()(batch[0]), atol=1e-5, rtol=1e-5)
        model.train(), reference.train()

    _cnn_trained_alongside_torch(evaluate_in_torch)


def _cnn_trained_alongside_torch(between_steps) -> None:
    """A CNN trained for 3 steps by orttrainer and by a torch loop, every state_dict key compared after each step;
    ``between_steps(step, trainer, model, reference, batch)`` runs after each."""
    torch.manual_seed(0)
    model = CNN()
    reference = copy.deepcopy(model)
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=cpu_options())
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        batch = cnn_batch(generator=generator)
        step_both(trainer, reference, torch_optimizer, batch, step, F.cross_entropy)
        between_steps(step, trainer, model, reference, batch)


def _adam_with_weight_decay(**groups):
    return optim.AdamConfig(lr=1e-2, lambda_coef=0.01, epsilon=1e-4, **groups)


@pytest.mark.parametrize("edit, message", [
    (lambda trainer: setattr(trainer.optim_config, "lambda_coef", 0.0), "optim_config.lambda_coef went 0.01 -> 0.0"),
    (lambda trainer: trainer.optim_config.defaults.update({"lambda": 0.0}), "optim_config.defaults['lambda'] went 0.01 -> 0.0"),
    (lambda trainer: trainer.optim_config.params[0].update({"alpha": 0.9}), "optim_config.params[0]['alpha'] went 0.5 -> 0.9"),
    (lambda trainer: setattr(trainer.options.utils, "grad_norm_clip", True), "options utils.grad_norm_clip went False -> True"),
    (lambda trainer: trainer.options.utils.frozen_weights.append("fc1.weight"),
     "options utils.frozen_weights went [] -> ['fc1.weight']"),
    (lambda trainer: setattr(trainer, "optim_config", _adam_with_weight_decay()),
     "optim_config went AdamConfig(params=[{'lr': 0.01, 'alpha': 0.5"),
    (lambda trainer: setattr(trainer, "loss_fn", F.multi_margin_loss), "loss_fn went <function cross_entropy"),
], ids=["weight-decay-attribute", "weight-decay-default", "group-beta", "gradient-clipping", "frozen-weights",
        "config-replaced", "loss-replaced"])  # fmt: skip
def test_settings_changed_after_the_first_step_are_refused_naming_the_key(edit, message):
    """A torch loop changes its optimizer's param_groups between steps (a weight-decay schedule) and they apply at the
    next step. The trainer's update took every hyper-parameter but lr when it was built, and the graphs took the
    options and the loss: the same changes to trainer.optim_config, trainer.options or trainer.loss_fn did nothing,
    without a word. Refused, the trainer's state left as it was."""
    torch.manual_seed(0)
    config = _adam_with_weight_decay(params=[{"params": ["fc2.weight"], "alpha": 0.5}])
    trainer = ORTTrainer(MLP(), None, config, loss_fn=F.cross_entropy, options=cpu_options({"utils": {"grad_norm_clip": False}}))
    trainer.train_step(*mlp_batch())
    edit(trainer)
    before = trainer.state_dict(pytorch_format=True)
    for step in (trainer.train_step, trainer.eval_step):
        with pytest.raises(ValueError, match=rf"since the trainer built its graphs and update \(at its first step.*\), "
                                             rf"{re.escape(message)}.*: the trainer took these then.*"
                                             r"new_trainer.load_state_dict\(trainer.state_dict\(\)\)"):
            step(*mlp_batch())
    assert_close_state_dicts(trainer.state_dict(pytorch_format=True), before)


class _MeanSquare(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        return self.fc(x).square().mean()


def test_settings_of_a_trainer_of_an_onnx_model_changed_after_its_creation_are_refused(tmp_path):
    """An ONNX model's graphs and update are built when the trainer is created: options changed before the first
    step already reach nothing."""
    path = tmp_path / "mean_square.onnx"
    torch.onnx.export(_MeanSquare(), (torch.randn(2, 6),), path, dynamo=False, input_names=["x"], output_names=["loss"],
                      dynamic_axes={"x": {0: "batch"}})  # fmt: skip
    trainer = ORTTrainer(onnx.load(path), {"inputs": [("x", ["batch", 6])], "outputs": [("loss", [], True)]},
                         _adam_with_weight_decay(), options=cpu_options())  # fmt: skip
    trainer.options.utils.grad_norm_clip = False
    with pytest.raises(ValueError, match=r"since the trainer built its graphs and update \(at its first step; an ONNX "
                                         r"model's when it was created\), options utils.grad_norm_clip went True -> False"):
        trainer.train_step(torch.randn(2, 6))


@pytest.mark.parametrize("first_step", [False, True], ids=["before-the-first-step", "after-the-first-step"])
def test_the_options_object_passed_changed_afterwards_is_refused(first_step):
    """The trainer copies the options it is given (it never changes the caller's object), so a loop that goes on
    changing its own object (``options.batch.gradient_accumulation_steps = 4``) changed nothing, without a word; the
    legacy ORTTrainer read the caller's object. Refused, pointing at trainer.options."""
    options = cpu_options()
    trainer = ORTTrainer(MLP(), None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=options)
    for _ in range(2 if first_step else 0):  # windows of 2 may start after step 2
        trainer.train_step(*mlp_batch())
    options.batch.gradient_accumulation_steps = 2
    with pytest.raises(ValueError, match=r"since the trainer was created, options batch.gradient_accumulation_steps went "
                                         r"1 -> 2 in the ORTTrainerOptions passed to it: .*Change trainer.options instead"):
        trainer.train_step(*mlp_batch())
    options.batch.gradient_accumulation_steps = 1
    trainer.options.batch.gradient_accumulation_steps = 2  # the way the error names
    trainer.train_step(*mlp_batch())


def test_a_hyper_parameter_attribute_set_before_the_first_step_is_refused():
    """optim_config's attributes mirror its defaults, which the update reads: ``config.lambda_coef = 0.1`` after creating
    the config trained with the weight decay it was created with."""
    config = _adam_with_weight_decay()
    config.lambda_coef = 0.1
    trainer = ORTTrainer(MLP(), None, config, loss_fn=F.cross_entropy, options=cpu_options())
    with pytest.raises(ValueError, match=r"optim_config.lambda_coef was set to 0.1 \(created with 0.01\): the update takes "
                                         r"the hyper-parameters of optim_config.defaults.*AdamConfig\(lambda_coef=0.1\)"):
        trainer.train_step(*mlp_batch())


def test_a_weight_decay_schedule_goes_on_in_a_new_trainer_as_torch_changes_its_param_group():
    """What the refusal above advises: a new trainer created with the new weight decay, from the first one's state,
    trains on as torch's AdamW after ``param_group['weight_decay'] = 0.0``; and the learning rate, which the update
    reads at every step, changes in place as torch's ``param_group['lr']`` does."""
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.01)
    options = cpu_options({"utils": {"grad_norm_clip": False}})
    trainer = ORTTrainer(model, None, _adam_with_weight_decay(), loss_fn=F.cross_entropy, options=options)
    generator = torch.Generator().manual_seed(0)
    for step in range(5):
        if step == 2:  # torch's schedule sets the weight decay off; the trainer goes on in a new one
            torch_optimizer.param_groups[0]["weight_decay"] = 0.0
            successor = ORTTrainer(model, None, optim.AdamConfig(lr=1e-2, lambda_coef=0.0, epsilon=1e-4),
                                   loss_fn=F.cross_entropy, options=options)  # fmt: skip
            successor.load_state_dict(trainer.state_dict())
            trainer = successor
        if step == 3:
            torch_optimizer.param_groups[0]["lr"] = 3e-3
            trainer.optim_config.lr = 3e-3
        x, label = mlp_batch(generator=generator)
        step_both(trainer, reference, torch_optimizer, (x, label), step, F.cross_entropy)


def test_eval_step_under_inference_mode_builds_its_graphs_and_evaluates_like_torch():
    """A common validation idiom: eval_step under torch.inference_mode(), whose tensors autograd refuses, when it has to
    build a graph (the first step, a new batch shape) failed with torch's "Inference tensors do not track version
    counter", which did not name inference_mode."""
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model).eval()
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=cpu_options())
    generator = torch.Generator().manual_seed(0)
    for rows in (8, 5):  # the first graph, then one of another shape
        x, label = mlp_batch(batch=rows, generator=generator)
        with torch.inference_mode():
            loss, logits = trainer.eval_step(x, label)
        with torch.no_grad():
            torch.testing.assert_close(logits, reference(x))
            torch.testing.assert_close(loss, F.cross_entropy(reference(x), label))


def assert_close_state_dicts(now: dict, before: dict) -> None:
    assert now.keys() == before.keys()
    for name, tensor in now.items():
        torch.testing.assert_close(tensor, before[name], atol=0, rtol=0, msg=lambda message: f"'{name}': {message}")


def test_value_frozen_from_a_fixed_width_trains_like_torch_at_every_batch_shape():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(rows, 4, generator=generator), torch.randn(rows, 4, generator=generator)) for rows in (3, 3, 5, 3)]
    trainer, _ = run_parity(WidthAsPythonNumber(), data, optim.SGDConfig(lr=0.1), sgd, loss_fn=F.mse_loss)
    assert trainer._graphs.built == 1  # the export at 5 rows gave the same graph


class WidthAsPythonNumberAmongEveryKindOfWeight(WidthAsPythonNumber):
    """WidthAsPythonNumber beside weights of every kind a graph holds: tied, frozen, unused, BatchNorm
    statistics, a non-persistent buffer."""

    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(4)
        self.frozen, self.unused, self.tied = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.tied.weight = self.fc.weight
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 4), persistent=False)

    def forward(self, x):
        return super().forward(self.frozen(self.norm(x))) * self.scale + self.tied(x)


def test_values_check_without_weights_sees_the_graph_built_with_them():
    """The values check exports its batch with the weights as graph inputs (no copy of them while training
    holds its memory): the same structure as the built graph's, whatever kinds of weights it has."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(rows, 4, generator=generator), torch.randn(rows, 4, generator=generator)) for rows in (3, 3, 5, 3)]
    trainer, _ = run_parity(WidthAsPythonNumberAmongEveryKindOfWeight(), data, optim.SGDConfig(lr=0.1), sgd,
                            loss_fn=F.mse_loss)  # fmt: skip
    assert trainer._graphs.built == 1


class TensorMadeInForward(nn.Module):
    """Makes a tensor from Python values in forward, as transformers' DynamicCache makes empty ones per layer."""

    def __init__(self, values):
        super().__init__()
        self.fc, self.values = nn.Linear(4, 4), values

    def forward(self, x):
        made = torch.tensor(self.values, dtype=x.dtype)
        return torch.cat([made.flatten(), self.fc(x).flatten()])[made.numel():].reshape(x.shape) + made.sum()


@pytest.mark.parametrize("values, exports", [([], 1), ([[], []], 1), ([0.5], 2)], ids=["empty", "empty-nested", "a-value"])
def test_an_empty_tensor_made_in_forward_freezes_no_value(values, exports, monkeypatch):
    """A tensor made from Python values is a constant of the trace, so the first batch with other values is exported
    again to show the graph does not change (the values check); an empty one holds no value: no second export."""
    counted = []
    export = build.TorchSource.export
    monkeypatch.setattr(build.TorchSource, "export", lambda *args, **kwargs: counted.append(1) or export(*args, **kwargs))
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(3, 4, generator=generator), torch.randn(3, 4, generator=generator)) for _ in range(3)]
    torch.manual_seed(0)
    run_parity(TensorMadeInForward(values), data, optim.SGDConfig(lr=0.1), sgd, loss_fn=F.mse_loss)
    assert len(counted) == exports


class GradientPenalty(nn.Module):
    """The input gradient's norm added to the output (a gradient penalty inside forward)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        x = x.detach().requires_grad_()
        y = torch.tanh(self.fc(x))
        (gradient,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return y + gradient.pow(2).sum(1, keepdim=True)


def loss_that_runs_backward(output, target):
    loss = F.cross_entropy(output, target)
    loss.backward(retain_graph=True)
    return loss


@pytest.mark.parametrize("module, loss_fn, call", [(GradientPenalty, F.mse_loss, "torch.autograd.grad"),
                                                   (MLP, loss_that_runs_backward, "Tensor.backward")],
                         ids=["autograd-grad-in-forward", "backward-in-the-loss"])  # fmt: skip
def test_a_derivative_taken_inside_forward_or_the_loss_is_refused_naming_the_line(module, loss_fn, call):
    torch.manual_seed(0)
    model = module()
    batch = (torch.randn(3, 4), torch.randn(3, 4)) if module is GradientPenalty else mlp_batch()
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=loss_fn, options=cpu_options())
    with pytest.raises(ExportError, match=rf"differentiates \({call} at .*test_same_as_torch.py:\d+: .*train this model with torch"):
        trainer.train_step(*batch)
    assert trainer._training_session is None


class ReverseGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -grad


class StraightThroughRound(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class ScaledByItsLargest(torch.autograd.Function):
    """A custom backward whose forward also reads a value of the batch into Python, which the exporter complains of."""

    @staticmethod
    def forward(ctx, x):
        return x / float(x.abs().max())

    @staticmethod
    def backward(ctx, grad):
        return grad


class WithFunction(nn.Module):
    def __init__(self, function):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.function = function

    def forward(self, x):
        return self.function.apply(self.fc(x))


@pytest.mark.parametrize("function", [ReverseGradient, StraightThroughRound, ScaledByItsLargest])
def test_custom_autograd_function_is_refused_naming_the_function(function):
    """Refused as soon as the trace's forward has run: before anything the exporter says of the ops inside."""
    trainer = ORTTrainer(WithFunction(function), None, optim.SGDConfig(lr=0.1), loss_fn=F.mse_loss, options=cpu_options())
    with pytest.raises(ExportError, match=rf"custom torch.autograd.Function {__name__}.{function.__name__}: its backward"):
        trainer.train_step(torch.randn(3, 4), torch.randn(3, 4))


class HookInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        if y.requires_grad:
            y.register_hook(lambda grad: grad * 0)
        return y


def hooked(kind):
    model = MLP(inputs=4, classes=4)
    if kind == "module":
        model.fc1.register_full_backward_hook(lambda module, grad_in, grad_out: None)
    elif kind == "parameter":
        model.fc2.weight.register_hook(lambda grad: grad.clamp(-1, 1))
    else:
        model = HookInForward()
    return model


@pytest.mark.parametrize("kind, message", [("module", r"module 'fc1' \(Linear\) has a backward hook"),
                                           ("parameter", r"parameter 'fc2.weight' has a gradient hook"),
                                           ("tensor", r"tensor.register_hook at .*test_same_as_torch.py:\d+")])  # fmt: skip
def test_gradient_hooks_are_refused(kind, message):
    trainer = ORTTrainer(hooked(kind), None, optim.SGDConfig(lr=0.1), loss_fn=F.mse_loss, options=cpu_options())
    with pytest.raises(ExportError, match=message):
        trainer.train_step(torch.randn(3, 4), torch.randn(3, 4))


def test_unrelated_exporter_warnings_reach_the_user():
    """Warnings the trainer does not know are passed on, not silenced."""
    model = nn.Sequential(nn.Linear(4, 4))
    model.register_forward_hook(lambda module, inputs, output: warnings.warn("from the user's hook") or output)
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=F.mse_loss, options=cpu_options())
    with pytest.warns(UserWarning, match="from the user's hook"):
        trainer.train_step(torch.randn(3, 4), torch.randn(3, 4))


# ------------------------------------------------------------------ the built-in check
def broken_relu_gradient(build):
    """ReluGrad as dy * (x > 1): wrong for 0 < x <= 1."""
    dy, x = build.node.input[:2]
    positive = build.op("Greater", [x, build.op("CastLike", [build.const(1.0), x])])
    build.op("Mul", [dy, build.op("CastLike", [positive, dy])], build.node.output[0])


@pytest.mark.parametrize("mode", ["error", "warn", "off"])
def test_builtin_check_catches_a_broken_gradient_kernel(monkeypatch, mode):
    from orttrainer.graph import cpu_kernels

    monkeypatch.setitem(cpu_kernels.FAST_CPU_KERNELS, "ReluGrad", broken_relu_gradient)
    torch.manual_seed(0)
    options = ORTTrainerOptions({"device": {"id": "cpu"}, "debug": {"check_against_torch": mode}})
    trainer = ORTTrainer(MLP(), None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=options)
    x, y = mlp_batch()
    expected = r"gradient of 'fc1.weight' \(read by Gemm \(node '/model/fc1/Gemm', module 'fc1'\)\): largest absolute"
    if mode == "error":
        with pytest.raises(TorchMismatchError, match=expected):
            trainer.train_step(x, y)
        assert trainer._train_step_info.step == 0
    elif mode == "warn":
        with pytest.warns(UserWarning, match=expected):
            trainer.train_step(x, y)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            trainer.train_step(x, y)


def test_builtin_check_runs_once_per_graph_and_leaves_training_unchanged(monkeypatch):
    """With the check on (the default) a run equals torch step by step; the check ran exactly once."""
    from orttrainer.export import verify

    calls = []
    real = verify.torch_step
    monkeypatch.setattr(verify, "torch_step", lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    torch.manual_seed(0)
    batches_ = batches(cnn_batch, count=3)
    run_parity(CNN(), batches_, optim.SGDConfig(lr=0.1), sgd, loss_fn=F.cross_entropy)
    assert calls == [1]


class StochasticDepth(nn.Module):
    """A residual branch dropped per sample (timm's drop_path), a random draw besides dropout."""

    def __init__(self):
        super().__init__()
        self.branch = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        keep = x.new_empty(x.shape[0], 1).bernoulli_(0.5) if self.training else 1.0
        return self.head(x + self.branch(x) * keep / 0.5)


def test_builtin_check_is_skipped_with_a_warning_when_forward_draws_random_numbers(monkeypatch):
    """torch and ONNX Runtime cannot draw the same numbers, and the check's rounding estimate (torch rerun with
    nudged weights, drawing again) would excuse any difference: the check is skipped, saying why and where."""
    from orttrainer.export import verify

    monkeypatch.setattr(verify, "torch_step", lambda *args, **kwargs: pytest.fail("the check ran"))
    torch.manual_seed(0)
    trainer = ORTTrainer(StochasticDepth(), None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy,
                         options=cpu_options({"debug": {"check_against_torch": "error"}}))  # fmt: skip
    with pytest.warns(UserWarning, match=r"check_against_torch skipped for this graph: its forward draws random numbers"
                                         r".*RandomUniformLike \(node '/model/RandomUniformLike'"):  # fmt: skip
        losses = [trainer.train_step(torch.randn(16, 8), torch.randint(0, 3, (16,)))[0] for _ in range(3)]
    assert all(torch.isfinite(loss) for loss in losses)


class PickPositions(nn.Module):
    """Advanced indexing with index tensors from the batch, as sequence models pick the last token."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, x, position):
        rows = torch.arange(x.shape[0])
        return self.fc(x[rows, position] + x[:, position[0]] + x[rows, -1])


def test_negative_indices_count_from_the_end_like_torch():
    """torch's exporter computes a flattened index that is wrong for negative indices; orttrainer wraps them."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    positions = [torch.tensor([6, 4, -1, 6]), torch.tensor([-7, -2, 3, 0]), torch.tensor([-1, -1, -1, -1])]
    data = [(torch.randn(4, 7, 8, generator=generator), position, torch.randint(0, 3, (4,), generator=generator))
            for position in positions]  # fmt: skip
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*negative values")  # handled, so not passed on
        run_parity(PickPositions(), data, optim.SGDConfig(lr=0.1), sgd, loss_fn=F.cross_entropy)


class ChosenByArgmax(nn.Module):
    """Scores pick, by argmax, which value each position keeps: the scoring layer reaches the loss only
    through the chosen indices, so torch gives it no gradient and leaves it as it is."""

    def __init__(self):
        super().__init__()
        self.score, self.value, self.head = nn.Linear(8, 6), nn.Linear(8, 6), nn.Linear(1, 4)

    def forward(self, x):
        chosen = self.score(x).argmax(dim=-1, keepdim=True)
        return self.head(torch.gather(self.value(x), -1, chosen))


def test_weights_reaching_the_loss_only_through_indices_stay_as_in_torch():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 5, 8, generator=generator), torch.randn(4, 5, 4, generator=generator)) for _ in range(3)]
    model = ChosenByArgmax()
    score = copy.deepcopy(model.score.state_dict())
    trainer, _ = run_parity(model, batches, optim.SGDConfig(lr=0.1), functools.partial(torch.optim.SGD, lr=0.1),
                            loss_fn=F.mse_loss)  # fmt: skip
    state = trainer.state_dict(pytorch_format=True)
    assert all(torch.equal(state[f"score.{name}"], tensor) for name, tensor in score.items())


# ------------------------------------------------------------------ clamp
class ClampedScale(nn.Module):
    """(x * scale) clamped below by a tensor and above by a scalar, then a classifier. With scale at 1 on the first
    step, inputs equal to either bound are ties: torch gives x the whole gradient there (symbolics.elementwise.clamp)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))
        self.register_buffer("floor", torch.full((8,), 0.5))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head((x * self.scale).clamp(min=self.floor).clamp(max=2.0))


def test_clamp_to_tensor_and_scalar_bounds_trains_as_torch_also_at_ties():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    data = []
    for _ in range(3):
        x = torch.randn(6, 8, generator=generator) + 1.0
        x[:, :2], x[:, 6:] = 0.5, 2.0  # at the bounds
        data.append((x, torch.randint(0, 3, (6,), generator=generator)))
    run_parity(ClampedScale(), data, optim.SGDConfig(lr=0.5), functools.partial(torch.optim.SGD, lr=0.5),
               loss_fn=F.cross_entropy, options=cpu_options())  # fmt: skip



# ------------------------------------------------------------------ hardtanh, relu6
class HardTanhs(nn.Module):
    """x * scale through nn.ReLU6 (in place) and nn.Hardtanh, then a classifier. With scale at 1 on the first step,
    inputs equal to a bound are at it: torch's gradient is 0 there, clamp's (the same exported Clip) is not."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))
        self.relu6, self.hardtanh = nn.ReLU6(inplace=True), nn.Hardtanh(-1.0, 1.0)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        scaled = x * self.scale
        return self.head(torch.cat([self.relu6(scaled * 1.0), self.hardtanh(scaled)], 1))


def test_relu6_and_hardtanh_train_as_torch_also_at_their_bounds():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    data = []
    for _ in range(3):
        x = torch.randn(6, 8, generator=generator) * 3
        x[:, 0], x[:, 1], x[:, 2], x[:, 3] = 0.0, 6.0, -1.0, 1.0  # at the bounds
        data.append((x, torch.randint(0, 3, (6,), generator=generator)))
    run_parity(HardTanhs(), data, optim.SGDConfig(lr=0.5), functools.partial(torch.optim.SGD, lr=0.5),
               loss_fn=F.cross_entropy, options=cpu_options())  # fmt: skip



# ------------------------------------------------------------------ a weight read twice by one op
class SquaredWeights(nn.Module):
    """A gain squared (torch.square: one Mul reading the weight twice), a penalty w * w, a square matrix times itself."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 4)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 4))
        self.mix = nn.Parameter(torch.eye(4) + 0.1 * torch.randn(4, 4))

    def forward(self, x):
        mixed = self.fc(x) @ (self.mix @ self.mix)
        return mixed * torch.square(self.gain) + 0.01 * (self.gain * self.gain).sum()


def test_a_weight_read_twice_by_one_op_trains_as_torch():
    """onnxruntime-training's builder named both input gradients '<weight>_grad' and failed on the duplicate."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(5, 6, generator=generator), torch.randint(0, 4, (5,), generator=generator)) for _ in range(3)]
    run_parity(SquaredWeights(), data, optim.SGDConfig(lr=0.5), functools.partial(torch.optim.SGD, lr=0.5),
               loss_fn=F.cross_entropy, options=cpu_options())  # fmt: skip



# ------------------------------------------------------------------ detach
def test_detach_trains_as_torch_and_evaluates_as_the_module():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(5, 6, generator=generator) * 3, torch.randint(0, 4, (5,), generator=generator)) for _ in range(3)]
    model = StraightThrough()
    probe = copy.deepcopy(model.probe.state_dict())
    trainer, reference = run_parity(model, data, optim.SGDConfig(lr=0.5), functools.partial(torch.optim.SGD, lr=0.5),
                                    loss_fn=F.cross_entropy, options=cpu_options())  # fmt: skip
    state = trainer.state_dict(pytorch_format=True)
    assert all(torch.equal(state[f"probe.{name}"], tensor) for name, tensor in probe.items())
    reference.eval()
    torch.testing.assert_close(trainer.eval_step(*data[0])[1], reference(data[0][0]), atol=1e-5, rtol=1e-5)


class DoubleStraightThrough(nn.Module):
    """A straight-through rounding computed in float64: rewrites.detached passes float32 (and float16) exactly."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        h = self.fc(x)
        return h + (h.double().round().detach() - h.double().detach()).float()


def test_detach_of_a_float64_value_on_a_weights_path_is_refused_naming_the_node():
    trainer = ORTTrainer(DoubleStraightThrough(), None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=cpu_options())
    with pytest.raises(GradientBuildError, match=r"float32 and float16 values; Identity \(node '/model/Detach'\) detaches a DOUBLE"):
        trainer.train_step(torch.randn(5, 4), torch.randint(0, 3, (5,)))


def test_values_computed_under_no_grad_in_forward_get_no_gradient_as_in_torch():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(5, 6, generator=generator) * 3, torch.randint(0, 4, (5,), generator=generator)) for _ in range(3)]
    run_parity(NoGradTarget(), data, optim.SGDConfig(lr=0.5), functools.partial(torch.optim.SGD, lr=0.5),
               loss_fn=F.cross_entropy, options=cpu_options())  # fmt: skip


def test_a_graph_first_built_by_an_eval_step_under_no_grad_trains_as_torch():
    """The export traces with autograd on whatever the caller's mode: under the caller's torch.no_grad() every
    op would be recorded as detached (trace._NoGradResultsDetached) and the graph would train nothing."""
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.5), loss_fn=F.cross_entropy, options=cpu_options())
    x, y = mlp_batch(generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        trainer.eval_step(x, y)
    loss = trainer.train_step(x, y)[0]
    expected = F.cross_entropy(reference(x), y)
    expected.backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    torch.testing.assert_close(loss, expected.detach(), atol=1e-5, rtol=1e-5)
    assert_close_state(trainer, reference)



# ------------------------------------------------------------------ diagonal
class CrossCorrelation(nn.Module):
    """Barlow Twins' loss on two projections of the batch: the [batch, batch] similarity's diagonal pulled to 1
    (torch.diagonal, Tensor.diag), the rest pushed to 0; the batch size, and with it the diagonal, is dynamic."""

    def __init__(self):
        super().__init__()
        self.left, self.right = nn.Linear(6, 5), nn.Linear(6, 5)

    def forward(self, x):
        similarity = self.left(x) @ self.right(x).t() / x.shape[1]
        on = (torch.diagonal(similarity) - 1.0).pow(2).sum()
        return on + 0.05 * (similarity.pow(2).sum() - similarity.diag().pow(2).sum())


def test_diagonal_of_a_batch_sized_matrix_trains_as_torch_at_two_batch_sizes():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(size, 6, generator=generator),) for size in (7, 7, 4)]
    run_parity(CrossCorrelation(), data, optim.SGDConfig(lr=0.05), functools.partial(torch.optim.SGD, lr=0.05),
               loss_fn=None, options=cpu_options(), reference_loss=lambda module, batch: module(*batch))  # fmt: skip


class BatchStatisticsCNN(nn.Module):
    """BatchNorms without running statistics (``track_running_stats=False``: torch normalizes by the batch's
    statistics in training and in eval), one without affine weights, around a max pool."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4, track_running_stats=False), nn.ReLU(),
                                      nn.MaxPool2d(2), nn.Flatten())  # fmt: skip
        self.head = nn.Sequential(nn.Linear(4 * 8 * 8, 8), nn.BatchNorm1d(8, affine=False, track_running_stats=False),
                                  nn.ReLU(), nn.Linear(8, 10))  # fmt: skip

    def forward(self, images):
        return self.head(self.features(images))


@pytest.mark.parametrize("kernels", ["torch", "onnxruntime"])
def test_batchnorm_without_running_statistics_trains_and_evaluates_as_torch_at_two_batch_sizes(tmp_path, kernels):
    """torch's exporter refused it ("batch_size and channel_size must be non-None") for a dynamic batch. SGD:
    the gradient of the convolution's bias before a batch-statistics BatchNorm is 0 up to rounding, which
    Adam's first step would scale to the learning rate."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    data = [cnn_batch(size, generator) for size in (8, 8, 5)]
    options = cpu_options({"utils": {"convolution_kernels": kernels}})
    trainer, reference = run_parity(BatchStatisticsCNN(), data, optim.SGDConfig(lr=0.1), functools.partial(torch.optim.SGD, lr=0.1),
                                    loss_fn=F.cross_entropy, options=options)  # fmt: skip
    reference.eval()
    for images, labels in (data[0], data[2]):
        torch.testing.assert_close(trainer.eval_step(images, labels)[1], reference(images), atol=1e-5, rtol=1e-5)
    path = tmp_path / "model.onnx"
    trainer.save_as_onnx(str(path), with_loss=False)  # spelled out: a plain ONNX Runtime has no training-mode kernel
    assert "BatchNormalization" not in {node.op_type for node in onnx.load(str(path)).graph.node}
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (output,) = session.run(None, {session.get_inputs()[0].name: data[2][0].numpy()})
    torch.testing.assert_close(torch.from_numpy(output), reference(data[2][0]), atol=1e-5, rtol=1e-5)


class MaskedAttention(nn.Module):
    """One attention head under a mask that comes with the batch: bool, or float (-inf where masked) around a
    learned bias."""

    def __init__(self, float_mask):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.bias = nn.Parameter(torch.randn(4, 4) * 0.1) if float_mask else None

    def forward(self, x, keep):
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        mask = keep if self.bias is None else torch.where(keep, self.bias, -math.inf)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).squeeze(1)


@pytest.mark.parametrize("float_mask", [False, True], ids=["bool-mask", "float-mask"])
def test_attention_rows_with_every_key_masked_train_as_torch(float_mask):
    """A query that sees no key (left padding, a sliding window over padding) gets 0 and no gradient, as in torch;
    the exporter's softmax gave NaN gradients. The first batch of the shape has no such row, so its graph's
    first-step check passed: the later batches trained every weight into NaN without a word."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    causal = torch.ones(4, 4, dtype=torch.bool).tril().expand(3, 1, 4, 4)
    masks = [causal.clone() for _ in range(3)]
    masks[1][1, :, 2:, :] = False  # two queries of sequence 1 see nothing
    masks[2][:, :, 0, :] = False  # the first query of every sequence sees nothing
    data = [(torch.randn(3, 4, 8, generator=generator), mask, torch.randn(3, 4, 8, generator=generator)) for mask in masks]

    def reference_loss(module, batch):
        return F.mse_loss(module(*batch[:2]), batch[2])

    trainer, reference = run_parity(MaskedAttention(float_mask), data, optim.SGDConfig(lr=0.5),
                                    functools.partial(torch.optim.SGD, lr=0.5), loss_fn=F.mse_loss,
                                    reference_loss=reference_loss)  # fmt: skip
    x, keep, target = data[2]
    output = trainer.eval_step(x, keep, target)[1]
    torch.testing.assert_close(output, reference.eval()(x, keep), atol=1e-6, rtol=1e-5)
    assert torch.equal(output[:, 0], torch.zeros_like(output[:, 0]))


class AnswerSpan(nn.Module):
    """Hugging Face's question-answering loss: positions past the sequence are clamped to its length, which
    is also the cross_entropy's ignore_index (``start_logits.size(1)``: a size, a tensor in the trace)."""

    def __init__(self):
        super().__init__()
        self.scores = nn.Linear(8, 1)

    def forward(self, x, positions):
        scores = self.scores(x).squeeze(-1)
        ignored = scores.size(1)
        return F.cross_entropy(scores, positions.clamp(0, ignored), ignore_index=ignored)


def test_cross_entropy_whose_ignore_index_is_a_size_trains_as_torch_at_two_lengths():
    """It failed the export ("Expected node type 'onnx::Constant' for argument 'ignore_index'")."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(3, length, 8, generator=generator), torch.tensor(positions))
            for length, positions in ((5, [1, 7, 4]), (9, [9, 0, 12]), (5, [2, 5, 3]))]  # fmt: skip
    run_parity(AnswerSpan(), data, optim.SGDConfig(lr=0.5), functools.partial(torch.optim.SGD, lr=0.5), loss_fn=None,
               reference_loss=lambda module, batch: module(*batch))  # fmt: skip


@pytest.mark.parametrize("name", sorted(refusals.GRADIENT_OF_THEIR_FORWARD))
def test_functions_trained_as_their_forward_have_its_gradient_at_edge_values(name):
    """The custom autograd Functions the trainer exports as their forward (refusals.GRADIENT_OF_THEIR_FORWARD):
    their backward equals autograd of their forward in float64, edge values included."""
    module_name, _, qualname = name.rpartition(".")
    function = getattr(pytest.importorskip(module_name, reason="the Function's library is not installed"), qualname)
    magnitudes = [0.0, 1e-30, 1e-8, 1e-3, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0, 1e4, 1e19]
    x = torch.tensor([sign * value for value in magnitudes for sign in (1.0, -1.0)], dtype=torch.float64, requires_grad=True)
    upstream = torch.linspace(0.5, 2.0, len(x), dtype=torch.float64)
    (custom,) = torch.autograd.grad(function.apply(x), x, upstream)
    x_plain = x.detach().clone().requires_grad_()
    forward = function.forward(type("Context", (), {"save_for_backward": lambda *tensors: None})(), x_plain)
    (plain,) = torch.autograd.grad(forward, x_plain, upstream)
    torch.testing.assert_close(custom, plain, rtol=1e-6, atol=1e-12, equal_nan=True)


class PaddedPooling(nn.Module):
    """EfficientNet's stem and pooler in small: ZeroPad2d before a strided conv, an average pool with
    ceil_mode whose windows overrun the input (count_include_pad, torch's default)."""

    def __init__(self, kernel=3, stride=2):
        super().__init__()
        self.pad = nn.ZeroPad2d((0, 1, 0, 1))
        self.conv = nn.Conv2d(3, 4, 3, stride=2)
        self.norm = nn.BatchNorm2d(4, eps=1e-3)
        self.pool = nn.AvgPool2d(kernel, stride, ceil_mode=True)
        self.head = nn.LazyLinear(3)

    def forward(self, images):
        return self.head(self.pool(torch.relu(self.norm(self.conv(self.pad(images))))).flatten(1))


@pytest.mark.parametrize("kernel, stride", [(3, 2), (1280, 1280)], ids=["partial-windows", "window-beyond-the-input"])
def test_average_pool_with_ceil_mode_trains_evaluates_and_saves_as_torch(tmp_path, kernel, stride):
    """ONNX Runtime's AveragePool divides a partial ceil_mode window by the whole kernel (the eval graph and a
    saved model had other values than torch's; rewrites.torch_pools), and torch's pads for F.pad came as
    a chain of ops after which shape inference knew no size (the pool was refused; symbolics.layers._onnx_paddings)."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    model = PaddedPooling(kernel, stride)
    model(torch.randn(2, 3, 8, 8))  # the lazy head takes its size
    data = [(torch.randn(size, 3, 8, 8, generator=generator), torch.randint(0, 3, (size,), generator=generator)) for size in (4, 3, 4)]
    trainer, reference = run_parity(model, data, optim.SGDConfig(lr=0.1), functools.partial(torch.optim.SGD, lr=0.1),
                                    loss_fn=F.cross_entropy)  # fmt: skip
    reference.eval()
    images, labels = data[1]
    torch.testing.assert_close(trainer.eval_step(images, labels)[1], reference(images), atol=1e-5, rtol=1e-5)
    path = tmp_path / "model.onnx"
    trainer.save_as_onnx(str(path), with_loss=False)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (output,) = session.run(None, {session.get_inputs()[0].name: images.numpy()})
    torch.testing.assert_close(torch.from_numpy(output), reference(images), atol=1e-5, rtol=1e-5)


class WeightStandardizedConv(nn.Conv2d):
    """BiT's convolution: its kernel standardized per output channel by an affine-free F.batch_norm in training mode."""

    def forward(self, x):
        kernel = F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None, training=True, momentum=0.0, eps=1e-6)
        return F.conv2d(x, kernel.reshape_as(self.weight), self.bias, self.stride, self.padding)


class WeightStandardized(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = WeightStandardizedConv(3, 4, 3, padding=1), WeightStandardizedConv(4, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.second(torch.relu(self.first(x))).mean((2, 3)))


def test_weight_standardized_convolutions_train_like_torch():
    """Each standardization's BatchNorm scales by a constant of ones, which ONNX Runtime's optimizer merges into one
    (with the placeholder variance); the gradient builder names every node's scale gradient after it, and the build
    failed with a duplicate definition. Each node now reads its own copy."""
    _trains_like_torch_on_small_images(WeightStandardized)


def _trains_like_torch_on_small_images(make):
    """Three SGD steps on 2 images of 3x5x5 with 3 classes, against torch's loop (loss and every state_dict key)."""
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, 3, 5, 5, generator=generator), torch.randint(0, 3, (2,), generator=generator)) for _ in range(3)]
    torch.manual_seed(0)
    run_parity(make(), batches, optim.SGDConfig(lr=0.1), functools.partial(torch.optim.SGD, lr=0.1), loss_fn=F.cross_entropy)


class PoolingPyramid(nn.Module):
    """PSPNet's pyramid pooling over a 5x5 map: adaptive averages to 1, 2, 3 and 6 (overlapping windows), then to 4x2."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.pools = nn.ModuleList(nn.AdaptiveAvgPool2d(size) for size in (1, 2, 3, 6, (4, 2)))
        self.head = nn.Linear(4 * (1 + 4 + 9 + 36 + 8), 3)

    def forward(self, x):
        features = torch.relu(self.conv(x))
        return self.head(torch.cat([pool(features).flatten(1) for pool in self.pools], 1))


def test_adaptive_average_pools_to_sizes_that_do_not_divide_train_like_torch():
    _trains_like_torch_on_small_images(PoolingPyramid)


class EvalOnlyBookkeeping(nn.Module):
    """Its forward sets an attribute in eval mode only, as NLLB-MoE's router sets its expert capacity."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.scale = 1.0

    def forward(self, x):
        if not self.training:
            self.scale = 3.0
            self.seen_in_eval = True
        return self.linear(x) * self.scale


def test_attributes_forward_sets_in_eval_mode_do_not_reach_the_training_graph():
    """The trainer runs its copy of the module once in eval mode (to learn the outputs) before tracing the training
    graph: that graph trained with scale 3 (loss 3.25 against torch's 1.34) and the first-step check, running the same
    copy, agreed with it. The copy's attributes are now restored after that run.

    The eval graph is the training trace in inference mode (dropout off, BatchNorm on its statistics), as the legacy
    ORTTrainer's: a branch forward takes in eval mode only is not in it. debug.check_model_export says so."""
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 4, generator=generator), torch.randn(8, 4, generator=generator)) for _ in range(3)]
    torch.manual_seed(0)
    model = EvalOnlyBookkeeping()
    run_parity(model, batches, optim.SGDConfig(lr=0.1), functools.partial(torch.optim.SGD, lr=0.1), loss_fn=F.mse_loss)
    assert model.scale == 1.0 and not hasattr(model, "seen_in_eval"), "the user's module changed"
    checked = ORTTrainer(EvalOnlyBookkeeping(), None, optim.SGDConfig(lr=0.1), loss_fn=F.mse_loss,
                         options=cpu_options({"debug": {"check_model_export": True}}))  # fmt: skip
    with pytest.raises(AssertionError, match=r"debug.check_model_export: ONNX output '.*' differs from torch"):
        checked.train_step(*batches[0])


@pytest.mark.parametrize("mode", ["error", "warn", "off"])
def test_first_eval_step_of_a_graph_is_checked_against_the_module_in_eval_mode(mode):
    """A branch forward takes in eval mode only is not in the eval graph (the training trace in inference mode): the
    first eval_step on each graph compares with the module in eval mode and says so; it returned other values
    silently (NLLB-MoE's eval-mode expert capacity)."""
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=generator), torch.randn(8, 4, generator=generator)
    torch.manual_seed(0)
    model = EvalOnlyBookkeeping()
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=F.mse_loss,
                         options=cpu_options({"debug": {"check_against_torch": mode}}))  # fmt: skip
    trainer.train_step(x, y)
    message = r"eval_step differs from the module in eval mode .* a branch forward takes only when not self.training"
    if mode == "error":
        with pytest.raises(TorchMismatchError, match=r"(?s)" + message + r".*\n- output 'loss'.*\n- output 'output'"):
            trainer.eval_step(x, y)
        return
    with warnings.catch_warnings(record=True) as heard:
        warnings.simplefilter("always")
        loss, output = trainer.eval_step(x, y)
        trainer.eval_step(x, y)  # once per graph
    assert len([w for w in heard if "eval_step differs" in str(w.message)]) == (mode == "warn")
    trained = trainer.state_dict(pytorch_format=True)
    torch.testing.assert_close(output, x @ trained["linear.weight"].T + trained["linear.bias"])  # the training-mode branch
    assert model.scale == 1.0 and not hasattr(model, "seen_in_eval"), "the user's module changed"


class LargestIdPicks(nn.Module):
    """torch.max / torch.min over a dim of integer tensors (LongT5's block ids): torch's symbolic, where the float one
    gave ONNX's IsNaN an int64 input and the build failed inside ONNX Runtime."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(10, 4)

    def forward(self, ids):
        largest, at = torch.max(ids, dim=-1)
        smallest = torch.min(ids, dim=-1, keepdim=True).values.squeeze(-1)
        return self.embedding(largest) + self.embedding(smallest) + at.unsqueeze(-1).float()


def test_max_and_min_over_a_dim_of_integer_tensors_train_like_torch():
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 10, (3, 5), generator=generator), torch.randn(3, 4, generator=generator)) for _ in range(2)]
    batches[0][0][0] = torch.tensor([7, 2, 7, 1, 1])  # ties: the first of them, as torch
    torch.manual_seed(0)
    run_parity(LargestIdPicks(), batches, optim.SGDConfig(lr=0.1), functools.partial(torch.optim.SGD, lr=0.1),
               loss_fn=F.mse_loss)  # fmt: skip


# ------------------------------------------------------------------ scatters that add
def _in_place_index_add(hidden, targets, messages):
    return hidden.clone().index_add_(0, targets, messages, alpha=0.5)


def _accumulated_in_place(hidden, targets, messages):
    summed = hidden.clone()
    summed.index_put_((targets,), messages, accumulate=True)
    return summed


SUM_AGGREGATIONS = {
    "index_add": lambda hidden, targets, messages: hidden.index_add(0, targets, messages),
    "index_add_ alpha": _in_place_index_add,
    "scatter_add": lambda hidden, targets, messages: hidden.scatter_add(0, targets[:, None].expand_as(messages), messages),
    "scatter_reduce sum": lambda hidden, targets, messages: hidden.scatter_reduce(
        0, targets[:, None].expand_as(messages), messages, "sum"),
    "index_put accumulate": lambda hidden, targets, messages: hidden.index_put((targets,), messages, accumulate=True),
    "index_put_ accumulate": _accumulated_in_place,
}  # fmt: skip


class MessagePassing(nn.Module):
    """A graph network layer: each edge's message (a Linear of its source node) summed into its target node,
    as torch_geometric's sum aggregation does, by one of ``SUM_AGGREGATIONS``."""

    def __init__(self, aggregation):
        super().__init__()
        self.embed, self.message, self.out = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.aggregate = SUM_AGGREGATIONS[aggregation]

    def forward(self, nodes, sources, targets):
        hidden = torch.relu(self.embed(nodes))
        return self.out(torch.tanh(self.aggregate(hidden, targets, self.message(hidden[sources]))))


def graph_batches(target_lists):
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(6, 4, generator=generator), torch.randint(0, 6, (len(targets),), generator=generator),
             torch.tensor(targets, dtype=torch.int64), torch.randint(0, 3, (6,), generator=generator))
            for targets in target_lists]  # fmt: skip


@pytest.mark.parametrize("aggregation", list(SUM_AGGREGATIONS))
def test_sums_over_repeated_indices_train_like_torch(aggregation):
    """Repeated indices add up, as in torch, in batches after a first one without them (which the first-step check
    sees). torch's exporter wrote index_add and index_put(accumulate=True) as a scatter into zeros that keeps one
    value per repeated index, silently; and onnxruntime-training's gradient of a scatter that adds cleared the
    gradient of what it adds into where the values land."""
    batches = graph_batches([[5, 3, 1, 0, 2, 4], [0, 0, 0, 1, 1, 2], [3, 3, 3, 3, 3, 3], [2, 2, 5, 5, 0, 1, 4, 4, 4]])
    torch.manual_seed(0)
    run_parity(MessagePassing(aggregation), batches, optim.SGDConfig(lr=0.1), sgd, loss_fn=F.cross_entropy)


@pytest.mark.parametrize("aggregation", ["index_add", "scatter_add", "index_put accumulate"])
def test_sums_over_repeated_indices_before_opset_16_are_refused_naming_the_option(aggregation):
    trainer = ORTTrainer(MessagePassing(aggregation), None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy,
                         options=cpu_options({"_internal_use": {"onnx_opset_version": 15}}))  # fmt: skip
    with pytest.raises(ExportError, match=r"adds up the values of repeated indices, which an ONNX scatter does from "
                                          r"opset 16 on; this export is at opset 15: set ORTTrainerOptions\(\{'_internal_use'"
                                          r": \{'onnx_opset_version': 16\}\}\)"):  # fmt: skip
        trainer.train_step(*graph_batches([[0, 1, 2, 3, 4, 5]])[0])


class MaskedAccumulation(nn.Module):
    """``x.index_put_((mask,), values, accumulate=True)`` with a boolean mask: each chosen element gets its value added."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        hidden = self.fc(x)
        chosen = x[:, 0] > 0
        return hidden.index_put((chosen,), hidden[chosen] * 2, accumulate=True)


def test_accumulation_through_a_boolean_mask_trains_like_torch():
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(5, 4, generator=generator), torch.randn(5, 4, generator=generator)) for _ in range(3)]
    torch.manual_seed(0)
    run_parity(MaskedAccumulation(), batches, optim.SGDConfig(lr=0.1), sgd, loss_fn=F.mse_loss)


class MaskedPositions(nn.Module):
    """Positions a mask chooses get a learned embedding (``hidden[mask] = embedding``, Wav2Vec2's and HuBERT's masked
    time steps given to forward), or have it added (``accumulate=True``): one value per position, broadcast to every
    chosen one."""

    def __init__(self, accumulate):
        super().__init__()
        self.fc, self.embedding, self.accumulate = nn.Linear(4, 4), nn.Parameter(torch.randn(4)), accumulate

    def forward(self, x, mask):
        hidden = self.fc(x)
        if self.accumulate:
            return hidden.index_put((mask,), self.embedding * 2, accumulate=True)
        hidden[mask] = self.embedding
        return hidden


@pytest.mark.parametrize("accumulate", [False, True], ids=["set", "accumulate"])
def test_a_value_broadcast_to_the_positions_a_mask_chooses_trains_like_torch(accumulate):
    """torch's exporter gave the value to a masked_scatter, which takes one value per chosen element: ONNX Runtime
    failed on the shapes (setting), or the first chosen element alone got it (accumulating)."""
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(3, 5, 4, generator=generator), torch.rand(3, 5, generator=generator) < 0.4,
                torch.randn(3, 5, 4, generator=generator)) for _ in range(3)]  # fmt: skip
    torch.manual_seed(0)
    run_parity(MaskedPositions(accumulate), batches, optim.SGDConfig(lr=0.1), sgd, loss_fn=F.mse_loss)


class ScatterMaximum(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, targets):
        hidden = self.fc(x)
        return hidden.scatter_reduce(0, targets[:, None].expand_as(hidden), hidden * 2, "amax")


def test_scatter_reductions_whose_gradient_onnx_runtime_ignores_are_refused():
    trainer = ORTTrainer(ScatterMaximum(), None, optim.SGDConfig(lr=0.1), loss_fn=F.mse_loss, options=cpu_options())
    with pytest.raises(GradientBuildError, match=r"ScatterElements with reduction='max' \(torch's scatter_reduce with "
                                                 r"'prod', 'amax' or 'amin'\): onnxruntime-training's gradient"):  # fmt: skip
        trainer.train_step(torch.randn(5, 4), torch.tensor([0, 0, 1, 2, 2]), torch.randn(5, 4))


@pytest.mark.parametrize("aggregation", ["index_add", "index_put accumulate"])
def test_sums_over_repeated_indices_train_under_mixed_precision(aggregation):
    """The scatters that add stay in float32 (ONNX Runtime's CPU kernels add in float32 only): the float16 losses
    track the float32 ones."""

    batches, make = graph_batches([[0, 0, 1, 2, 3, 3]] * 6), functools.partial(MessagePassing, aggregation)
    float32, float16 = (_sgd_losses(make, batches, F.cross_entropy, mixed) for mixed in (False, True))
    np.testing.assert_allclose(float16, float32, rtol=2e-2)
    assert float32[-1] < float32[0]


def _sgd_losses(make, batches, loss_fn, mixed_precision):
    """The losses of an ORTTrainer (SGD, lr 0.1) of ``make()`` over ``batches``, with or without mixed precision."""
    torch.manual_seed(0)
    options = {"mixed_precision": {"enabled": mixed_precision, "loss_scaler": amp.DynamicLossScaler(loss_scale=1024.0)}}
    trainer = ORTTrainer(make(), None, optim.SGDConfig(lr=0.1), loss_fn=loss_fn, options=cpu_options(options))
    return [trainer.train_step(*batch)[0].item() for batch in batches]


class InterleavedRotaryAttention(nn.Module):
    """Attention whose rotary angles are interleaved by ``repeat_interleave(..., dim=-1)`` (Cohere's, GPT-J's layout):
    torch's symbolic added the rank to the trace's constant -1 in place, so the later ops reading -1 (the transpose,
    the softmax) got 1 instead, and ONNX Runtime failed on the shapes."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 3)

    def forward(self, x):
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, 2, 4).permute(2, 0, 3, 1, 4)
        angles = (torch.arange(length, dtype=torch.float32)[:, None] * torch.tensor([1.0, 0.1])).repeat_interleave(2, dim=-1)
        scores = (q * angles.cos()) @ (k * angles.cos()).transpose(-1, -2)
        return self.out((scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(batch, length, 8))


def test_repeat_interleave_over_a_negative_dim_leaves_other_ops_dims_as_written():
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, length, 8, generator=generator), torch.randn(2, length, 3, generator=generator)) for length in (5, 7, 5)]
    torch.manual_seed(0)
    run_parity(InterleavedRotaryAttention(), batches, optim.SGDConfig(lr=0.1), sgd, loss_fn=F.mse_loss)


# ------------------------------------------------------------------ torch's symbolics that computed other values
class AnnotatedLayerNorm(nn.Module):
    """The Annotated Transformer's LayerNorm, ``(x - mean) / (std + eps)``, over rows that padding makes all zero."""

    def __init__(self):
        super().__init__()
        self.embed, self.gain, self.out = nn.Linear(4, 6), nn.Parameter(torch.ones(6)), nn.Linear(6, 3)

    def forward(self, x, keep):
        hidden = self.embed(x) * keep
        mean, std = hidden.mean(-1, keepdim=True), hidden.std(-1, keepdim=True)
        return self.out(self.gain * (hidden - mean) / (std + 1e-6) + torch.linalg.vector_norm(hidden, 3, -1, keepdim=True))


class OffsetBuckets(nn.Module):
    """Buckets of signed offsets by floor division (relative positions), negative only in later batches."""

    def __init__(self):
        super().__init__()
        self.buckets, self.fc = nn.Embedding(8, 4), nn.Linear(4, 3)

    def forward(self, x, offsets):
        return self.fc(x + self.buckets(offsets // 2 + 4) * (offsets // 3).unsqueeze(-1))


class ScoresIntoScratch(nn.Module):
    """Attention scores by ``torch.baddbmm(scratch, q, k^T, beta=0)``, as older attention code wrote them: torch ignores
    the scratch tensor (here the batch's, with NaN in later batches)."""

    def __init__(self):
        super().__init__()
        self.qk, self.out = nn.Linear(4, 8), nn.Linear(2, 3)

    def forward(self, x, scratch):
        q, k = self.qk(x).chunk(2, dim=-1)
        return self.out(torch.baddbmm(scratch, q, k.transpose(1, 2), beta=0.0, alpha=0.5).softmax(-1))


class NearestCentres(nn.Module):
    """Distances of embeddings to learned centres and to each other (a metric-learning loss's), by torch.cdist."""

    def __init__(self, compute_mode):
        super().__init__()
        self.embed, self.centres, self.compute_mode = nn.Linear(4, 3), nn.Parameter(torch.randn(3, 3)), compute_mode

    def forward(self, x, _):
        embedded = self.embed(x)
        to_centres = torch.cdist(embedded, self.centres, compute_mode=self.compute_mode)
        within = torch.cdist(embedded, embedded, p=1.0) + torch.cdist(embedded, embedded, compute_mode=self.compute_mode)
        return -to_centres + within[:, :3]


def _later_batches(make_second, count=3):
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(5, 4, generator=generator), make_second(step), torch.randn(5, 3, generator=generator))
            for step in range(count)]  # fmt: skip


def _zero_rows_later(step):
    return torch.ones(5, 1) if step == 0 else torch.tensor([[1.0], [0.0], [1.0], [0.0], [1.0]])


def _negative_offsets_later(step):
    return torch.tensor([0, 1, 2, 3, 4]) if step == 0 else torch.tensor([-1, -4, 3, -7, 0])


def _nan_scratch_later(step):
    scratch = torch.zeros(5, 2, 2)
    scratch[1, 0, 1] = float("nan") if step else 0.0
    return scratch


@pytest.mark.parametrize("make, make_second", [
    (AnnotatedLayerNorm, _zero_rows_later),
    (OffsetBuckets, _negative_offsets_later),
    (lambda: NearestCentres("use_mm_for_euclid_dist"), lambda step: torch.zeros(5)),
    (lambda: NearestCentres("donot_use_mm_for_euclid_dist"), lambda step: torch.zeros(5)),
], ids=["std-and-norm-of-zero-rows", "floor-division-of-negatives", "cdist-product-form", "cdist-differences"])  # fmt: skip
def test_symbolics_that_computed_other_values_train_like_torch(make, make_second):
    """Each passed the first-step check on a first batch without the case, then trained other than torch: the std and
    the 3-norm of a zero row had NaN gradients (torch's are 0), floor division truncated negatives towards 0 (torch's
    symbolic, "deprecated behavior"), cdist summed signed differences for p=1 and gave NaN gradients at distance 0.
    Against a float64 run: the std, the norm and cdist's product form (|a|^2 + |b|^2 - 2ab) cancel; at the third step
    float32 torch's product-form loss lands 4.9e-5 from float64's and orttrainer's 2.6e-6, where a fixed 1e-5 between
    the two float32 losses held on one CPU's kernels only."""
    torch.manual_seed(0)
    run_parity(make(), _later_batches(make_second), optim.SGDConfig(lr=0.1), sgd, loss_fn=F.mse_loss, float64=True)


def test_baddbmm_with_beta_zero_ignores_its_input_like_torch():
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(5, 2, 4, generator=generator), _nan_scratch_later(step), torch.randn(5, 2, 3, generator=generator))
               for step in range(3)]  # fmt: skip
    torch.manual_seed(0)
    run_parity(ScoresIntoScratch(), batches, optim.SGDConfig(lr=0.1), sgd, loss_fn=F.mse_loss)


def test_cdist_whose_form_depends_on_a_changing_row_count_is_refused_naming_the_fix():
    trainer = ORTTrainer(NearestCentres("use_mm_for_euclid_dist_if_necessary"), None, optim.SGDConfig(lr=0.1), loss_fn=F.mse_loss, options=cpu_options())
    with pytest.raises(ExportError, match=r"cdist in module 'model' over a number of rows that changes with the batch.*"
                                          r"pass compute_mode='use_mm_for_euclid_dist' or 'donot_use_mm_for_euclid_dist'"):
        trainer.train_step(*_later_batches(lambda step: torch.zeros(5))[0])


class CentreDistances(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.embed, self.centres, self.p = nn.Linear(4, 3), nn.Parameter(torch.randn(3, 3)), p

    def forward(self, x, _):
        return torch.cdist(self.embed(x), self.centres, p=self.p)


@pytest.mark.parametrize("p", [0.5, float("inf")])
def test_cdist_of_a_norm_orttrainer_does_not_train_is_refused_naming_p(p):
    trainer = ORTTrainer(CentreDistances(p), None, optim.SGDConfig(lr=0.1), loss_fn=F.mse_loss, options=cpu_options())
    with pytest.raises(ExportError, match=rf"cdist in module 'model' with p={p}: orttrainer trains p >= 1 finite"):
        trainer.train_step(*_later_batches(lambda step: torch.zeros(5))[0])


class LayerNormOverItsOwnWidth(nn.Module):
    """``F.layer_norm(h, (h.shape[-1],))``: the normalized shape read from the tensor, a traced size."""

    def __init__(self):
        super().__init__()
        self.embed, self.out = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x):
        hidden = self.embed(x)
        return self.out(F.layer_norm(hidden, (hidden.shape[-1],)))


def test_layer_norm_over_a_shape_read_from_its_input_trains_like_torch():
    """torch's symbolic needs the normalized shape as constants and failed the export ("Failed to export a node")."""
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(rows, 4, generator=generator), torch.randn(rows, 3, generator=generator)) for rows in (3, 5, 3)]
    torch.manual_seed(0)
    run_parity(LayerNormOverItsOwnWidth(), batches, optim.SGDConfig(lr=0.1), sgd, loss_fn=F.mse_loss)


class PackedLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm, self.out = nn.LSTM(4, 6, batch_first=True), nn.Linear(6, 3)

    def forward(self, x, lengths):
        _, (state, _) = self.lstm(nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))
        return self.out(state[-1])


def test_packed_sequences_are_refused_naming_the_padded_form():
    """torch's exporter fails inside its peephole pass ("vector::_M_range_check") on a PackedSequence; the error says
    what it is and what trains instead (tests/zoo.py's LSTM over padded batches)."""
    trainer = ORTTrainer(PackedLSTM(), None, optim.SGDConfig(lr=0.1), loss_fn=F.mse_loss, options=cpu_options())
    with pytest.raises(ExportError, match=r"pack_padded_sequence .* give the layer the padded batch instead and read each "
                                          r"sequence's output at its last real step"):  # fmt: skip
        trainer.train_step(torch.randn(3, 5, 4), torch.tensor([5, 3, 2]), torch.randn(3, 3))


class BatchAxisOps(nn.Module):
    """Ops along the batch axis, whose size changes from batch to batch: a flip, a split whose last part is shorter,
    and a stable sort that keeps tied values in their order."""

    def __init__(self, op):
        super().__init__()
        self.embed, self.out, self.op = nn.Linear(4, 6), nn.Linear(6, 3), op

    def forward(self, x):
        hidden = self.embed(x)
        if self.op == "flip":
            hidden = hidden.flip(0) * torch.arange(1.0, hidden.shape[0] + 1)[:, None]
        elif self.op == "split":
            hidden = torch.cat([part * (index + 1) for index, part in enumerate(hidden.split(2, dim=0))])
        else:  # ties: keys rounded to whole numbers (the value's gradient passing straight through the rounding)
            keys = hidden.detach().round() + (hidden - hidden.detach())
            order = keys.argsort(dim=0, stable=True, descending=True)
            hidden = hidden.gather(0, order) + keys.sort(dim=1, stable=True).values
        return self.out(hidden)


@pytest.mark.parametrize("op", ["flip", "split", "stable-sort"])
def test_ops_along_an_axis_whose_size_changes_train_like_torch(op):
    """torch.flip along it was refused (a Gather of constant indices needs the size); torch's split symbolic took the
    axis to hold a whole number of parts, and ONNX Runtime failed on a shorter last part; the exporter refused
    sort(stable=True) with "Out parameter is not supported" (ONNX Runtime's TopK keeps ties in order, as torch).
    Against a float64 run: the flip scales rows by up to 64 and the training diverges (a loss of 1.6e11 at the 64-row
    step), amplifying float32 rounding that moves with the CPU's kernels (0.95 of the fixed 1e-5 on one CPU)."""
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(rows, 4, generator=generator) * 2, torch.randn(rows, 3, generator=generator)) for rows in (5, 5, 7, 64)]
    torch.manual_seed(0)
    run_parity(BatchAxisOps(op), batches, optim.SGDConfig(lr=0.1), sgd, loss_fn=F.mse_loss, float64=True)


class CountedClasses(nn.Module):
    def __init__(self, cumulate=False):
        super().__init__()
        self.fc, self.cumulate = nn.Linear(4, 3), cumulate

    def forward(self, x):
        scores = self.fc(x)
        if self.cumulate:
            return scores.cumsum(0)
        return scores + F.one_hot(scores.argmax(-1)).float().sum(-1, keepdim=True)


@pytest.mark.parametrize("cumulate, error, message", [
    (False, ExportError, r"F.one_hot in module 'model' without num_classes takes the number of classes from the batch's "
                         r"largest value; pass num_classes"),
    (True, GradientBuildError, r"CumSum node '/model/CumSum' \(torch.cumsum\) along axis 0, whose size changes with the "
                               r"batch"),
], ids=["one_hot-without-num_classes", "cumsum-along-the-batch"])  # fmt: skip
def test_ops_the_graph_cannot_hold_for_every_batch_are_refused_by_name(cumulate, error, message):
    """F.one_hot() failed inside ONNX Runtime ("Depth is negative"); cumsum along the batch axis said only that a
    CumSum needs static dimensions."""
    trainer = ORTTrainer(CountedClasses(cumulate), None, optim.SGDConfig(lr=0.1), loss_fn=F.mse_loss, options=cpu_options())
    with pytest.raises(error, match=message):
        trainer.train_step(torch.randn(5, 4), torch.randn(5, 3))


class RootsSortsAndExtremes(nn.Module):
    """maximum, a root of a ReLU, a stable sort and a top-k in one model, for the float16 graph."""

    def __init__(self):
        super().__init__()
        self.embed, self.out = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x, _):
        hidden = self.embed(x)
        features = torch.maximum(hidden, -hidden * 0.5).sqrt() + torch.relu(hidden).sqrt()
        return self.out(features + hidden.sort(dim=1, stable=True).values + hidden.topk(2, dim=1).values.sum(1, keepdim=True))


@pytest.mark.parametrize("make, make_second", [
    (AnnotatedLayerNorm, _zero_rows_later),
    (OffsetBuckets, _negative_offsets_later),
    (lambda: NearestCentres("use_mm_for_euclid_dist"), lambda step: torch.zeros(5)),
    (RootsSortsAndExtremes, lambda step: torch.zeros(5)),
], ids=["std-and-norm", "floor-division", "cdist-product-form", "roots-sorts-extremes"])  # fmt: skip
def test_roots_sorts_distances_and_floor_division_train_under_mixed_precision(make, make_second):
    """The float16 losses track the float32 ones. cdist's product form crashed ONNX Runtime's session creation (a
    segmentation fault) in a float16 graph until GemmTransposeFusion was turned off there (session.py)."""
    batches = _later_batches(make_second)
    float32, float16 = (_sgd_losses(make, batches, F.mse_loss, mixed) for mixed in (False, True))
    np.testing.assert_allclose(float16, float32, rtol=2e-2)


class RootOfAClampByARunTimeBound(nn.Module):
    """``h.clamp(min=bound).sqrt()`` with the bound computed in forward: the Clip keeps ONNX Runtime's gradient
    (rewrites.activations.select_before_singular takes constant bounds only) and trains as torch where the bound is positive."""

    def __init__(self):
        super().__init__()
        self.embed, self.out = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x):
        hidden = self.embed(x)
        return self.out(hidden.clamp(min=hidden.detach().abs().mean()).sqrt())


def test_a_clamp_by_a_bound_computed_in_the_run_before_a_root_trains_like_torch():
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(5, 4, generator=generator), torch.randn(5, 3, generator=generator)) for _ in range(3)]
    torch.manual_seed(0)
    run_parity(RootOfAClampByARunTimeBound(), batches, optim.SGDConfig(lr=0.1), sgd, loss_fn=F.mse_loss)


def test_roots_of_masked_values_sorts_and_extremes_train_like_torch():
    """sqrt(relu(h)) where h < 0 (the mask's gradient times sqrt's infinite one was NaN), maximum, a stable sort and
    a top-k, every state_dict key against torch's loop."""
    torch.manual_seed(0)
    run_parity(RootsSortsAndExtremes(), _later_batches(lambda step: torch.zeros(5)), optim.SGDConfig(lr=0.1), sgd,
               loss_fn=F.mse_loss)  # fmt: skip
