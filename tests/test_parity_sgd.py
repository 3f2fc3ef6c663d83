"""orttrainer with SGD equals a plain torch SGD loop, step by step, on real models."""

import copy

import torch
import torch.nn.functional as F
from models import (
    CNN,
    MLP,
    Encoder,
    MLPWithLoss,
    TwoHeads,
    cnn_batch,
    lm_loss,
    mlp_batch,
    token_batch,
    training_onnx,
    two_head_batch,
    two_head_loss,
)
from parity import cpu_options, run_parity

from orttrainer import ORTTrainer, optim

STEPS = 6


def batches(make, count=STEPS, **kwargs):
    generator = torch.Generator().manual_seed(1234)
    return [make(generator=generator, **kwargs) for _ in range(count)]


def sgd(lr):
    return lambda parameters: torch.optim.SGD(parameters, lr=lr)


def test_mlp_matches_torch_sgd():
    torch.manual_seed(0)
    run_parity(MLP(), batches(mlp_batch), optim.SGDConfig(lr=0.1), sgd(0.1), loss_fn=F.cross_entropy)


def test_cnn_with_batchnorm_matches_torch_including_running_statistics():
    torch.manual_seed(0)
    trainer, reference = run_parity(CNN(dropout=0.0), batches(cnn_batch), optim.SGDConfig(lr=0.05), sgd(0.05), loss_fn=F.cross_entropy)
    state = trainer.state_dict(pytorch_format=True)
    assert state["features.1.num_batches_tracked"].item() == STEPS
    assert not torch.equal(state["features.1.running_mean"], torch.zeros(8)), "running statistics never moved"


def test_transformer_encoder_matches_torch():
    torch.manual_seed(0)
    run_parity(Encoder(dropout=0.0), batches(token_batch), optim.SGDConfig(lr=0.1), sgd(0.1), loss_fn=lm_loss)


def test_two_outputs_with_custom_two_input_loss():
    torch.manual_seed(0)
    trainer, _ = run_parity(TwoHeads(), batches(two_head_batch), optim.SGDConfig(lr=0.1), sgd(0.1), loss_fn=two_head_loss)
    names = [entry.name for entry in trainer.model_desc.outputs]
    assert names == ["loss", "output0", "output1"]
    loss, value, logits = trainer.train_step(*two_head_batch(batch=5))
    assert loss.shape == () and value.shape == (5,) and logits.shape == (5, 4)


def test_frozen_weights_do_not_move():
    torch.manual_seed(0)
    model = MLP()
    model.fc2.weight.requires_grad_(False)  # frozen the torch way
    initial = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    options = cpu_options({"utils": {"frozen_weights": ["fc1.weight", "fc1.bias"]}})  # and the legacy way

    def reference_loss(module, batch):
        module.fc1.requires_grad_(False)
        return F.cross_entropy(module(batch[0]), batch[1])

    trainer, _ = run_parity(
        model, batches(mlp_batch), optim.SGDConfig(lr=0.1), sgd(0.1), loss_fn=F.cross_entropy, options=options,
        reference_loss=reference_loss,
    )
    state = trainer.state_dict(pytorch_format=True)
    for name in ("fc1.weight", "fc1.bias", "fc2.weight"):
        assert torch.equal(state[name], initial[name]), f"frozen weight {name} moved"
    assert not torch.equal(state["head.weight"], initial["head.weight"])


def test_model_computing_its_own_loss_with_legacy_model_desc():
    torch.manual_seed(0)
    model_desc = {
        "inputs": [("x", ["batch", 32]), ("label", ["batch"])],
        "outputs": [("loss", [], True), ("logits", ["batch", 10])],
    }
    trainer, _ = run_parity(
        MLPWithLoss(), batches(mlp_batch), optim.SGDConfig(lr=0.1), sgd(0.1), model_desc=model_desc,
        reference_loss=lambda module, batch: module(*batch)[0],
    )
    loss, logits = trainer.train_step(*mlp_batch())
    assert logits.shape == (8, 10)


def test_inputs_are_routed_to_forward_by_name():
    """model_desc order differs from forward's: tensors reach forward's parameters by name."""

    class Swapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 1)

        def forward(self, y=None, x=None):
            return self.fc(x).squeeze(-1) * y

    torch.manual_seed(0)
    model = Swapped()
    model_desc = {"inputs": [("x", ["batch", 4]), ("y", ["batch"]), ("label", ["batch"])],
                  "outputs": [("loss", [], True), ("out", ["batch"])]}
    generator = torch.Generator().manual_seed(3)
    data = [(torch.randn(6, 4, generator=generator), torch.randn(6, generator=generator), torch.randn(6, generator=generator))
            for _ in range(4)]
    run_parity(
        model, data, optim.SGDConfig(lr=0.1), sgd(0.1), loss_fn=F.mse_loss, model_desc=model_desc,
        reference_loss=lambda module, batch: F.mse_loss(module(x=batch[0], y=batch[1]), batch[2]),
    )


def test_dynamic_batch_size_without_reexport():
    torch.manual_seed(0)
    data = [mlp_batch(batch=size, generator=torch.Generator().manual_seed(size)) for size in (8, 3, 17, 1, 8)]
    trainer, _ = run_parity(MLP(), data, optim.SGDConfig(lr=0.1), sgd(0.1), loss_fn=F.cross_entropy)
    exported = trainer._onnx_model
    assert trainer.train_step(*mlp_batch(batch=5))[1].shape == (5, 10)
    assert trainer._onnx_model is exported, "a new batch size must not re-export"


def test_onnx_model_input(tmp_path):
    """A forward+loss ONNX model trains like the torch module it came from."""
    torch.manual_seed(0)
    model = MLPWithLoss()
    reference = MLPWithLoss()
    reference.load_state_dict(model.state_dict())
    trainer = ORTTrainer(training_onnx(model, mlp_batch(), tmp_path / "mlp.onnx"), None, optim.SGDConfig(lr=0.1),
                         options=cpu_options())  # fmt: skip
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for batch in batches(mlp_batch):
        loss, logits = trainer.train_step(*batch)
        optimizer.zero_grad()
        expected, _ = reference(*batch)
        expected.backward()
        optimizer.step()
        torch.testing.assert_close(loss, expected.detach(), atol=1e-5, rtol=1e-5)
    state = trainer.state_dict(pytorch_format=True)
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[name], tensor, atol=1e-5, rtol=1e-5)


class TiedLM(torch.nn.Module):
    """Embedding lookup and output projection share one weight (as GPT-2 does)."""

    def __init__(self):
        super().__init__()
        self.tokens = torch.nn.Embedding(50, 16)
        self.mix = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.tokens(tokens))))


def test_tied_embedding_gets_both_gradients_with_accumulation():
    """The lookup's gradient (scatter-added by torch) and the projection's (from the graph) add up."""
    torch.manual_seed(0)
    model = TiedLM()
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.5), loss_fn=lm_loss,
                         options=cpu_options({"batch": {"gradient_accumulation_steps": 2}}))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(0)
    for window in range(3):
        micro = [token_batch(batch=2, generator=generator) for _ in range(2)]
        for tokens, labels in micro:
            trainer.train_step(tokens, labels)
        optimizer.zero_grad()
        lm_loss(reference(torch.cat([m[0] for m in micro])), torch.cat([m[1] for m in micro])).backward()
        optimizer.step()
        state = trainer.state_dict(pytorch_format=True)
        torch.testing.assert_close(state["tokens.weight"], reference.tokens.weight.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state["mix.weight"], reference.mix.weight.detach(), atol=1e-5, rtol=1e-5)
