"""ConvTranspose, rewritten into a Conv (rewrites.convolutions.conv_transpose), trains as torch does.

ONNX Runtime 1.19 has no CPU kernel for ConvTranspose's gradient. Each case trains one SGD
step (lr 1: the weight change is the gradient) against torch in float64, then a batch of
another size (dynamic batch). A wider grid (269 cases: 1-d and 2-d, kernel 1-3, stride 1-3,
padding, output_padding, dilation, groups, and 3-d) passed the same check when the rewrite
was written; docs/stack_facts.md, "Gradient graphs".
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from parity import cpu_options, run_parity

from orttrainer import ORTTrainer, optim

_CONVS = {1: (nn.Conv1d, nn.ConvTranspose1d), 2: (nn.Conv2d, nn.ConvTranspose2d), 3: (nn.Conv3d, nn.ConvTranspose3d)}


class Upsampler(nn.Module):
    def __init__(self, dims, kernel, **options):
        super().__init__()
        conv, transposed = _CONVS[dims]
        self.inp = conv(2, 4, 1)
        self.up = transposed(4, 4, kernel, **options)

    def forward(self, x):
        return self.up(self.inp(x))


CASES = [  # dims, kernel, stride, padding, output_padding, dilation, groups
    (1, 3, 2, 1, 1, 1, 1),
    (1, 2, 1, 1, 0, 1, 2),  # 1-d grouped: ONNX Runtime's 1-d grouped ConvGrad was wrong here, so it runs as 2-d
    (2, 1, 2, 1, 1, 1, 1),  # kernel 1, padding beyond the kernel's reach (the rewrite crops)
    (2, 3, 2, 1, 1, 1, 1),  # the U-Net upsampler
    (2, 2, 4, 0, 0, 1, 1),  # stride > kernel
    (2, 3, 2, 2, 1, 2, 4),  # dilation, groups
    (2, 3, 3, 0, 2, 2, 2),  # output_padding 2
    (3, 2, 2, 0, 1, 1, 2),
]


@pytest.mark.parametrize("dims, kernel, stride, padding, output_padding, dilation, groups", CASES)
def test_conv_transpose_gradients_match_float64_torch(dims, kernel, stride, padding, output_padding, dilation, groups):
    torch.manual_seed(0)
    model = Upsampler(dims, kernel, stride=stride, padding=padding, output_padding=output_padding, dilation=dilation,
                      groups=groups)  # fmt: skip
    x = torch.randn(3, 2, *([5] * dims))
    target = torch.randn(model(x).shape)
    reference = copy.deepcopy(model).double()
    F.mse_loss(reference(x.double()), target.double()).backward()
    initial = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=1.0), loss_fn=F.mse_loss, options=cpu_options())
    trainer.train_step(x, target)
    state = trainer.state_dict(pytorch_format=True)
    assert set(state) == set(initial)
    for name, parameter in reference.named_parameters():
        assert state[name].shape == initial[name].shape
        torch.testing.assert_close((initial[name] - state[name]).double(), parameter.grad, atol=1e-6, rtol=1e-4,
                                   msg=lambda m: f"gradient of {name}: {m}")  # fmt: skip
    other = torch.randn(5, 2, *([5] * dims))  # another batch size through the same graph
    loss = trainer.train_step(other, torch.randn(5, *target.shape[1:]))[0]
    assert torch.isfinite(loss)


class TinyUNet(nn.Module):
    """Conv + BatchNorm down, ConvTranspose + BatchNorm up, skip connection."""

    def __init__(self):
        super().__init__()
        self.down = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.up = nn.Sequential(nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1, output_padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.out = nn.Conv2d(7, 3, 1)

    def forward(self, x):
        return self.out(torch.cat([self.up(self.down(x)), x], dim=1))


def test_unet_like_autoencoder_trains_like_torch_step_by_step():
    torch.manual_seed(0)
    batches = [(x, x) for x in (torch.randn(size, 3, 8, 8) for size in (4, 4, 6))]
    run_parity(TinyUNet(), batches, optim.SGDConfig(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=F.mse_loss,
               atol=2e-5)  # fmt: skip
