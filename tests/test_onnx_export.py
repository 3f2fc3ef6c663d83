"""save_as_onnx, check_model_export, and the user's module staying untouched."""

import copy

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


def test_save_as_onnx_before_initialization_says_what_to_do_and_writes_nothing(tmp_path):
    trainer = ORTTrainer(MLP(), None, optim.SGDConfig(), loss_fn=F.cross_entropy, options=cpu_options())
    with pytest.raises(RuntimeError, match=r"run one \(e.g. trainer.eval_step\(\*batch\) right after load_checkpoint\)"):
        trainer.save_as_onnx(str(tmp_path / "model.onnx"))
    assert not (tmp_path / "model.onnx").exists()


def test_check_model_export_passes_for_a_faithful_export():
    torch.manual_seed(0)
    trained(CNN(dropout=0.3), F.cross_entropy, cnn_batch(), steps=1, options=cpu_options({"debug": {"check_model_export": True}}))


def test_check_model_export_catches_a_diverging_export(monkeypatch):
    from orttrainer import export

    original = export.sample_outputs

    def off_by_one(*args):
        (loss, output), form = original(*args)
        return (loss, output + 1), form

    monkeypatch.setattr(export, "sample_outputs", off_by_one)
    with pytest.raises(AssertionError, match=r"debug.check_model_export: ONNX output 'output' differs from torch"):
        trained(MLP(), F.cross_entropy, mlp_batch(), steps=1, options=cpu_options({"debug": {"check_model_export": True}}))


def test_users_module_is_not_mutated_and_trainers_are_independent():
    torch.manual_seed(0)
    model = CNN()
    before = copy.deepcopy(model.state_dict())
    model.train()
    rng_before = torch.get_rng_state()
    batch = cnn_batch(generator=torch.Generator().manual_seed(1))
    first = trained(model, F.cross_entropy, batch)
    assert torch.equal(torch.get_rng_state(), rng_before), "building the trainer must not consume torch's RNG"
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), f"the user's {name} changed"
    assert model.training and next(model.parameters()).device.type == "cpu"

    second = trained(model, F.cross_entropy, batch)
    for name, tensor in first.state_dict(pytorch_format=True).items():
        torch.testing.assert_close(tensor, second.state_dict(pytorch_format=True)[name])
    first.train_step(*batch)
    changed = [name for name, tensor in first.state_dict(pytorch_format=True).items()
               if not torch.equal(tensor, second.state_dict(pytorch_format=True)[name])]
    assert changed, "training one trainer must not move the other"
