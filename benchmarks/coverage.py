"""Which torch.nn layers and losses train: orttrainer vs ONNX Runtime's on-device training API.

For every case a small model around the layer is trained for one SGD step:
- orttrainer: ``train_step`` must succeed and give the same loss and updated weights as a
  torch SGD step (rtol 1e-4);
- on-device API: ``onnxruntime.training.artifacts.generate_artifacts`` on the same
  forward+loss graph (TorchScript export, training mode), then one step with
  ``onnxruntime.training.api`` must run and give a finite loss.

    python benchmarks/coverage.py                 # prints the Markdown table
    python benchmarks/coverage.py --check docs/layers.md   # fails if that page's table differs
"""

import argparse
import copy
import io
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import torch
import torch.nn as nn
import torch.nn.functional as F

from orttrainer import ORTTrainer, ORTTrainerOptions, optim

sys.path.insert(0, str(Path(__file__).parent))
from on_device import on_device_training  # noqa: E402

BEGIN, END = "<!-- coverage:begin -->", "<!-- coverage:end -->"


@dataclass
class Case:
    name: str
    make: Callable  # -> nn.Module mapping x [4, 8] (or `shape`) to an output
    loss: Callable = F.mse_loss  # (output, target)
    shape: tuple = (4, 8)
    target: Callable = None  # output -> target tensor (default: randn like output)


class Wrapped(nn.Module):
    """Linear -> layer (-> Linear), so that every layer sits between trainable weights."""

    def __init__(self, layer, width=8, head=True):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.layer = layer
        self.head = nn.LazyLinear(4) if head else nn.Identity()

    def forward(self, x):
        return self.head(self.layer(self.inp(x)))


class Images(nn.Module):
    """Conv -> layer -> flatten -> Linear, on 2x8x8 images."""

    def __init__(self, layer, channels=4):
        super().__init__()
        self.inp = nn.Conv2d(2, channels, 3, padding=1)
        self.layer = layer
        self.head = nn.LazyLinear(4)

    def forward(self, x):
        return self.head(self.layer(self.inp(x)).flatten(1))


class Sequence(nn.Module):
    def __init__(self, layer, first=False):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.layer = layer
        self.first = first
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        y = self.layer(self.inp(x))
        return self.head(y[0] if self.first else y)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.layer = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = self.inp(x)
        return self.head(self.layer(h, h, h, need_weights=False)[0])


class EmbeddingModel(nn.Module):
    def __init__(self, bag=False):
        super().__init__()
        self.layer = nn.EmbeddingBag(20, 8, mode="mean") if bag else nn.Embedding(20, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.layer((x.abs() * 5).long() % 20))


class Bilinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.layer = nn.Bilinear(8, 8, 4)

    def forward(self, x):
        h = self.inp(x)
        return self.layer(h, h)


class Pairwise(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.layer = layer

    def forward(self, x):
        return self.layer(self.a(x), self.b(x))


class EinsumModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.weight = nn.Parameter(torch.randn(8, 4) * 0.3)

    def forward(self, x):
        return torch.einsum("bi,ij->bj", self.inp(x), self.weight)


class TensorFunction(nn.Module):
    """Linear(8, 16) -> ``function`` of its output seen as [4, 4, 4] (torch functions, not modules)."""

    def __init__(self, function):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.function = function

    def forward(self, x):
        return self.function(self.inp(x).reshape(4, 4, 4))


def _loss_case(name, loss, target):
    return Case(f"{name} (loss)", lambda: Wrapped(nn.Identity()), loss=loss, target=target)


def _probabilities(output):
    return torch.rand(output.shape)


def _classes(output):
    return torch.randint(0, output.shape[1], (output.shape[0],))


def _signs(output):
    return torch.randint(0, 2, output.shape).float() * 2 - 1


CASES = [
    Case("Linear", lambda: Wrapped(nn.Linear(8, 8))),
    Case("Bilinear", Bilinear),
    Case("ReLU", lambda: Wrapped(nn.ReLU())),
    Case("LeakyReLU", lambda: Wrapped(nn.LeakyReLU(0.1))),
    Case("PReLU", lambda: Wrapped(nn.PReLU(8))),
    Case("ELU", lambda: Wrapped(nn.ELU())),
    Case("SELU", lambda: Wrapped(nn.SELU())),
    Case("CELU", lambda: Wrapped(nn.CELU(0.5))),
    Case("GELU", lambda: Wrapped(nn.GELU())),
    Case("GELU (tanh)", lambda: Wrapped(nn.GELU(approximate="tanh"))),
    Case("SiLU", lambda: Wrapped(nn.SiLU())),
    Case("Mish", lambda: Wrapped(nn.Mish())),
    Case("Softplus", lambda: Wrapped(nn.Softplus())),
    Case("Softsign", lambda: Wrapped(nn.Softsign())),
    Case("Hardswish", lambda: Wrapped(nn.Hardswish())),
    Case("Hardsigmoid", lambda: Wrapped(nn.Hardsigmoid())),
    Case("Hardtanh", lambda: Wrapped(nn.Hardtanh())),
    Case("ReLU6", lambda: Wrapped(nn.ReLU6())),
    Case("Threshold", lambda: Wrapped(nn.Threshold(0.1, 20.0))),
    Case("Tanh", lambda: Wrapped(nn.Tanh())),
    Case("Sigmoid", lambda: Wrapped(nn.Sigmoid())),
    Case("LogSigmoid", lambda: Wrapped(nn.LogSigmoid())),
    Case("Softmax", lambda: Wrapped(nn.Softmax(dim=1))),
    Case("LogSoftmax", lambda: Wrapped(nn.LogSoftmax(dim=1))),
    Case("GLU", lambda: Wrapped(nn.GLU())),
    Case("Tanhshrink", lambda: Wrapped(nn.Tanhshrink())),
    Case("Conv1d", lambda: Sequence(nn.Conv1d(4, 8, 3, padding=1)), shape=(4, 4, 8)),
    Case("Conv2d + BatchNorm2d", lambda: Images(nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4))), shape=(4, 2, 8, 8)),
    Case("ConvTranspose2d", lambda: Images(nn.ConvTranspose2d(4, 4, 2, stride=2)), shape=(4, 2, 8, 8)),
    Case("BatchNorm1d", lambda: Wrapped(nn.BatchNorm1d(8))),
    Case("Linear with spectral_norm", lambda: Wrapped(nn.utils.parametrizations.spectral_norm(nn.Linear(8, 8)))),
    Case("LayerNorm", lambda: Wrapped(nn.LayerNorm(8))),
    Case("RMSNorm", lambda: Wrapped(nn.RMSNorm(8))),
    Case("GroupNorm", lambda: Images(nn.GroupNorm(2, 4)), shape=(4, 2, 8, 8)),
    Case("InstanceNorm2d (affine)", lambda: Images(nn.InstanceNorm2d(4, affine=True)), shape=(4, 2, 8, 8)),
    Case("InstanceNorm2d (running statistics)", lambda: Images(nn.InstanceNorm2d(4, affine=True, track_running_stats=True)),
         shape=(4, 2, 8, 8)),
    Case("LocalResponseNorm", lambda: Images(nn.LocalResponseNorm(2)), shape=(4, 2, 8, 8)),
    Case("MaxPool2d", lambda: Images(nn.MaxPool2d(2)), shape=(4, 2, 8, 8)),
    Case("AvgPool2d", lambda: Images(nn.AvgPool2d(2)), shape=(4, 2, 8, 8)),
    Case("AdaptiveAvgPool2d", lambda: Images(nn.AdaptiveAvgPool2d(1)), shape=(4, 2, 8, 8)),
    Case("PixelShuffle", lambda: Images(nn.PixelShuffle(2)), shape=(4, 2, 8, 8)),
    Case("ChannelShuffle", lambda: Images(nn.ChannelShuffle(2)), shape=(4, 2, 8, 8)),
    Case("Upsample (nearest)", lambda: Images(nn.Upsample(scale_factor=2)), shape=(4, 2, 8, 8)),
    Case("Upsample (bilinear)", lambda: Images(nn.Upsample(scale_factor=2, mode="bilinear")), shape=(4, 2, 8, 8)),
    Case("ReflectionPad2d", lambda: Images(nn.ReflectionPad2d(1)), shape=(4, 2, 8, 8)),
    Case("ReplicationPad2d", lambda: Images(nn.ReplicationPad2d(1)), shape=(4, 2, 8, 8)),
    Case("Dropout", lambda: Wrapped(nn.Dropout(0.0))),
    Case("Embedding", EmbeddingModel),
    Case("EmbeddingBag", lambda: EmbeddingModel(bag=True)),
    Case("LSTM", lambda: Sequence(nn.LSTM(8, 8, batch_first=True), first=True), shape=(4, 5, 8)),
    Case("GRU", lambda: Sequence(nn.GRU(8, 8, batch_first=True), first=True), shape=(4, 5, 8)),
    Case("RNN", lambda: Sequence(nn.RNN(8, 8, batch_first=True), first=True), shape=(4, 5, 8)),
    Case("MultiheadAttention", Attention, shape=(4, 5, 8)),
    Case("TransformerEncoderLayer", lambda: Sequence(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)), shape=(4, 5, 8)),
    Case("CosineSimilarity", lambda: Pairwise(nn.CosineSimilarity())),
    Case("PairwiseDistance", lambda: Pairwise(nn.PairwiseDistance())),
    Case("torch.einsum", EinsumModel),
    Case("torch.cumsum", lambda: TensorFunction(lambda h: torch.cumsum(h, dim=1))),
    Case("torch.cumprod", lambda: TensorFunction(lambda h: torch.cumprod(h, dim=1))),
    Case("torch.amax", lambda: TensorFunction(lambda h: h.amax(dim=2))),
    Case("torch.logsumexp", lambda: TensorFunction(lambda h: torch.logsumexp(h, dim=2))),
    Case("torch.linalg.vector_norm", lambda: TensorFunction(lambda h: torch.linalg.vector_norm(h, dim=1))),
    Case("torch.flip", lambda: TensorFunction(lambda h: torch.flip(h, dims=[2]) * h)),
    Case("torch.atan2", lambda: TensorFunction(lambda h: torch.atan2(h, torch.flip(h, dims=[2]) + 2))),
    _loss_case("MSELoss", F.mse_loss, None),
    _loss_case("L1Loss", F.l1_loss, None),
    _loss_case("SmoothL1Loss", F.smooth_l1_loss, None),
    _loss_case("HuberLoss", F.huber_loss, None),
    _loss_case("CrossEntropyLoss", F.cross_entropy, _classes),
    _loss_case("NLLLoss", lambda out, y: F.nll_loss(F.log_softmax(out, 1), y), _classes),
    _loss_case("BCEWithLogitsLoss", F.binary_cross_entropy_with_logits, _probabilities),
    _loss_case("BCELoss", lambda out, y: F.binary_cross_entropy(torch.sigmoid(out), y), _probabilities),
    _loss_case("KLDivLoss", lambda out, y: F.kl_div(F.log_softmax(out, 1), y, reduction="batchmean"), lambda o: torch.softmax(torch.randn(o.shape), 1)),
    _loss_case("SoftMarginLoss", F.soft_margin_loss, _signs),
    _loss_case("MultiLabelSoftMarginLoss", F.multilabel_soft_margin_loss, lambda o: torch.randint(0, 2, o.shape).float()),
    _loss_case("PoissonNLLLoss", F.poisson_nll_loss, lambda o: torch.rand(o.shape) * 3),
    _loss_case("HingeEmbeddingLoss", F.hinge_embedding_loss, _signs),
    _loss_case("MarginRankingLoss", lambda out, y: F.margin_ranking_loss(out[:, 0], out[:, 1], y[:, 0]), _signs),
    _loss_case("CosineEmbeddingLoss", lambda out, y: F.cosine_embedding_loss(out[:, :2], out[:, 2:], y[:, 0]), _signs),
    _loss_case("TripletMarginLoss", lambda out, y: F.triplet_margin_loss(out, y, y.flip(0)), None),
]


def _batch(case):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(*case.shape, generator=generator)
    return x


def _target(case, model, x):
    with torch.no_grad():
        output = copy.deepcopy(model).eval()(x)
    return case.target(output) if case.target else torch.randn(output.shape)


def _with_label(case):
    torch.manual_seed(0)
    model = case.make()
    x = _batch(case)
    model(x)  # materialise lazy modules
    torch.manual_seed(1)
    return model, x, _target(case, model, x)


def check_orttrainer(case):
    """One SGD step with orttrainer equals one with torch."""
    model, x, y = _with_label(case)
    reference = copy.deepcopy(model)
    options = ORTTrainerOptions({"device": {"id": "cpu"}})
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=case.loss, options=options)
    loss = trainer.train_step(x, y)[0]
    expected = case.loss(reference(x), y)
    expected.backward()
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter -= 0.1 * parameter.grad
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-4, atol=1e-5)
    state = trainer.state_dict(pytorch_format=True)
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


class _WithLoss(nn.Module):
    def __init__(self, model, loss):
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, x, y):
        return self.loss(self.model(x), y)


def check_on_device(case):
    """generate_artifacts + one step of onnxruntime.training.api."""
    model, x, y = _with_label(case)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        # the on-device contender's own export (not orttrainer's): its exporter notices are not ours to act on
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        torch.onnx.export(_WithLoss(model, case.loss), (x, y), buffer, dynamo=False, opset_version=17,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          input_names=["x", "y"], output_names=["loss"])
    exported = onnx.load_from_string(buffer.getvalue())
    names = {init.name for init in exported.graph.initializer}
    requires_grad = [f"model.{name}" for name, p in model.named_parameters() if f"model.{name}" in names]
    frozen = [name for name in names if name not in requires_grad and name.startswith("model.")]
    module, optimizer = on_device_training(exported, requires_grad, None, frozen)
    loss = module(x.numpy(), y.numpy())
    optimizer.step()
    if not np.isfinite(np.asarray(loss)).all():
        raise RuntimeError(f"non-finite loss {loss}")


CHECKS = {"orttrainer": check_orttrainer, "on-device": check_on_device}


def _worker(check_name, indices, verbose):
    """Run checks in this process, one result line each (the parent survives native crashes)."""
    import onnxruntime

    onnxruntime.set_default_logger_severity(3)
    for index in indices:
        try:
            CHECKS[check_name](CASES[index])
            outcome = "yes"
        except Exception as error:  # a coverage survey: every failure is a "no", explained with -v
            outcome = "no"
            if verbose:
                print(f"--- {check_name} / {CASES[index].name}: {type(error).__name__}: {str(error)[:400]}", file=sys.stderr)
        print(f"RESULT {index} {outcome}", flush=True)


def _measure(check_name, verbose):
    """{case index: 'yes'|'no'}, restarting the worker after a case that crashed it."""
    results = {}
    while len(results) < len(CASES):
        remaining = [index for index in range(len(CASES)) if index not in results]
        command = [sys.executable, __file__, "--worker", check_name, "--cases", ",".join(map(str, remaining))]
        if verbose:
            command.append("-v")
        worker = subprocess.run(command, capture_output=True, text=True, env=_child_env())
        if verbose:
            sys.stderr.write(worker.stderr)
        for line in worker.stdout.splitlines():
            if line.startswith("RESULT "):
                _, index, outcome = line.split()
                results[int(index)] = outcome
        crashed = next((index for index in remaining if index not in results), None)
        if crashed is not None:
            results[crashed] = "no"
            if verbose:
                print(f"--- {check_name} / {CASES[crashed].name}: the process died (exit {worker.returncode})", file=sys.stderr)
    return results


def _child_env():
    root = str(Path(__file__).resolve().parent.parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}


def table(verbose=False):
    measured = {name: _measure(name, verbose) for name in CHECKS}
    rows = ["| layer / loss | orttrainer | on-device API |", "|---|---|---|"]
    for index, case in enumerate(CASES):
        rows.append(f"| {case.name} | {measured['orttrainer'][index]} | {measured['on-device'][index]} |")
    totals = [sum(outcome == "yes" for outcome in measured[name].values()) for name in CHECKS]
    rows.append(f"| **total of {len(CASES)}** | **{totals[0]}** | **{totals[1]}** |")
    return "\n".join(rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", type=Path, help="a Markdown file whose coverage table must equal the measured one")
    parser.add_argument("-v", "--verbose", action="store_true", help="print why each 'no' failed")
    parser.add_argument("--worker", choices=sorted(CHECKS), help=argparse.SUPPRESS)
    parser.add_argument("--cases", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, [int(index) for index in args.cases.split(",") if index], args.verbose)
        return
    measured = table(args.verbose)
    print(measured)
    if args.check:
        text = args.check.read_text()
        recorded = text.split(BEGIN, 1)[1].split(END, 1)[0].strip() if BEGIN in text else None
        if recorded != measured:
            sys.exit(f"{args.check}'s coverage table differs from the measured one; paste the table above between "
                     f"{BEGIN} and {END}")


if __name__ == "__main__":
    main()
