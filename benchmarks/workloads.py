"""The benchmark workloads (issue 7's table): model, loss, batch, same for every contender."""

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))

    def forward(self, x):
        return self.net(x)


class Encoder(nn.Module):
    """A 2-layer BERT-like encoder: d_model 256, 4 heads, FFN 1024, sequence 64, vocab 1000."""

    def __init__(self, vocab=1000, d_model=256, layers=2, seq=64):
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Parameter(torch.zeros(1, seq, d_model))
        layer = nn.TransformerEncoderLayer(d_model, 4, 4 * d_model, dropout=0.0, batch_first=True, activation="gelu")
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens):
        return self.head(self.encoder(self.tokens(tokens) + self.positions))


class LeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2)
        )
        self.head = nn.Sequential(nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10))

    def forward(self, images):
        return self.head(self.features(images).flatten(1))


def _conv_bn(inputs, outputs, kernel=3, stride=1, groups=1):
    return nn.Sequential(nn.Conv2d(inputs, outputs, kernel, stride, kernel // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(outputs))


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 conv + BatchNorm, the shortcut projected when the shape changes."""

    def __init__(self, inputs, outputs, stride=1):
        super().__init__()
        self.conv1, self.conv2 = _conv_bn(inputs, outputs, stride=stride), _conv_bn(outputs, outputs)
        self.shortcut = _conv_bn(inputs, outputs, 1, stride) if stride != 1 or inputs != outputs else nn.Identity()

    def forward(self, x):
        return F.relu(self.conv2(F.relu(self.conv1(x))) + self.shortcut(x))


class ResNet(nn.Module):
    """A CIFAR ResNet: 3x3 stem, three stages of two basic blocks (widths 16, 32, 64), pooled classifier."""

    def __init__(self, widths=(16, 32, 64)):
        super().__init__()
        layers, inputs = [_conv_bn(3, widths[0]), nn.ReLU()], widths[0]
        for stage, width in enumerate(widths):
            layers += [BasicBlock(inputs, width, 1 if stage == 0 else 2), BasicBlock(width, width)]
            inputs = width
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(inputs, 10)

    def forward(self, images):
        return self.fc(self.features(images))


class InvertedResidual(nn.Module):
    """MobileNetV3's block: 1x1 expansion, depthwise 3x3, squeeze-excitation, 1x1 projection."""

    def __init__(self, inputs, expanded, outputs, stride):
        super().__init__()
        self.expand = nn.Sequential(_conv_bn(inputs, expanded, 1), nn.Hardswish())
        self.depthwise = nn.Sequential(_conv_bn(expanded, expanded, 3, stride, groups=expanded), nn.Hardswish())
        self.squeeze = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(expanded, expanded // 4, 1), nn.ReLU(),
                                     nn.Conv2d(expanded // 4, expanded, 1), nn.Hardsigmoid())
        self.project = _conv_bn(expanded, outputs, 1)
        self.residual = stride == 1 and inputs == outputs

    def forward(self, x):
        y = self.depthwise(self.expand(x))
        y = self.project(y * self.squeeze(y))
        return x + y if self.residual else y


class MobileNetV3(nn.Module):
    """A MobileNetV3-small-style net for 3x32x32 images: hardswish stem, inverted residuals with
    squeeze-excitation, 1x1 head conv, pooled classifier."""

    def __init__(self):
        super().__init__()
        blocks = [(16, 64, 24, 2), (24, 72, 24, 1), (24, 96, 40, 2), (40, 120, 40, 1), (40, 240, 80, 2)]
        self.features = nn.Sequential(_conv_bn(3, 16), nn.Hardswish(), *(InvertedResidual(*block) for block in blocks),
                                      _conv_bn(80, 256, 1), nn.Hardswish(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Sequential(nn.Linear(256, 128), nn.Hardswish(), nn.Linear(128, 10))

    def forward(self, images):
        return self.classifier(self.features(images))


class GPT2(nn.Module):
    """transformers' GPT2LMHeadModel from a config (random weights, no dropout), logits from token ids."""

    def __init__(self, layers=6, width=512, vocab=8000, seq=128):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=width, n_layer=layers, n_head=8, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                            attn_implementation="eager")
        self.model = GPT2LMHeadModel(config)

    def forward(self, tokens):
        return self.model(tokens).logits


def lm_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


@dataclass
class Workload:
    name: str
    make_model: Callable
    loss_fn: Callable
    make_batch: Callable  # generator -> (inputs..., label)




def _images(batch):
    return lambda g: (torch.randn(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g))


def _vectors(batch):
    return lambda g: (torch.randn(batch, 784, generator=g), torch.randint(0, 10, (batch,), generator=g))


def _tokens(batch, vocab=1000, seq=64):
    return lambda g: (torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g))


def _color_images(batch):
    return lambda g: (torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g))


WORKLOADS = [
    Workload("MLP 784-1024-1024-10 (64)", MLP, F.cross_entropy, _vectors(64)),
    Workload("MLP 784-1024-1024-10 (8)", MLP, F.cross_entropy, _vectors(8)),
    Workload("2-layer encoder d256 seq64 (16)", Encoder, lm_loss, _tokens(16)),
    Workload("LeNet 1x28x28 (64)", LeNet, F.cross_entropy, _images(64)),
    Workload("ResNet basic blocks + BatchNorm 3x32x32 (32)", ResNet, F.cross_entropy, _color_images(32)),
    Workload("MobileNetV3-style 3x32x32 (32)", MobileNetV3, F.cross_entropy, _color_images(32)),
    Workload("HF GPT-2 6x d512 vocab 8000 seq 128 (8)", GPT2, lm_loss, _tokens(8, vocab=8000, seq=128)),
]
