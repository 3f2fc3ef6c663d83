"""Ops trained through a gradient definition given to ONNX Runtime (orttrainer/graph/defined_gradients.py).

Values and gradients at the kinks, ±inf and ties are checked against float64 torch in
test_boundary_values.py; parity of a MobileNet-style net in test_zoo.py. Here: the forward
is torch's own rounding in the training and the eval graph, and mixed precision trains.
Also hardtanh's gradient (0 at its bounds), which is the builder's Clip gradient made strict.
"""

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from onnx import helper
from parity import cpu_options

from orttrainer import ORTTrainer, amp, optim
from orttrainer.graph import defined_gradients


ACTIVATIONS = {"hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid}


class ScaledActivation(nn.Module):
    """activation(x * scale), scale a weight that starts at 1 (so the first step sees x itself)."""

    def __init__(self, activation):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.activation = activation

    def forward(self, x):
        return self.activation(x * self.scale)


def _near_the_kinks():
    """Values where ONNX Runtime's HardSwish kernel (x * (x / 6 + 1/2) clipped) differs from torch's
    x * clip(x + 3, 0, 6) / 6 in the last bits: ~half of a fine grid over [-3.2, 3.2]; its HardSigmoid
    (alpha x + beta, clipped) reaches 1 one float below 3, where torch's (x + 3) / 6 does not."""
    grid = np.linspace(-3.2, 3.2, 4001, dtype=np.float32)
    above_low_kink = np.float32(-3.0) + np.arange(1, 65, dtype=np.float32) * np.float32(2.4e-7)
    return torch.tensor(np.concatenate([grid, above_low_kink, [-3.0, 3.0, 0.0, -0.0]]).astype(np.float32))


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_forward_is_torchs_bit_for_bit_in_training_and_eval(name):
    x = _near_the_kinks()
    expected = ACTIVATIONS[name](x)
    upstream = torch.ones_like(x)
    trainer = ORTTrainer(ScaledActivation(ACTIVATIONS[name]), None, optim.SGDConfig(lr=0.0),
                         loss_fn=lambda y, upstream: (y * upstream).sum(), options=cpu_options())  # fmt: skip
    evaluated = trainer.eval_step(x, upstream)[1]
    trained = trainer.train_step(x, upstream)[1]
    for graph, output in (("eval", evaluated), ("training", trained)):
        differ = output != expected
        assert not differ.any(), (f"{graph} graph: {int(differ.sum())} values differ from torch's {name}, "
                                  f"e.g. at x={x[differ][:3].tolist()}: {output[differ][:3].tolist()} vs {expected[differ][:3].tolist()}")


class ActivationNet(nn.Module):
    """Conv -> BatchNorm -> activation -> pooled classifier."""

    def __init__(self, activation):
        super().__init__()
        self.conv, self.norm, self.head = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Linear(8, 4)
        self.activation = activation

    def forward(self, x):
        return self.head(self.activation(self.norm(self.conv(x))).mean((2, 3)))


def _losses(activation, mixed_precision: bool, steps: int = 12):
    torch.manual_seed(0)
    trainer = ORTTrainer(ActivationNet(activation), None, optim.AdamConfig(lr=1e-2), loss_fn=F.cross_entropy,
                         options=cpu_options({"mixed_precision": {"enabled": mixed_precision}}))  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    x, labels = torch.randn(16, 3, 8, 8, generator=generator), torch.randint(0, 4, (16,), generator=generator)
    return [trainer.train_step(x, labels)[0].item() for _ in range(steps)]


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_trains_under_mixed_precision(name):
    """Under mixed precision the HardSwish / HardSigmoid forward and gradient stay float32 between float16 neighbours."""
    float32, float16 = _losses(ACTIVATIONS[name], False), _losses(ACTIVATIONS[name], True)
    assert np.isfinite(float16).all(), float16
    np.testing.assert_allclose(float16, float32, rtol=2e-2)
    assert float16[-1] < 0.95 * float16[0], f"it must learn: {float16}"


@pytest.mark.parametrize("mixed_precision", [False, True], ids=["float32", "float16"])
def test_relu6_gradient_is_zero_at_its_bounds(mixed_precision):
    """relu6(x * scale) with most of x at 0 and 6: only the 3s give the scale a gradient, in both precisions
    (under a loss scale that float16 holds: the default 2^16 is inf there, and skips the first update)."""
    x = torch.tensor([0.0] * 8 + [6.0] * 8 + [3.0, 3.0])
    trainer = ORTTrainer(ScaledActivation(F.relu6), None, optim.SGDConfig(lr=1.0), loss_fn=lambda y, weights: (y * weights).sum(),
                         options=cpu_options({"mixed_precision": {"enabled": mixed_precision,
                                                                  "loss_scaler": amp.DynamicLossScaler(loss_scale=1024.0)}}))  # fmt: skip
    trainer.train_step(x, torch.full_like(x, 1e-3))
    step = 1.0 - trainer.state_dict(pytorch_format=True)["scale"].item()
    assert step == pytest.approx(6e-3, rel=1e-2), f"scale moved by {step}, torch's gradient is 6e-3"


def _clip_and_gradient(reads_x: bool) -> onnx.ModelProto:
    """A marked Clip 'clip' and the builder's gradient of it; ``reads_x`` False: the first comparison reads another tensor."""
    nodes = [
        helper.make_node("Clip", ["x", "low", "high"], ["y"], name="clip", doc_string=defined_gradients.ZERO_GRADIENT_AT_BOUNDS),
        helper.make_node("GreaterOrEqual", ["x" if reads_x else "y", "low"], ["above"], name="clip_Grad/GreaterOrEqual_0"),
        helper.make_node("LessOrEqual", ["x", "high"], ["below"], name="clip_Grad/LessOrEqual_1"),
        helper.make_node("And", ["above", "below"], ["inside"], name="clip_Grad/And_2"),
    ]
    graph = helper.make_graph(nodes, "clip", [helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [2]) for name in ("x", "low", "high")],
                              [helper.make_tensor_value_info("inside", onnx.TensorProto.BOOL, [2])])  # fmt: skip
    return helper.make_model(graph)


def test_zero_gradient_at_bounds_makes_the_comparisons_strict_or_refuses_a_gradient_it_does_not_know():
    model = _clip_and_gradient(reads_x=True)
    defined_gradients.zero_gradient_at_bounds(model)
    assert [node.op_type for node in model.graph.node] == ["Clip", "Greater", "Less", "And"]
    with pytest.raises(RuntimeError, match=r"Clip node 'clip' \(a hardtanh\).*GreaterOrEqual"):
        defined_gradients.zero_gradient_at_bounds(_clip_and_gradient(reads_x=False))
