"""Tensors with a size-0 dimension: a batch of no elements, a model output or an intermediate with one. torch sums
one to a 0-d 0.0 and takes its mean as NaN (0 / 0); the trainer's loss is the same, 0-d, in train_step and eval_step,
and every weight is updated as torch's."""


import pytest
import torch
import torch.nn as nn
from parity import cpu_options, run_parity

from orttrainer import optim

LR = 0.1


def sgd(parameters):
    return torch.optim.SGD(parameters, lr=LR)


class Scaled(nn.Module):
    """x times a weight, of x's own shape (an identity model at the start)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x * self.scale


class EmptyInside(nn.Module):
    """An intermediate with a size-0 dimension (the first 0 columns of x) summed into an output that has none."""

    def __init__(self):
        super().__init__()
        self.scale, self.bias = nn.Parameter(torch.full((1,), 2.0)), nn.Parameter(torch.zeros(3))

    def forward(self, x):
        nothing = (x[:, :0] * self.scale).sum(1, keepdim=True)
        return x * self.scale + self.bias + nothing


def _sum_loss(output, target):
    return (output * target).sum()


def _mean_loss(output, target):
    return (output * target).mean()


LOSSES = {"sum": _sum_loss, "mean": _mean_loss, "mse_loss": nn.functional.mse_loss, "l1_loss": nn.functional.l1_loss}
EMPTY_SHAPES = {"empty last dim": (3, 2, 0), "empty batch": (0, 4), "size-1 and empty": (1, 0, 1)}


def _batches(shape, steps=3):
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)) for _ in range(steps)]


def _assert_eval_like_torch(trainer, reference, batch, loss_fn):
    """eval_step's loss is the torch module's, shape and NaN included."""
    loss = trainer.eval_step(*batch)
    loss = loss[0] if isinstance(loss, list) else loss
    expected = loss_fn(reference(batch[0]), batch[1]).detach()
    assert loss.shape == expected.shape == ()
    torch.testing.assert_close(loss, expected, equal_nan=True)


@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("shape", list(EMPTY_SHAPES.values()), ids=list(EMPTY_SHAPES))
def test_a_loss_over_an_empty_output_is_torch_s_0_d_loss(loss_name, shape):
    """Sum 0.0 and mean NaN, 0-d (the export gave shape [1, 1, 1] and a mean of 0); the weight's gradient is empty's
    sum, 0, at every step."""
    loss_fn, batches = LOSSES[loss_name], _batches(shape)
    trainer, reference, _ = run_parity(Scaled(), batches, optim.SGDConfig(lr=LR), sgd, loss_fn=loss_fn, float64=True)
    _assert_eval_like_torch(trainer, reference, batches[0], loss_fn)


@pytest.mark.parametrize("loss_name", ["sum", "mean"])
def test_an_empty_intermediate_trains_like_torch(loss_name):
    loss_fn, batches = LOSSES[loss_name], _batches((4, 3))
    trainer, reference, _ = run_parity(EmptyInside(), batches, optim.SGDConfig(lr=LR), sgd, loss_fn=loss_fn,
                                       float64=True)  # fmt: skip
    _assert_eval_like_torch(trainer, reference, batches[0], loss_fn)


def test_sum_and_mean_of_a_nonempty_output_in_another_dtype_are_torch_s():
    """x.sum(dtype=...) and x.mean(dtype=...), the path the empty tensors share with every model."""

    def loss_fn(output, target):
        return (output * target).sum(dtype=torch.float64).float() + (output - target).mean(dtype=torch.float64).float()

    run_parity(Scaled(), _batches((2, 3)), optim.SGDConfig(lr=LR), sgd, loss_fn=loss_fn, float64=True)


class WithEmptyParameter(nn.Module):
    """A (2, 0) weight, as a Linear(2, 0) has, whose output of shape (batch, 0) is summed into the model's output."""

    def __init__(self):
        super().__init__()
        self.scale, self.nothing = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2, 0))

    def forward(self, x):
        return x * self.scale + (x[:, :2] @ self.nothing).sum()


OPTIMIZERS = {
    "sgd": (optim.SGDConfig(lr=LR), sgd),
    "adamw": (optim.AdamConfig(lr=LR, lambda_coef=0.01, epsilon=1e-8),
              lambda parameters: torch.optim.AdamW(parameters, lr=LR, weight_decay=0.01, eps=1e-8)),
}  # fmt: skip


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_a_module_with_an_empty_parameter_trains_like_torch(optimizer):
    """Its gradient is empty too: ONNX Runtime was given no memory to write it into ("data_ptr != 0") and failed."""
    config, torch_optimizer = OPTIMIZERS[optimizer]
    options = cpu_options({"utils": {"grad_norm_clip": False}})
    batches = _batches((4, 3))
    trainer, reference, _ = run_parity(WithEmptyParameter(), batches, config, torch_optimizer, loss_fn=_sum_loss,
                                       options=options, float64=True)  # fmt: skip
    assert trainer.state_dict(pytorch_format=True)["nothing"].shape == (2, 0)
    _assert_eval_like_torch(trainer, reference, batches[0], _sum_loss)
