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


def _tokens(batch):
    return lambda g: (torch.randint(0, 1000, (batch, 64), generator=g), torch.randint(0, 1000, (batch, 64), generator=g))


WORKLOADS = [
    Workload("MLP 784-1024-1024-10 (64)", MLP, F.cross_entropy, _vectors(64)),
    Workload("MLP 784-1024-1024-10 (8)", MLP, F.cross_entropy, _vectors(8)),
    Workload("2-layer encoder d256 seq64 (16)", Encoder, lm_loss, _tokens(16)),
    Workload("LeNet 1x28x28 (64)", LeNet, F.cross_entropy, _images(64)),
]
