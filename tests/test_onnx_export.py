"""save_as_onnx, check_model_export, and the user's module staying untouched."""

import copy
import logging
import threading

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
import torch.nn.functional as F
from models import CNN, MLP, Encoder, cnn_batch, lm_loss, mlp_batch, token_batch
from parity import cpu_options

from orttrainer import ORTTrainer, optim


def trained(model, loss_fn, batch, steps=3, options=None):
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.05), loss_fn=loss_fn, options=options or cpu_options())
    for _ in range(steps):
        trainer.train_step(*batch)
    return trainer


@pytest.mark.parametrize("with_loss", [True, False], ids=["legacy-with-loss", "forward-only"])
@pytest.mark.parametrize("make, loss_fn, make_batch", [(CNN, F.cross_entropy, cnn_batch), (lambda: Encoder(dropout=0.1), lm_loss, token_batch)])
def test_save_as_onnx_runs_in_plain_inference_session_like_torch_eval(tmp_path, make, loss_fn, make_batch, with_loss):
    """with_loss=True (legacy): the label is an input and the loss the first output; with_loss=False:
    the model's own inputs and outputs only."""
    torch.manual_seed(0)
    model = make()
    batch = make_batch()
    trainer = trained(model, loss_fn, batch)
    path = tmp_path / "model.onnx"
    trainer.save_as_onnx(str(path), with_loss=with_loss)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    reference = copy.deepcopy(model).eval()
    reference.load_state_dict(trainer.state_dict(pytorch_format=True))
    with torch.no_grad():
        expected = reference(batch[0])
    if with_loss:
        feeds = {graph_input.name: tensor.numpy() for graph_input, tensor in zip(session.get_inputs(), batch)}
        loss, output = session.run(None, feeds)
        np.testing.assert_allclose(loss, loss_fn(expected, batch[1]).item(), atol=1e-5, rtol=1e-5)
    else:
        assert [i.name for i in session.get_inputs()] == [trainer.model_desc.inputs[0].name]
        (output,) = session.run(None, {session.get_inputs()[0].name: batch[0].numpy()})
    np.testing.assert_allclose(output, expected.numpy(), atol=1e-5, rtol=1e-4)
    assert onnx.load(str(path)).ir_version <= 10


def _broadcast_loss(output, target):
    """A user's loss broadcasting the output against a target of another shape (its row means), as mse_loss does."""
    output, target = torch.broadcast_tensors(output, target.mean(1, keepdim=True))
    return ((output - target) ** 2).sum()


LOSSES = {"mse_loss": (F.mse_loss, lambda: torch.randn(8, 10)), "l1_loss": (F.l1_loss, lambda: torch.randn(8, 10)),
          "smooth_l1_loss": (F.smooth_l1_loss, lambda: torch.randn(8, 10)),
          "cross_entropy": (F.cross_entropy, lambda: torch.randint(0, 10, (8,))),
          "custom broadcasting": (_broadcast_loss, lambda: torch.randn(8, 10))}  # fmt: skip


@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_save_as_onnx_without_the_loss_has_only_the_models_inputs_and_outputs_for_any_loss(tmp_path, loss_name):
    """mse_loss and l1_loss broadcast the output against the target (torch.broadcast_tensors), whose trace made the
    model's output an Expand to the label's shape: the saved graph asked for the label."""
    torch.manual_seed(0)
    loss_fn, make_target = LOSSES[loss_name]
    model, x = MLP(), mlp_batch()[0]
    trainer = trained(model, loss_fn, (x, make_target()))
    path = tmp_path / "model.onnx"
    trainer.save_as_onnx(str(path), with_loss=False)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [(i.name, i.shape) for i in session.get_inputs()] == [("x", ["batch", 32])]
    assert [o.name for o in session.get_outputs()] == ["output"]
    reference = copy.deepcopy(model).eval()
    reference.load_state_dict(trainer.state_dict(pytorch_format=True))
    for rows in (8, 3):  # another batch size than the trained one
        with torch.no_grad():
            expected = reference(x[:rows])
        (output,) = session.run(None, {"x": x[:rows].numpy()})
        np.testing.assert_allclose(output, expected.numpy(), atol=1e-5, rtol=1e-4)


def test_save_as_onnx_before_initialization_says_what_to_do_and_writes_nothing(tmp_path):
    trainer = ORTTrainer(MLP(), None, optim.SGDConfig(), loss_fn=F.cross_entropy, options=cpu_options())
    with pytest.raises(RuntimeError, match=r"run one \(e.g. trainer.eval_step\(\*batch\) right after load_checkpoint\)"):
        trainer.save_as_onnx(str(tmp_path / "model.onnx"))
    assert not (tmp_path / "model.onnx").exists()


def test_check_model_export_passes_for_a_faithful_export():
    torch.manual_seed(0)
    trained(CNN(dropout=0.3), F.cross_entropy, cnn_batch(), steps=1, options=cpu_options({"debug": {"check_model_export": True}}))


def test_check_model_export_catches_a_diverging_export(monkeypatch):
    from orttrainer.export import as_trained

    original = as_trained.sample_outputs

    def off_by_one(*args):
        (loss, output), form = original(*args)
        return (loss, output + 1), form

    monkeypatch.setattr(as_trained, "sample_outputs", off_by_one)
    with pytest.raises(AssertionError, match=r"debug.check_model_export: ONNX output 'output' differs from torch"):
        trained(MLP(), F.cross_entropy, mlp_batch(), steps=1, options=cpu_options({"debug": {"check_model_export": True}}))


def test_the_users_module_is_trained_in_place_as_a_torch_loop_trains_it():
    """One copy of the weights: the trainer trains the module's own tensors, so after every step the module is the
    trained model (model.state_dict() equals the trainer's, every key, and a torch loop's); the build consumes no
    torch RNG and leaves the module's modes, device and .grad as they were; a second trainer on a copy is
    independent."""
    torch.manual_seed(0)
    model = CNN()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    rng_before = torch.get_rng_state()
    batch = cnn_batch(generator=torch.Generator().manual_seed(1))
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.05), loss_fn=F.cross_entropy, options=cpu_options())
    for step in range(3):
        trainer.train_step(*batch)
        optimizer.zero_grad()
        F.cross_entropy(reference(batch[0]), batch[1]).backward()
        optimizer.step()
        trained = trainer.state_dict(pytorch_format=True)
        assert set(model.state_dict()) == set(trained) == set(reference.state_dict())
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, trained[name]), f"step {step}: the module's {name} is not the trainer's"
            torch.testing.assert_close(tensor, reference.state_dict()[name], atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
        if step == 0:
            assert torch.equal(torch.get_rng_state(), rng_before), "building the trainer must not consume torch's RNG"
    assert model.training and all(p.grad is None for p in model.parameters()) and next(model.parameters()).device.type == "cpu"
    trainer.sync_to_module()  # kept for code that calls it: nothing to do
    assert all(torch.equal(tensor, trained[name]) for name, tensor in model.state_dict().items())

    other = ORTTrainer(copy.deepcopy(model), None, optim.SGDConfig(lr=0.05), loss_fn=F.cross_entropy, options=cpu_options())
    other.train_step(*batch)
    assert all(torch.equal(tensor, trained[name]) for name, tensor in model.state_dict().items()), "another trainer moved it"


@pytest.mark.parametrize("external_data, limit", [(True, None), (None, 1000)], ids=["asked", "past-the-limit"])
def test_save_as_onnx_writes_external_data_that_plain_onnx_runtime_opens(tmp_path, monkeypatch, external_data, limit):
    """A model past protobuf's 2 GiB (here: the limit lowered) is written as the graph and '<path>.data' beside it,
    tensor by tensor; a plain InferenceSession and onnx.load read it, the outputs those of torch's eval."""
    from orttrainer.graph import onnx_file

    if limit is not None:
        monkeypatch.setattr(onnx_file, "PROTOBUF_LIMIT", limit)
    torch.manual_seed(0)
    model, batch = Encoder(dropout=0.1), token_batch()
    trainer = trained(model, lm_loss, batch)
    path = tmp_path / "model.onnx"
    trainer.save_as_onnx(str(path), with_loss=False, external_data=external_data)
    weights = trainer.state_dict(pytorch_format=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data"]
    stored = [init for init in onnx.load(str(path), load_external_data=False).graph.initializer if init.name in weights]
    assert {init.name for init in stored} >= {"tokens.weight", "head.weight"}
    assert all(init.data_location == onnx.TensorProto.EXTERNAL and not init.raw_data for init in stored)
    stored_bytes = sum(weights[init.name].numel() * weights[init.name].element_size() for init in stored)
    assert (tmp_path / "model.onnx.data").stat().st_size == stored_bytes
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    reference = copy.deepcopy(model).eval()
    reference.load_state_dict(weights)
    with torch.no_grad():
        expected = reference(batch[0])
    (output,) = session.run(None, {session.get_inputs()[0].name: batch[0].numpy()})
    np.testing.assert_allclose(output, expected.numpy(), atol=1e-5, rtol=1e-4)


def test_save_as_onnx_refuses_one_file_past_the_limit_and_a_file_object_for_external_data(tmp_path, monkeypatch):
    from orttrainer.graph import onnx_file

    torch.manual_seed(0)
    trainer = trained(MLP(), F.cross_entropy, mlp_batch(), steps=1)
    monkeypatch.setattr(onnx_file, "PROTOBUF_LIMIT", 1000)
    with pytest.raises(ValueError, match=r"past the 2 GiB a single ONNX file can hold; pass external_data=True or None"):
        trainer.save_as_onnx(str(tmp_path / "model.onnx"), external_data=False)
    with open(tmp_path / "model.onnx", "wb") as file, pytest.raises(TypeError, match=r"needs a file path .* got a BufferedWriter"):
        trainer.save_as_onnx(file)
    with pytest.raises(TypeError, match=r"external_data must be None \(when the model passes 2 GiB\), True or False, got 'yes'"):
        trainer.save_as_onnx(str(tmp_path / "other.onnx"), external_data="yes")
    assert [p.name for p in tmp_path.iterdir()] == ["model.onnx"] and (tmp_path / "model.onnx").stat().st_size == 0


def test_the_exported_graph_holds_no_weights_so_size_is_no_limit():
    """The export writes the module's weights and buffers as graph inputs named by their state_dict keys, never as
    initializers: the graph of a 4 MiB model is a few KiB, so no model passes protobuf's 2 GiB on the way to
    the gradient builder and the sessions."""
    seen = []
    options = cpu_options({"_internal_use": {"extra_postprocess": seen.append}})
    model = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.BatchNorm1d(1024))
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.01), loss_fn=lambda out, y: F.mse_loss(out.sum(1), y), options=options)
    trainer.train_step(torch.randn(4, 64), torch.randn(4))
    (exported,) = seen
    assert not exported.graph.initializer
    assert {value.name for value in exported.graph.input} == {"input", "label", *model.state_dict()} - {"3.num_batches_tracked"}
    assert exported.ByteSize() < 16 * 1024


@pytest.mark.parametrize("extra", [{"batch": {"gradient_accumulation_steps": 2}}, {"mixed_precision": {"enabled": True}}],
                         ids=["accumulation", "mixed-precision"])  # fmt: skip
def test_the_module_holds_the_trained_weights_under_accumulation_and_mixed_precision(extra):
    """In place under gradient accumulation (inside a window the weights have not moved yet) and mixed precision
    (float32 master weights: the module's own tensors, which keep their dtype): model.state_dict() is the trainer's
    after every step, every key; and training moved it."""
    torch.manual_seed(0)
    model, batch = Encoder(dropout=0.1), token_batch()
    initial = copy.deepcopy(model.state_dict())
    trainer = ORTTrainer(model, None, optim.AdamConfig(lr=1e-2), loss_fn=lm_loss, options=cpu_options(extra))
    for step in range(4):
        trainer.train_step(*batch)
        trained = trainer.state_dict(pytorch_format=True)
        assert all(tensor.dtype == initial[name].dtype for name, tensor in model.state_dict().items())
        assert all(torch.equal(tensor, trained[name]) for name, tensor in model.state_dict().items()), f"step {step}"
    assert not torch.equal(model.head.weight, initial["head.weight"])


class _Unpicklable(torch.nn.Module):
    """An MLP holding what copy.deepcopy refuses: a lock, a logger with a stream, an open file."""

    def __init__(self, path):
        super().__init__()
        self.body = MLP()
        self.lock = threading.Lock()
        self.log = logging.getLogger("unpicklable")
        self.log.addHandler(logging.StreamHandler())
        self.file = open(path, "w")

    def forward(self, x):
        with self.lock:
            return self.body(x)


def test_a_module_that_cannot_be_deep_copied_trains_like_torch(tmp_path):
    """The trainer exports and trains the module itself, so a module copy.deepcopy refuses (the legacy ORTTrainer's
    UnpickableModel, a lock) trains; every state_dict key equals a torch loop's, step by step."""
    torch.manual_seed(0)
    model = _Unpicklable(tmp_path / "log.txt")
    with pytest.raises(TypeError):
        copy.deepcopy(model)
    reference = MLP()
    reference.load_state_dict(model.body.state_dict())
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.05), loss_fn=F.cross_entropy, options=cpu_options())
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        x, label = mlp_batch(generator=generator)
        loss = trainer.train_step(x, label)[0]
        optimizer.zero_grad()
        expected = F.cross_entropy(reference(x), label)
        expected.backward()
        optimizer.step()
        torch.testing.assert_close(loss, expected.detach(), atol=1e-5, rtol=1e-5)
        for name, tensor in reference.state_dict().items():
            torch.testing.assert_close(model.body.state_dict()[name], tensor, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    model.file.close()


def test_code_in_every_stage_package_counts_as_orttrainers_not_the_users():
    """Warnings and locations are blamed on the user's code only outside orttrainer: every module of every stage
    package (export/, runtime/, graph/, ...) is orttrainer's, the user's own file is not."""
    import pathlib

    import orttrainer
    from orttrainer.export import forward_effects

    package = pathlib.Path(orttrainer.__file__).parent
    modules = sorted(package.rglob("*.py"))
    assert len({path.parent for path in modules}) > 5
    assert not [path for path in modules if forward_effects.is_users_code(str(path))]
    assert forward_effects.is_users_code(__file__)
