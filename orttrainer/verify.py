"""The built-in check: the first step of every training graph, redone in torch autograd.

At the first ``train_step`` after a graph is built, the trainer runs that graph once
more with dropout off, and this module runs the user's module and loss in torch autograd
on the same batch and weights, in the same train/eval modes, also with dropout off. Loss,
outputs, the gradient of every trained weight and the buffers forward updates
(BatchNorm statistics) must agree within a tolerance scaled by dtype and magnitude.

Why dropout off, on both sides: the two sides cannot draw the same masks, and with
dropout off everything but the dropout itself is compared; dropout's own gradient is
tested separately (tests/test_dropout.py).

A mismatch raises :class:`TorchMismatchError` naming each differing tensor, the largest
absolute and relative differences, the ONNX node that produced it and the torch module
it belongs to (``debug.check_against_torch``: "error", "warn" or "off").
"""

import copy
import inspect
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import export

# Relative tolerance by the dtype ONNX Runtime computed in. The absolute tolerance is the
# same fraction of the tensor's largest magnitude (sums of many terms cancel), plus a
# floor of 1% of it times the largest magnitude of that kind of tensor in the whole
# model (a gradient that is zero in exact arithmetic, like a conv bias before BatchNorm,
# is rounding noise on both sides).
_TOLERANCE = {torch.float32: 1e-3, torch.float16: 3e-2}
_HOW_TO_CHANGE = (
    "If the difference is expected (random ops other than dropout in forward, for example), set "
    "ORTTrainerOptions({'debug': {'check_against_torch': 'warn'}}) to be warned instead, or 'off' to skip the check."
)


class TorchMismatchError(RuntimeError):
    """ONNX Runtime's first step differs from torch's on the same batch and weights."""


_DROPOUTS = (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
             torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout)  # fmt: skip


class _NoDropout(TorchFunctionMode):
    """Every dropout is the identity (also the ``dropout_p`` of attention functions)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DROPOUTS:
            return args[0] if args else kwargs["input"]
        if func in (F.scaled_dot_product_attention, F.multi_head_attention_forward):
            bound = inspect.signature(func).bind(*args, **kwargs)
            bound.arguments["dropout_p"] = 0.0
            return func(*bound.args, **bound.kwargs)
        return func(*args, **kwargs)


@dataclass
class StepResult:
    """What one side computed for the batch: all tensors on the CPU, keyed by name."""

    outputs: dict  # graph output name -> tensor (the loss among them)
    gradients: dict  # trained weight name -> gradient
    buffers: dict = field(default_factory=dict)  # buffer name -> value after the step


def torch_step(module, loss_fn, forward_names, inputs, weights: dict, output_names, loss_name, trained) -> StepResult:
    """Forward + loss + backward of a copy of ``module`` holding ``weights``, dropout off.

    ``output_names`` name the outputs of model + loss in order; ``trained`` are the weights
    whose gradients are compared (a weight torch leaves without gradient counts as zero).
    """
    module = copy.deepcopy(module)
    module.load_state_dict({name: tensor.detach().cpu() for name, tensor in weights.items()}, strict=False)
    wrapper = export.with_loss(module, loss_fn, forward_names)
    with torch.enable_grad(), _NoDropout():
        outputs = wrapper(*[tensor.cpu() for tensor in inputs])
    outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    outputs[output_names.index(loss_name)].backward()
    parameters = dict(module.named_parameters())
    gradients = {
        name: parameters[name].grad if parameters[name].grad is not None else torch.zeros_like(parameters[name])
        for name in trained
    }
    buffers = {name: tensor.detach().clone() for name, tensor in module.named_buffers() if name in weights}
    return StepResult(dict(zip(output_names, (out.detach() for out in outputs))), gradients, buffers)


@dataclass
class Difference:
    kind: str  # "output", "gradient of", "buffer"
    name: str
    largest_absolute: float
    largest_relative: float
    where: str


def _largest_finite(tensor: torch.Tensor) -> float:
    finite = tensor.detach()[tensor.detach().isfinite()]
    return finite.abs().max().item() if finite.numel() else 0.0


def _difference(actual: torch.Tensor, expected: torch.Tensor, relative_tolerance: float, floor: float):
    """(largest absolute, largest relative difference) if outside the tolerance, else None."""
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    if actual.shape != expected.shape:
        return float("inf"), float("inf")
    both_nan = actual.isnan() & expected.isnan()
    same_infinity = actual.isinf() & (actual == expected)
    error = (actual - expected).abs().masked_fill(both_nan | same_infinity, 0.0).nan_to_num(nan=float("inf"))
    allowed = relative_tolerance * (expected.abs().nan_to_num(posinf=0.0, neginf=0.0) + _largest_finite(expected)) + floor
    if bool((error <= allowed).all()):
        return None
    relative = (error / expected.abs().clamp_min(1e-12)).max().item()
    return error.max().item(), relative


def compare(ort: StepResult, reference: StepResult, dtype: torch.dtype, where: dict) -> list:
    """Every tensor of ``ort`` that differs from ``reference``; ``where`` names a tensor's node and module."""
    tolerance = _TOLERANCE.get(dtype, 1e-3)
    found = []
    for kind, mine, theirs in (("output", ort.outputs, reference.outputs), ("gradient of", ort.gradients, reference.gradients),
                               ("buffer", ort.buffers, reference.buffers)):  # fmt: skip
        compared = [name for name, value in mine.items()
                    if name in theirs and value.is_floating_point() and theirs[name].is_floating_point()]  # fmt: skip
        floor = tolerance * 1e-2 * max([_largest_finite(theirs[name]) for name in compared], default=0.0) + 1e-12
        for name in compared:
            difference = _difference(mine[name], theirs[name], tolerance, floor)
            if difference is not None:
                found.append(Difference(kind, name, *difference, where.get(name, "")))
    return found


def report(differences: list, mode: str) -> None:
    """Raise (mode "error") or warn (mode "warn") about ``differences``."""
    if not differences or mode == "off":
        return
    lines = [
        f"{d.kind} '{d.name}'{f' ({d.where})' if d.where else ''}: largest absolute difference {d.largest_absolute:.3g}, "
        f"largest relative {d.largest_relative:.3g}"
        for d in differences
    ]
    message = (
        "orttrainer's first step differs from torch autograd on the same batch and weights (dropout off on both "
        "sides), so training would not do what torch does:\n- " + "\n- ".join(lines) + "\n" + _HOW_TO_CHANGE
    )
    if mode == "error":
        raise TorchMismatchError(message)
    warnings.warn(message, stacklevel=3)
