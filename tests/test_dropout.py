"""Dropout: active in train_step, off in eval_step, masks a function of (seed, step), correct gradients."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import CNN, Encoder, cnn_batch, lm_loss, token_batch
from parity import cpu_options

from orttrainer import ORTTrainer, optim


def frozen_trainer(model, loss_fn):
    """A trainer whose SGD step leaves weights unchanged (lr 0), to look at dropout alone."""
    return ORTTrainer(model, None, optim.SGDConfig(lr=0.0), loss_fn=loss_fn, options=cpu_options())


def test_dropout_active_in_train_step_and_off_in_eval_step():
    torch.manual_seed(0)
    model = CNN(dropout=0.5)
    trainer = frozen_trainer(model, F.cross_entropy)
    images, labels = cnn_batch(batch=16)
    train_losses = [trainer.train_step(images, labels)[0].item() for _ in range(3)]
    assert len(set(train_losses)) == 3, f"dropout masks did not change between steps: {train_losses}"

    eval_loss, eval_logits = trainer.eval_step(images, labels)
    again_loss, _ = trainer.eval_step(images, labels)
    assert torch.equal(eval_loss, again_loss), "eval_step must be deterministic"

    reference = copy.deepcopy(model).eval()
    reference.load_state_dict(trainer.state_dict(pytorch_format=True))
    with torch.no_grad():
        torch.testing.assert_close(eval_logits, reference(images), atol=1e-5, rtol=1e-5)
    assert all(abs(loss - eval_loss.item()) > 1e-4 for loss in train_losses)


def test_dropout_masks_depend_only_on_seed_and_step():
    images, labels = cnn_batch(batch=16, generator=torch.Generator().manual_seed(5))
    runs = []
    for _ in range(2):
        torch.manual_seed(7)  # the trainer takes its dropout seed from torch's
        trainer = frozen_trainer(CNN(dropout=0.5), F.cross_entropy)
        runs.append([trainer.train_step(images, labels)[0].item() for _ in range(3)])
    assert runs[0] == runs[1]
    assert len(set(runs[0])) == 3, f"steps 1-3 must use different masks: {runs[0]}"


class Attention(nn.Module):
    """Self-attention whose dropout is exported through scaled-dot-product attention."""

    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(16, 2, dropout=0.5, batch_first=True)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.attention(x, x, x, need_weights=False)[0]).squeeze(-1)


def _loss_and_weights_after_one_step(model, batch, lr):
    torch.manual_seed(11)
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=lr), loss_fn=F.mse_loss, options=cpu_options())
    loss = trainer.train_step(*batch)[0].item()
    return loss, trainer.state_dict(pytorch_format=True)


def test_attention_dropout_gradient_matches_finite_differences():
    """With the same mask, the gradient is the derivative of the loss that step computed.

    Exported attention dropout has no training-mode input: unless orttrainer forces one,
    the forward skips dropout while the backward rescales, and the gradient is wrong.
    """
    torch.manual_seed(0)
    model = Attention()
    generator = torch.Generator().manual_seed(2)
    batch = (torch.randn(4, 6, 16, generator=generator), torch.randn(4, 6, generator=generator))
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}

    lr = 1.0
    loss, updated = _loss_and_weights_after_one_step(copy.deepcopy(model), batch, lr)
    gradient = {name: (weights[name] - updated[name]) / lr for name in weights}

    with torch.no_grad():
        eval_loss = F.mse_loss(copy.deepcopy(model).eval()(batch[0]), batch[1]).item()
    assert abs(loss - eval_loss) > 1e-3, "attention dropout did nothing in the training step"

    direction = {name: torch.randn(tensor.shape, generator=generator) for name, tensor in weights.items()}
    epsilon = 1e-3
    losses = []
    for sign in (1, -1):
        shifted = copy.deepcopy(model)
        shifted.load_state_dict({name: weights[name] + sign * epsilon * direction[name] for name in weights})
        losses.append(_loss_and_weights_after_one_step(shifted, batch, 0.0)[0])
    numeric = (losses[0] - losses[1]) / (2 * epsilon)
    analytic = sum((gradient[name] * direction[name]).sum().item() for name in weights)
    assert abs(numeric - analytic) <= 1e-2 * abs(analytic) + 1e-4, (numeric, analytic)


def test_transformer_dropout_trains_and_eval_matches_torch_eval():
    torch.manual_seed(0)
    model = Encoder(dropout=0.2)
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=lm_loss, options=cpu_options())
    tokens, labels = token_batch()
    for _ in range(3):
        trainer.train_step(tokens, labels)
    reference = copy.deepcopy(model).eval()
    reference.load_state_dict(trainer.state_dict(pytorch_format=True))
    with torch.no_grad():
        torch.testing.assert_close(trainer.eval_step(tokens, labels)[1], reference(tokens), atol=1e-5, rtol=1e-4)


def test_dropout_with_p_zero_leaves_no_dropout_node_and_trains_like_torch(tmp_path):
    """torch's dropout(p=0) is the identity: the graph keeps no Dropout/DropoutGrad for it, other ratios stay."""
    import functools

    import onnx
    from parity import run_parity

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = Encoder(dropout=0.0)
            self.last = nn.Dropout(0.3)

        def forward(self, tokens):
            return self.last(self.encoder(tokens))

    torch.manual_seed(0)
    path = tmp_path / "train.onnx"
    options = cpu_options({"debug": {"graph_save_paths": {"model_with_training_graph_path": str(path)}}})
    model = Mixed()
    model.last.p = 0.0  # parity needs every dropout off; the ratio-0.3 case is checked on a second export below
    batches = [token_batch(generator=torch.Generator().manual_seed(seed)) for seed in range(2)]
    run_parity(model, batches, optim.SGDConfig(lr=0.1), functools.partial(torch.optim.SGD, lr=0.1), loss_fn=lm_loss,
               options=options)  # fmt: skip
    assert not [node for node in onnx.load(path).graph.node if "Dropout" in node.op_type]

    model.last.p = 0.3
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=lm_loss, options=options)
    trainer.train_step(*batches[0])
    kinds = sorted(node.op_type for node in onnx.load(path).graph.node if "Dropout" in node.op_type)
    assert kinds == ["Dropout", "DropoutGrad"]


@pytest.mark.parametrize("dropout, shape", [(nn.Dropout1d, (6, 8, 5)), (nn.Dropout2d, (6, 8, 5, 5)), (nn.Dropout3d, (6, 8, 3, 3, 3))])
def test_channel_dropout_zeroes_whole_channels_and_trains_through_the_rest(dropout, shape):
    """nn.Dropout1d/2d/3d (the exporter refuses their training mode; symbolics.layers.feature_dropout): each
    channel of each sample is 0 or the undropped value times 2 (p = 0.5); the weights' update is
    torch's for that same mask; masks change between steps; eval_step has no dropout."""
    torch.manual_seed(0)
    convolution = {3: nn.Conv1d, 4: nn.Conv2d, 5: nn.Conv3d}[len(shape)]
    model = nn.Sequential(convolution(shape[1], 8, 1), dropout(0.5))
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=F.mse_loss, options=cpu_options())
    generator = torch.Generator().manual_seed(3)
    inputs, target = torch.randn(shape, generator=generator), torch.randn(shape[0], 8, *shape[2:], generator=generator)
    with torch.no_grad():
        undropped = reference[0](inputs)
    loss, output = trainer.train_step(inputs, target)
    channels = output.flatten(2).abs().amax(2)
    kept = channels > 0
    assert kept.any() and not kept.all(), f"p = 0.5 kept {int(kept.sum())} of {kept.numel()} channels"
    mask = kept.float().view(*kept.shape, *[1] * (len(shape) - 2)) * 2
    torch.testing.assert_close(output, undropped * mask)

    expected_loss = F.mse_loss(reference[0](inputs) * mask, target)
    expected_loss.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    torch.testing.assert_close(loss, expected_loss.detach())
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(trainer.state_dict(pytorch_format=True)[name], tensor, atol=1e-6, rtol=1e-5)

    second = trainer.train_step(inputs, target)[1].flatten(2).abs().amax(2) > 0
    assert not torch.equal(second, kept), "the channel mask did not change between steps"
    reference.load_state_dict(trainer.state_dict(pytorch_format=True))  # after the second step
    with torch.no_grad():
        torch.testing.assert_close(trainer.eval_step(inputs, target)[1], reference.eval()(inputs), atol=1e-5, rtol=1e-5)
