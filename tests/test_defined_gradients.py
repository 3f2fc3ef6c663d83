"""Ops trained through a gradient definition given to ONNX Runtime (orttrainer/defined_gradients.py).

Values and gradients at the kinks, ±inf and ties are checked against float64 torch in
test_boundary_values.py; parity of a MobileNet-style net in test_zoo.py. Here: the forward
is torch's own rounding in the training and the eval graph, and mixed precision trains.
"""

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from parity import cpu_options

from orttrainer import ORTTrainer, optim


class ScaledHardswish(nn.Module):
    """hardswish(x * scale), scale a weight that starts at 1 (so the first step sees x itself)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return F.hardswish(x * self.scale)


def _near_the_kinks():
    """Values where ONNX Runtime's HardSwish kernel (x * (x / 6 + 1/2) clipped) differs from torch's
    x * clip(x + 3, 0, 6) / 6 in the last bits: ~half of a fine grid over [-3.2, 3.2]."""
    grid = np.linspace(-3.2, 3.2, 4001, dtype=np.float32)
    above_low_kink = np.float32(-3.0) + np.arange(1, 65, dtype=np.float32) * np.float32(2.4e-7)
    return torch.tensor(np.concatenate([grid, above_low_kink, [-3.0, 3.0, 0.0, -0.0]]).astype(np.float32))


def test_hardswish_forward_is_torchs_bit_for_bit_in_training_and_eval():
    x = _near_the_kinks()
    expected = F.hardswish(x)
    upstream = torch.ones_like(x)
    trainer = ORTTrainer(ScaledHardswish(), None, optim.SGDConfig(lr=0.0), loss_fn=lambda y, upstream: (y * upstream).sum(),
                         options=cpu_options())  # fmt: skip
    evaluated = trainer.eval_step(x, upstream)[1]
    trained = trainer.train_step(x, upstream)[1]
    for graph, output in (("eval", evaluated), ("training", trained)):
        differ = output != expected
        assert not differ.any(), (f"{graph} graph: {int(differ.sum())} values differ from torch's hardswish, "
                                  f"e.g. at x={x[differ][:3].tolist()}: {output[differ][:3].tolist()} vs {expected[differ][:3].tolist()}")


class HardswishNet(nn.Module):
    """Conv -> BatchNorm -> hardswish -> pooled classifier."""

    def __init__(self):
        super().__init__()
        self.conv, self.norm, self.head = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Linear(8, 4)

    def forward(self, x):
        return self.head(F.hardswish(self.norm(self.conv(x))).mean((2, 3)))


def _losses(mixed_precision: bool, steps: int = 12):
    torch.manual_seed(0)
    trainer = ORTTrainer(HardswishNet(), None, optim.AdamConfig(lr=1e-2), loss_fn=F.cross_entropy,
                         options=cpu_options({"mixed_precision": {"enabled": mixed_precision}}))  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    x, labels = torch.randn(16, 3, 8, 8, generator=generator), torch.randint(0, 4, (16,), generator=generator)
    return [trainer.train_step(x, labels)[0].item() for _ in range(steps)]


def test_hardswish_trains_under_mixed_precision():
    """Under mixed precision the HardSwish forward and gradient stay float32 between float16 neighbours."""
    float32, float16 = _losses(False), _losses(True)
    assert np.isfinite(float16).all(), float16
    np.testing.assert_allclose(float16, float32, rtol=2e-2)
    assert float16[-1] < 0.95 * float16[0], f"it must learn: {float16}"
