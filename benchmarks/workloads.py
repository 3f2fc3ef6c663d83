"""The benchmark workloads (issue 7's table): model, loss, batch, same for every contender."""

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import zoo  # noqa: E402  (the test zoo's models: one definition for the tests and the benchmarks)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))

    def forward(self, x):
        return self.net(x)


class Encoder(nn.Module):
    """A 2-layer BERT-like encoder: d_model 256, 4 heads, FFN 1024, sequence 64, vocab 1000, GELU."""

    def __init__(self, vocab=1000, d_model=256, layers=2, seq=64, dropout=0.0):
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Parameter(torch.zeros(1, seq, d_model))
        layer = nn.TransformerEncoderLayer(d_model, 4, 4 * d_model, dropout=dropout, batch_first=True,
                                           activation="gelu")  # fmt: skip
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


def ResNet():
    """A CIFAR ResNet (the zoo's, tests/zoo.py): 3x3 stem, three stages of two basic blocks (widths 16, 32, 64)."""
    return zoo.ResNet(classes=10, widths=(16, 32, 64))


def MobileNetV3():
    """A MobileNetV3-small-style net for 3x32x32 images (the zoo's, tests/zoo.py, larger)."""
    blocks = ((16, 64, 24, 2), (24, 72, 24, 1), (24, 96, 40, 2), (40, 120, 40, 1), (40, 240, 80, 2))
    return zoo.MobileNetV3(classes=10, blocks=blocks, stem_stride=1, head=256, hidden=128)


class GPT2(nn.Module):
    """transformers' GPT2LMHeadModel from a config (random weights, no dropout), logits from token ids."""

    def __init__(self, layers=6, width=512, vocab=8000, seq=128, heads=8):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=width, n_layer=layers, n_head=heads, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                            attn_implementation="eager")
        self.model = GPT2LMHeadModel(config)

    def forward(self, tokens):
        return self.model(tokens).logits


class BertClassifier(nn.Module):
    """transformers' BertForSequenceClassification from a config (random weights, no dropout), BERT-base's shape by
    default: logits of 2 labels from token ids."""

    def __init__(self, layers=12, width=768, vocab=30522, seq=128):
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(vocab_size=vocab, hidden_size=width, num_hidden_layers=layers, num_attention_heads=width // 64,
                            intermediate_size=4 * width, max_position_embeddings=seq, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0, num_labels=2, attn_implementation="eager")
        self.model = BertForSequenceClassification(config)

    def forward(self, tokens):
        return self.model(tokens).logits


def lm_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


@dataclass
class Workload:
    name: str
    make_model: Callable
    loss_fn: Callable  # None: the batch is keywords, labels included, and the model returns its own loss
    make_batch: Callable  # generator -> (inputs..., label), or a dict of keywords


def train_on(trainer, batch):
    """``trainer.train_step`` on a batch of either form ``Workload.make_batch`` makes."""
    return trainer.train_step(**batch) if isinstance(batch, dict) else trainer.train_step(*batch)




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
    Workload("2-layer encoder d256 seq64 dropout 0.1 (16)", lambda: Encoder(dropout=0.1), lm_loss, _tokens(16)),
    Workload("LeNet 1x28x28 (64)", LeNet, F.cross_entropy, _images(64)),
    Workload("ResNet basic blocks + BatchNorm 3x32x32 (32)", ResNet, F.cross_entropy, _color_images(32)),
    Workload("MobileNetV3-style 3x32x32 (32)", MobileNetV3, F.cross_entropy, _color_images(32)),
    Workload("HF GPT-2 6x d512 vocab 8000 seq 128 (8)", GPT2, lm_loss, _tokens(8, vocab=8000, seq=128)),
    Workload("LSTM classifier, embedding 128, hidden 256, seq 32 (16)", lambda: zoo.RecurrentClassifier(width=128, hidden=256),
             F.cross_entropy, lambda g: zoo.padded_token_batch(16, 32, generator=g)),
]


def _labelled_tokens(batch, vocab, seq):
    return lambda g: (torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, 2, (batch,), generator=g))


# issue 45's bfloat16 rows: the GPT-2 above, GPT-2 small (124M), a BERT-base-shaped classifier, the CIFAR ResNet
_BY_NAME = {workload.name: workload for workload in WORKLOADS}
BFLOAT16_WORKLOADS = [
    _BY_NAME["HF GPT-2 6x d512 vocab 8000 seq 128 (8)"],
    Workload("HF GPT-2 small 12x d768 vocab 50257 seq 128 (4)", lambda: GPT2(layers=12, width=768, vocab=50257, heads=12),
             lm_loss, _tokens(4, vocab=50257, seq=128)),
    Workload("HF BERT-base classifier 12x d768 seq 128 (16)", BertClassifier, F.cross_entropy,
             _labelled_tokens(16, vocab=30522, seq=128)),
    _BY_NAME["ResNet basic blocks + BatchNorm 3x32x32 (32)"],
]


def workload_named(text):
    """The one workload (of ``WORKLOADS`` and the zoo's) whose name is ``text`` or, failing that, the
    one that contains it (case-insensitive); a ValueError listing the names otherwise."""
    candidates = WORKLOADS + zoo_workloads()
    exact = [w for w in candidates if w.name.lower() == text.lower()]
    matches = exact or [w for w in candidates if text.lower() in w.name.lower()]
    if len(matches) != 1:
        names = "\n  ".join(w.name for w in candidates)
        raise ValueError(f"--workload {text!r} matches {len(matches)} workloads; give a part of one of:\n  {names}")
    return matches[0]


def _zoo_batch(make_batch, shape):
    return lambda g: make_batch(*shape, generator=g)


def zoo_workloads():
    """The test zoo's models (tests/zoo.py), batch 16 (and 32 tokens): the architectures the parity
    tests train, at the zoo's tiny widths, so a step is mostly what orttrainer and torch pay per
    step and per op. The Hugging Face models take keyword batches and return their own loss."""
    shapes = {"images": (16,), "image sizes": (16,), "audio": (16,), "tokens": (16, 32), "short tokens": (16, 16)}
    workloads = []
    for models, loss_fn in ((zoo.TORCH_MODELS, F.cross_entropy), (zoo.HUGGING_FACE_MODELS, None)):
        for name, (make, make_batch, kind) in models.items():
            shape = shapes[kind]
            label = f"zoo {name} ({'x'.join(map(str, shape))})"
            workloads.append(Workload(label, make, loss_fn, _zoo_batch(make_batch, shape)))
    return workloads
