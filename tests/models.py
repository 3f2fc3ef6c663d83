"""Real models used across the tests: MLP, CNN with BatchNorm, transformer encoder, and variants."""

import warnings

import onnx
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 50
SEQ = 12


class MLP(nn.Module):
    def __init__(self, inputs=32, hidden=64, classes=10):
        super().__init__()
        self.fc1 = nn.Linear(inputs, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.head(F.gelu(self.fc2(torch.relu(self.fc1(x)))))


class CNN(nn.Module):
    """Conv + BatchNorm2d + MaxPool + Dropout, on 1x16x16 images."""

    def __init__(self, dropout=0.0, classes=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(16 * 4 * 4, classes)

    def forward(self, images):
        return self.head(self.dropout(self.features(images).flatten(1)))


class Encoder(nn.Module):
    """Token + position embeddings, one TransformerEncoderLayer, LayerNorm, LM head."""

    def __init__(self, dropout=0.0, d_model=32, heads=4):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, d_model)
        self.positions = nn.Parameter(torch.randn(1, SEQ, d_model) * 0.1)
        self.layer = nn.TransformerEncoderLayer(
            d_model, heads, 2 * d_model, dropout=dropout, batch_first=True, activation="gelu"
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, tokens):
        return self.head(self.norm(self.layer(self.tokens(tokens) + self.positions)))


class SeqFirstEncoder(nn.Module):
    """nn.TransformerEncoder with batch_first=False: its attention bakes (seq, batch) into Reshape shapes."""

    def __init__(self, d_model=16):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, d_model)
        layer = nn.TransformerEncoderLayer(d_model, 2, 2 * d_model, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, tokens):
        return self.head(self.encoder(self.tokens(tokens)))


def lm_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


class TwoHeads(nn.Module):
    """Returns (regression, classification) from a shared trunk."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(16, 32)
        self.regress = nn.Linear(32, 1)
        self.classify = nn.Linear(32, 4)

    def forward(self, x):
        hidden = torch.tanh(self.trunk(x))
        return self.regress(hidden).squeeze(-1), self.classify(hidden)


def two_head_loss(outputs, target):
    """A custom loss over both outputs; ``target`` holds [value, class] per row."""
    value, logits = outputs
    return F.mse_loss(value, target[:, 0]) + F.cross_entropy(logits, target[:, 1].long())


class WithLoss(nn.Module):
    """Computes its own loss: forward(x, label) -> (cross entropy of ``model(x)``, ``model(x)``)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, label):
        logits = self.model(x)
        return F.cross_entropy(logits, label), logits


def MLPWithLoss():
    return WithLoss(MLP())


def training_onnx(model_with_loss: nn.Module, batch, path):
    """``model_with_loss`` exported as a forward+loss ONNX model (inputs x, label; outputs loss, logits)
    in training mode, as a user would write it, with a dynamic batch size; loaded from ``path``."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "You are using the legacy TorchScript-based ONNX export", DeprecationWarning)
        torch.onnx.export(
            model_with_loss, tuple(batch), str(path), dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
            do_constant_folding=False, input_names=["x", "label"], output_names=["loss", "logits"],
            dynamic_axes={"x": {0: "batch"}, "label": {0: "batch"}, "logits": {0: "batch"}}, opset_version=17,
        )
    return onnx.load(str(path))


def mlp_batch(batch=8, generator=None):
    return torch.randn(batch, 32, generator=generator), torch.randint(0, 10, (batch,), generator=generator)


def cnn_batch(batch=8, generator=None):
    return torch.randn(batch, 1, 16, 16, generator=generator), torch.randint(0, 10, (batch,), generator=generator)


def token_batch(batch=4, generator=None):
    return (
        torch.randint(0, VOCAB, (batch, SEQ), generator=generator),
        torch.randint(0, VOCAB, (batch, SEQ), generator=generator),
    )


def two_head_batch(batch=8, generator=None):
    x = torch.randn(batch, 16, generator=generator)
    target = torch.stack([torch.randn(batch, generator=generator), torch.randint(0, 4, (batch,), generator=generator).float()], 1)
    return x, target


class TokenTagger(nn.Module):
    """Embedding -> Linear -> GELU -> Linear: per-token class scores [N, C, T]."""

    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(50, 16)
        self.hidden = nn.Linear(16, 32)
        self.out = nn.Linear(32, 9)

    def forward(self, tokens):
        return self.out(F.gelu(self.hidden(self.tokens(tokens)))).transpose(1, 2)


class StraightThrough(nn.Module):
    """A straight-through rounding (VQ / quantization-aware training), a stop-gradient branch (SimSiam, BYOL) and a
    head that reaches the loss only through a detach (torch gives it no gradient, so SGD leaves it as it is)."""

    def __init__(self):
        super().__init__()
        self.encoder, self.head, self.probe = nn.Linear(6, 6), nn.Linear(6, 4), nn.Linear(6, 4)

    def forward(self, x):
        h = self.encoder(x)
        quantized = h + (torch.round(h * 2.0) / 2.0 - h).detach()
        return self.head(quantized) + 0.5 * self.head(h.detach()) + self.probe(x).detach()


class NoGradTarget(nn.Module):
    """A target computed under torch.no_grad() from the same encoder (and a scale from its output), which torch
    gives no gradient: the trace records no grad mode, trace._NoGradResultsDetached detaches them."""

    def __init__(self):
        super().__init__()
        self.encoder, self.head = nn.Linear(6, 6), nn.Linear(6, 4)

    def forward(self, x):
        h = self.encoder(x)
        with torch.no_grad():
            target = self.encoder(x * 2.0).softmax(-1)
            scale = h.abs().mean() + 1.0
        return self.head(h * target / scale)
