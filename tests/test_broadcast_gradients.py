"""Broadcast inputs get torch's gradients (rewrites.broadcast_gradient), or a clear refusal.

onnxruntime-training 1.19 does not reduce Where's gradient, nor Pow's base gradient, to the
shape of a broadcast input, and reduces those of Add/Sub/Mul/Div/Max/Min wrongly when two
differently named dynamic dimensions meet. The full matrix (7 ops, Where's condition, Expand
and PRelu over 14 broadcast patterns, with weights and with dynamic-batch activations; 290
cases) is in docs/stack_facts.md, "Broadcast gradients"; these cases are one per kind of failure.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from parity import cpu_options

from orttrainer import GradientBuildError, ORTTrainer, optim


class Operands(nn.Module):
    """fn(xa * a, xb * b): both operands carry gradients; every input's dim 0 is dynamic."""

    def __init__(self, fn, shape_a, shape_b):
        super().__init__()
        self.a, self.b, self.fn = nn.Parameter(torch.randn(shape_a)), nn.Parameter(torch.randn(shape_b)), fn

    def forward(self, xa, xb, xc=None):
        operands = (xa * self.a, xb * self.b)
        return self.fn(*operands) if xc is None else self.fn(xc > 0, *operands)


def _positive(t):
    return t.abs() + 0.5


CASES = {
    "where, lower-rank branch": (torch.where, [3, 4, 5], [4, 5], [3, 4, 5]),
    "where, both branches and the condition broadcast": (torch.where, [3, 1, 5], [1, 4, 1], [1, 4, 5]),
    "where, scalar branch": (torch.where, [], [3, 4, 5], [5]),
    "pow, broadcast base": (lambda a, b: torch.pow(_positive(a), torch.full(b.shape, 1.5)) + b, [1, 4, 5], [3, 4, 5], None),
    "add, dim 0 named differently": (torch.add, [3, 4, 5], [1, 4, 1], None),
    "mul, both broadcast, named differently": (torch.mul, [3, 1, 5], [1, 4, 1], None),
    "maximum, size-1 against the batch": (torch.maximum, [3, 4, 5], [1], None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_broadcast_operand_gets_torch_gradient(name):
    fn, shape_a, shape_b, shape_condition = CASES[name]
    torch.manual_seed(0)
    model = Operands(fn, shape_a, shape_b)
    inputs = [torch.randn(shape) for shape in (shape_a, shape_b, shape_condition) if shape is not None]
    target = torch.randn(model(*inputs).shape)
    reference = copy.deepcopy(model)
    F.mse_loss(reference(*inputs), target).backward()
    initial = {key: value.clone() for key, value in model.state_dict().items()}
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=1.0), loss_fn=F.mse_loss, options=cpu_options())
    trainer.train_step(*inputs, target)
    state = trainer.state_dict(pytorch_format=True)
    for key, parameter in reference.named_parameters():
        torch.testing.assert_close(initial[key] - state[key], parameter.grad, atol=1e-5, rtol=1e-4,
                                   msg=lambda m: f"gradient of {key}: {m}")  # fmt: skip


def test_trainable_pow_exponent_is_refused_before_anything_runs():
    model = Operands(lambda a, b: torch.pow(_positive(a), b), [3, 4], [4])
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=1.0), loss_fn=F.mse_loss, options=cpu_options())
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(GradientBuildError, match=r"Pow \(node .*its input 1 \(the exponent\)"):
        trainer.train_step(torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4))
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key])
