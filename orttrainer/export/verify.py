"""The built-in check: the first step of every training graph, redone in torch autograd.

At the first ``train_step`` after a graph is built, the trainer runs that graph with dropout
off, and this module then runs the user's module and loss in torch autograd on the same batch
and weights, in the same train/eval modes, also with dropout off. Loss, outputs, the gradient of
every trained weight and the buffers forward updates (BatchNorm statistics) must agree within a
tolerance scaled by dtype and magnitude. Torch's tensors are compared as torch computes them
(``Comparison``) and only those that differ are kept: torch's step, taken while ONNX Runtime's
outputs are held, needs no more memory than a plain torch loop's step.

Why dropout off, on both sides: the two sides cannot draw the same masks, and with
dropout off everything but the dropout itself is compared; dropout's own gradient is
tested separately (tests/test_dropout.py).

The first ``eval_step`` on a graph is checked the same way, outputs only, against the module in eval
mode (``torch_eval``): the eval graph is the training trace in inference mode, so a branch forward
takes only in eval mode is not in it.

A mismatch raises :class:`TorchMismatchError` naming each differing tensor, the largest
absolute and relative differences, the ONNX node that produced it and the torch module
it belongs to (``debug.check_against_torch``: "error", "warn" or "off").
"""

import contextlib
import functools
import inspect
import math
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.overrides import TorchFunctionMode

from . import as_trained, forward_effects

# Relative tolerance by the dtype ONNX Runtime computed in. The absolute tolerance is the
# same fraction of the tensor's largest magnitude (sums of many terms cancel), plus a
# floor of 1% of it times the largest magnitude of that kind of tensor in the whole
# model (a gradient that is zero in exact arithmetic, like a conv bias before BatchNorm,
# is rounding noise on both sides).
_TOLERANCE = {torch.float32: 1e-3, torch.float16: 3e-2, torch.bfloat16: 1e-1}
# How far rounding alone moves torch's result (``rounding_spread``): weights nudged by this
# relative amount (about the forward error of a float32 / float16 graph), the largest move over
# a few nudges, with a safety factor.
_NUDGE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
_NUDGE_TRIALS = 3
_SPREAD_FACTOR = 4.0
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
        if func is F.scaled_dot_product_attention and len(args) > 4:  # a builtin: no signature to bind
            return func(*args[:4], 0.0, *args[5:], **kwargs)
        if func is F.scaled_dot_product_attention:
            return func(*args, **{**kwargs, "dropout_p": 0.0})
        if func is F.multi_head_attention_forward:
            bound = inspect.signature(func).bind(*args, **kwargs)
            bound.arguments["dropout_p"] = 0.0
            return func(*bound.args, **bound.kwargs)
        return func(*args, **kwargs)


# The trained weights' size up to which the check keeps torch's gradients whole; above it, each as ``Projected``:
# beside the weights and the step's own gradients, a whole second set would not fit in the memory torch's loop takes.
FULL_CHECK_BYTES = 256 * 2**20
_PROJECTIONS = 8  # random sign vectors per gradient
_PROJECTED_FACTOR = 3.0  # the distance allowed, in multiples of the tolerance's share of the gradient's norm


@dataclass
class Projected:
    """A gradient as the reduced check keeps it: its projections on ``_PROJECTIONS`` vectors of random signs (float64,
    over its finite elements), how many NaN, +inf and -inf it holds, its norm and size; a few numbers where the
    tensor would be the weight's size.

    The difference of two tensors' projections is a sum of their elementwise differences with random signs, whose
    root mean square over the projections estimates the L2 distance of the tensors (within a factor of ~2 with
    probability above 99.9% for 8 projections). The check allows a distance of ``_PROJECTED_FACTOR`` times the
    relative tolerance times the gradient's norm (plus the floor per element): a gradient 1% off, 10 times the
    tolerance, fails; rounding, ~1e-6 of the norm, passes. The sign vectors are one fixed random matrix per process
    over a chunk, each chunk's projections multiplied by signs of its own, so that they are random over the tensor."""

    values: torch.Tensor  # [_PROJECTIONS] float64
    specials: tuple  # (NaN, +inf, -inf) counts
    largest: float  # largest finite magnitude
    norm: float  # L2 norm of the finite elements
    count: int  # finite elements

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "Projected":
        signs, chunk_signs = _projection_signs(), torch.Generator().manual_seed(1)
        values = torch.zeros(_PROJECTIONS, dtype=torch.float64)
        specials, largest, square, count = [0, 0, 0], 0.0, 0.0, 0
        for chunk in _chunks(tensor):
            chunk_square = torch.dot(chunk, chunk).item()  # finite exactly when every element is (float32 squared fits)
            if math.isfinite(chunk_square):  # the common case: four passes over the chunk
                count += chunk.numel()
            else:
                finite = chunk.isfinite()
                specials = [total + int(found.sum()) for total, found in zip(
                    specials, (chunk.isnan(), chunk == float("inf"), chunk == float("-inf")))]  # fmt: skip
                count += int(finite.sum())
                chunk = chunk.masked_fill(~finite, 0.0)
                chunk_square = torch.dot(chunk, chunk).item()
                if not math.isfinite(chunk_square):  # float64 elements past 1e154: the norm, and so the bound, overflow
                    raise RuntimeError("debug.check_against_torch: a float64 gradient holds values past 1e154, which its "
                                       "reduced form cannot bound; set debug.check_against_torch to 'off'")  # fmt: skip
            flip = torch.randint(0, 2, (_PROJECTIONS,), generator=chunk_signs, dtype=torch.float64).mul_(2).sub_(1)
            values += flip * (signs[:, : chunk.numel()] @ chunk)
            if chunk.numel():
                low, high = torch.aminmax(chunk)
                largest = max(largest, -low.item(), high.item())
            square += chunk_square
        return cls(values, tuple(specials), largest, square**0.5, count)

    def distance_to(self, other: "Projected") -> float:
        """The estimated L2 distance between this tensor and ``other`` (projected alike)."""
        return (self.values - other.values).norm().item() / _PROJECTIONS**0.5

    def allowed(self, relative_tolerance: float, floor: float) -> float:
        return _PROJECTED_FACTOR * (relative_tolerance * self.norm + floor * self.count**0.5)


@functools.cache
def _projection_signs() -> torch.Tensor:
    """[_PROJECTIONS, _CHUNK] random signs in float64, the same in every call of the process (both sides)."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 2, (_PROJECTIONS, _CHUNK), generator=generator, dtype=torch.int8).double().mul_(2).sub_(1)


@dataclass
class StepResult:
    """What one side computed for the batch: all tensors on the CPU, keyed by name."""

    outputs: dict  # graph output name -> tensor (the loss among them)
    gradients: dict  # trained weight name -> gradient
    buffers: dict = field(default_factory=dict)  # buffer name -> value after the step


class _ForwardAndGradients(torch.nn.Module):
    """module + loss on a batch: its outputs and the buffers after forward handed to ``forward_done(outputs,
    buffers)``, then with ``loss_index`` (if not None) the gradients of that output for the ``leaves`` that require
    grad, each passed to ``gradient_done(name, gradient)`` as soon as backward has it and dropped then
    (``register_post_accumulate_grad_hook``): backward runs without the outputs (logits) and no full set of gradients
    need exist. One call, so that under ``functional_call`` a forward run again inside backward
    (``torch.utils.checkpoint``) reads the same weights as the first."""

    def __init__(self, wrapper, leaves: dict, buffer_names, loss_index, forward_done, gradient_done):
        super().__init__()
        self.wrapper, self.leaves, self.buffer_names, self.loss_index = wrapper, leaves, buffer_names, loss_index
        self.forward_done, self.gradient_done = forward_done, gradient_done

    def forward(self, *inputs):
        outputs = self.wrapper(*inputs)
        outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
        loss = None if self.loss_index is None else outputs[self.loss_index]
        self.forward_done(outputs, {name: self.leaves[name].detach().cpu().clone() for name in self.buffer_names})
        del outputs
        wanted = {name: leaf for name, leaf in self.leaves.items() if leaf.requires_grad}
        if loss is None or not wanted:
            return

        def keep(name, leaf):
            self.gradient_done(name, leaf.grad)
            leaf.grad = None

        hooks = [leaf.register_post_accumulate_grad_hook(functools.partial(keep, name)) for name, leaf in wanted.items()]
        try:
            loss.backward(inputs=list(wanted.values()))
        except torch.utils.checkpoint.CheckpointError as error:
            raise RuntimeError(
                "debug.check_against_torch could not run the module's backward: torch.utils.checkpoint runs forward "
                f"again inside it, where the check cannot turn dropout off ({str(error).splitlines()[0]}). "
                "Checkpointing does not change what ONNX Runtime computes: train without it, or set "
                "debug.check_against_torch to 'off'"
            ) from error
        finally:
            for hook in hooks:
                hook.remove()


def _run_holding(module, loss_fn, forward_names, constants, inputs, weights: dict, forward_done, trained=(),
                 loss_index=None, gradient_done=None) -> None:  # fmt: skip
    """module + loss run on ``inputs`` with ``weights`` ({state_dict name: tensor}) in place of the module's own
    (``torch.func.functional_call``: nothing is copied, and the module keeps its own tensors): ``forward_done(outputs,
    {buffer name: value after forward})``, then with ``loss_index`` the gradients of that output for the weights
    named in ``trained`` (backward into leaves of their own: no parameter's ``.grad`` is touched), each to
    ``gradient_done(name, gradient)`` (``_ForwardAndGradients``)."""
    leaves, given, seen = {}, {}, set()
    for name, tensor in weights.items():
        memory = (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype)
        if memory in seen:  # a tied weight under another name: functional_call ties it to the first
            continue
        seen.add(memory)
        leaves[name] = tensor.detach().requires_grad_(name in trained and tensor.is_floating_point())
        given[f"wrapper.{as_trained.WRAPPED}{name}"] = leaves[name]
    buffer_names = [name for name in leaves if name not in dict(module.named_parameters())]
    wrapper = as_trained.with_loss(module, loss_fn, forward_names, constants)
    step = _ForwardAndGradients(wrapper, leaves, buffer_names, loss_index, forward_done, gradient_done)
    torch.func.functional_call(step, given, tuple(inputs), strict=False)


def torch_step(module, loss_fn, forward_names, inputs, weights: dict, output_names, loss_name, trained,
               constants=None, projected=False, sink=None) -> StepResult:  # fmt: skip
    """Forward + loss + backward of ``module`` on ``weights``, dropout off; the module is left as it was (its
    buffers put back, its parameters' ``.grad`` untouched).

    ``output_names`` name the outputs of model + loss in order; ``trained`` are the weights
    whose gradients are compared (a weight torch leaves without gradient counts as zero);
    ``constants`` are the step's keywords that forward gets as they are (``return_loss=True``).
    ``projected``: each gradient is kept as its ``Projected`` form, never the whole set (``FULL_CHECK_BYTES``).
    ``sink`` (``Kept`` by default: everything) is handed the outputs and buffers after forward and each gradient as
    backward finishes it; returns the tensors it kept (``sink.kept``).
    """
    sink = sink if sink is not None else Kept()
    parameters = dict(module.named_parameters())
    weights = {**{name: parameters[name] for name in trained if name not in weights}, **weights}
    given = set()

    def gradient_done(name, gradient):
        given.add(name)
        dense = _dense(gradient, weights[name])
        sink.gradient(name, Projected.of(dense) if projected else dense)

    def forward_done(outputs, buffers):
        sink.forward_done(dict(zip(output_names, (out.detach().cpu() for out in outputs))), buffers)

    with as_trained.as_trained(module), _without_activation_checkpointing(module), torch.enable_grad(), _NoDropout():
        _run_holding(module, loss_fn, forward_names, constants, inputs, weights, forward_done, trained,
                     output_names.index(loss_name), gradient_done)  # fmt: skip
    for name in trained:
        if name not in given:
            gradient_done(name, None)
    return sink.kept


def torch_eval(module, loss_fn, forward_names, inputs, weights: dict, output_names, constants=None,
               sink=None) -> StepResult:  # fmt: skip
    """Forward + loss of ``module`` on ``weights``, in eval mode: what eval_step must give; the module is left as it was.
    ``sink`` as in ``torch_step``.

    Grad mode stays on, as in the trace: without it ``nn.MultiheadAttention`` and the transformer layers take a
    fast path in eval mode, which gives the padded positions other values. Autograd keeps no activations."""
    sink = sink if sink is not None else Kept()

    def forward_done(outputs, buffers):
        sink.forward_done(dict(zip(output_names, (out.detach().cpu() for out in outputs))), {})

    with as_trained.as_trained(module, eval_mode=True), torch.enable_grad(), as_trained.keeping_no_activations():
        _run_holding(module, loss_fn, forward_names, constants, inputs, weights, forward_done)
    return sink.kept


@contextlib.contextmanager
def _without_activation_checkpointing(module):
    """transformers' activation (gradient) checkpointing off on ``module`` in the block, then on again: it runs
    forward again inside backward, where _NoDropout does not reach, so the two forwards would differ. The gradients
    are the same without it."""
    checkpointed = [layer for layer in module.modules() if getattr(layer, "gradient_checkpointing", False) is True]
    for layer in checkpointed:
        layer.gradient_checkpointing = False
    try:
        yield
    finally:
        for layer in checkpointed:
            layer.gradient_checkpointing = True


def _dense(gradient, weight: torch.Tensor) -> torch.Tensor:
    """The gradient torch gave a weight as a dense CPU tensor: zeros where it gave none, an embedding's sparse
    gradient (``sparse=True``) filled in."""
    if gradient is None:
        return torch.zeros(weight.shape, dtype=weight.dtype)
    return (gradient.to_dense() if gradient.is_sparse else gradient).cpu()


@dataclass
class ModuleCall:
    """The torch module a graph came from and how its forward is called: the torch side of a graph's first
    eval_step check."""

    module: torch.nn.Module
    forward_names: list
    constants: dict  # the step's constants the graph was exported with


@dataclass
class Reference(ModuleCall):
    """The torch side of a graph's first-step check: the module, how forward is called, and whether torch's
    gradients are kept as ``Projected`` (``torch_step``). Torch's step is taken at the check, after ONNX Runtime's run
    (whose first run gives its arena's memory back), on the weights as they are then."""

    projected: bool


@dataclass
class Difference:
    kind: str  # "output", "gradient of", "buffer"
    name: str
    largest_absolute: float
    largest_relative: float
    where: str
    projected: bool = False  # the two numbers are the estimated L2 distance and its share of the norm (Projected)


_CHUNK = 1 << 18  # elements compared at a time: the ~15 float64 temporaries of a chunk stay ~30 MB (logits over a vocabulary)


def _chunks(tensor: torch.Tensor):
    flat = tensor.detach().cpu().reshape(-1)
    return (flat[start : start + _CHUNK].double() for start in range(0, flat.numel(), _CHUNK))


def _largest_finite(tensor) -> float:
    if isinstance(tensor, Projected):
        return tensor.largest
    flat = tensor.detach().cpu().reshape(-1)
    chunks = (flat[start : start + _CHUNK].abs().nan_to_num_(nan=0.0, posinf=0.0) for start in range(0, flat.numel(), _CHUNK))
    return max((float(chunk.max()) for chunk in chunks), default=0.0)  # |x| is exact in x's own type


def _difference(actual, expected, relative_tolerance: float, floor: float, largest_expected: float):
    """(largest absolute, largest relative difference) if outside the tolerance, else None (for ``Projected``
    tensors: the estimated L2 distance, and its ratio to the norm). ``largest_expected``: ``_largest_finite(expected)``.
    """
    if isinstance(expected, Projected):
        if actual.specials != expected.specials:
            return float("inf"), float("inf")
        distance = actual.distance_to(expected)
        return None if distance <= expected.allowed(relative_tolerance, floor) else (distance, distance / max(expected.norm, 1e-30))
    if actual.shape != expected.shape:
        return float("inf"), float("inf")
    if all(_finite_and_within(mine, theirs, relative_tolerance, floor, largest_expected)
           for mine, theirs in zip(_chunks(actual), _chunks(expected))):  # fmt: skip
        return None
    outside, largest_absolute, largest_relative = False, 0.0, 0.0
    for mine, theirs in zip(_chunks(actual), _chunks(expected)):
        both_nan = mine.isnan() & theirs.isnan()
        same_infinity = mine.isinf() & (mine == theirs)
        error = (mine - theirs).abs().masked_fill(both_nan | same_infinity, 0.0).nan_to_num(nan=float("inf"))
        allowed = _allowed(theirs.abs().nan_to_num(posinf=0.0, neginf=0.0), relative_tolerance, floor, largest_expected)
        outside = outside or not bool((error <= allowed).all())
        largest_absolute = max(largest_absolute, error.max().item())
        largest_relative = max(largest_relative, (error / theirs.abs().clamp_min(1e-12)).max().item())
    return (largest_absolute, largest_relative) if outside else None


def _allowed(magnitude, relative_tolerance: float, floor: float, largest_expected: float):
    return relative_tolerance * (magnitude + largest_expected) + floor


def _finite_and_within(mine, theirs, relative_tolerance: float, floor: float, largest_expected: float) -> bool:
    """Whether a chunk pair is within the tolerance with no NaN or infinity on either side: the common case, in a
    third of the full comparison's passes. A NaN or an infinity fails the strict ``<`` (inf < inf is false), and so
    does an error equal to the allowance: the full comparison decides those."""
    return bool(((mine - theirs).abs() < _allowed(theirs.abs(), relative_tolerance, floor, largest_expected)).all())


def compare(ort: StepResult, reference: StepResult, dtype: torch.dtype, where: dict) -> list:
    """Every tensor of ``ort`` that differs from ``reference``; ``where`` names a tensor's node and module."""
    comparison = Comparison(ort, dtype, where)
    comparison.forward_done(reference.outputs, reference.buffers)
    for name, gradient in reference.gradients.items():
        comparison.gradient(name, gradient)
    return comparison.differences()


class Kept:
    """``torch_step``'s sink that keeps what torch computed (``kept``): every tensor, or with ``like`` only those
    ``like`` (a StepResult) holds."""

    def __init__(self, like: StepResult | None = None):
        self.kept, self._like = StepResult({}, {}, {}), like

    def forward_done(self, outputs: dict, buffers: dict) -> None:
        self.kept.outputs = self._wanted(outputs, "outputs")
        self.kept.buffers = self._wanted(buffers, "buffers")

    def gradient(self, name: str, gradient) -> None:
        if self._like is None or name in self._like.gradients:
            self.kept.gradients[name] = gradient

    def _wanted(self, tensors: dict, kind: str) -> dict:
        return tensors if self._like is None else {name: tensors[name] for name in getattr(self._like, kind) if name in tensors}


class Comparison:
    """ONNX Runtime's step ``ort`` compared with torch's as torch computes it (``torch_step``'s sink): each of torch's
    tensors when it exists, kept (``kept``) only where it differs, for the rounding excuse. A step's outputs can be as
    large as its logits: compared after forward, they are not held through torch's backward, and no second full set
    of gradients exists. The floor of a kind's tolerance follows its largest tensor, which for gradients is known
    only at the end: a gradient within the tolerance at the floor of those seen so far is within it at the final,
    larger floor; the others are kept and decided at the end (``differences``)."""

    def __init__(self, ort: StepResult, dtype: torch.dtype, where: dict):
        self.ort, self.where, self.tolerance = ort, where, _TOLERANCE.get(dtype, 1e-3)
        self.kept = StepResult({}, {}, {})
        self._found = {"output": [], "buffer": []}  # differences found after forward
        self._largest = {}  # kept gradient -> its largest finite magnitude
        self._largest_gradient = 0.0  # of every gradient compared so far

    def forward_done(self, outputs: dict, buffers: dict) -> None:
        for kind, theirs, mine, kept in (("output", outputs, self.ort.outputs, self.kept.outputs),
                                         ("buffer", buffers, self.ort.buffers, self.kept.buffers)):  # fmt: skip
            compared = [name for name in mine if name in theirs and _is_floating(mine[name]) and _is_floating(theirs[name])]
            largest = {name: _largest_finite(theirs[name]) for name in compared}  # one pass over each (logits: 25M values)
            floor = self._floor(max(largest.values(), default=0.0))
            for name in compared:
                difference = _difference(mine[name], theirs[name], self.tolerance, floor, largest[name])
                if difference is not None:
                    self._found[kind].append(self._difference(kind, name, difference, theirs[name]))
                    kept[name] = theirs[name]

    def gradient(self, name: str, gradient) -> None:
        mine = self.ort.gradients.get(name)
        if mine is None or not (_is_floating(mine) and _is_floating(gradient)):
            return
        largest = _largest_finite(gradient)
        self._largest_gradient = max(self._largest_gradient, largest)
        if self._gradient_difference(name, gradient, largest) is not None:
            self.kept.gradients[name], self._largest[name] = gradient, largest

    def differences(self) -> list:
        """The differences found, outputs first; kept gradients within the tolerance at the final floor are dropped."""
        gradients = []
        for name in [name for name in self.ort.gradients if name in self.kept.gradients]:
            difference = self._gradient_difference(name, self.kept.gradients[name], self._largest[name])
            if difference is None:
                del self.kept.gradients[name]
            else:
                gradients.append(self._difference("gradient of", name, difference, self.kept.gradients[name]))
        return self._found["output"] + gradients + self._found["buffer"]

    def _gradient_difference(self, name: str, gradient, largest: float):
        mine = _projected_like(self.ort.gradients[name], gradient)
        return _difference(mine, gradient, self.tolerance, self._floor(self._largest_gradient), largest)

    def _floor(self, largest_of_kind: float) -> float:
        return self.tolerance * 1e-2 * largest_of_kind + 1e-12

    def _difference(self, kind: str, name: str, difference: tuple, theirs) -> Difference:
        return Difference(kind, name, *difference, self.where.get(name, ""), isinstance(theirs, Projected))


def _projected_like(tensor, reference):
    """``tensor`` in the ``Projected`` form where ``reference`` has that form (the reduced check)."""
    return Projected.of(tensor) if isinstance(reference, Projected) and not isinstance(tensor, Projected) else tensor


def _is_floating(value) -> bool:
    return isinstance(value, Projected) or value.is_floating_point()


def _norm_of_difference(actual, expected) -> float:
    """The L2 norm of ``actual - expected`` in float64, a chunk at a time (no float64 copy of a whole tensor)."""
    if isinstance(expected, Projected):
        return _projected_like(actual, expected).distance_to(expected)
    if actual.shape != expected.shape:
        return float("inf")
    square = 0.0
    for mine, theirs in zip(_chunks(actual), _chunks(expected)):
        difference = mine - theirs  # not in place: the chunks of a float64 tensor are views of it
        square += torch.dot(difference, difference).item()
    return square**0.5


_KINDS = (("output", "outputs"), ("gradient of", "gradients"), ("buffer", "buffers"))  # Difference.kind, StepResult field


def rounding_spread(run_torch, weights: dict, reference: StepResult, dtype: torch.dtype) -> dict:
    """{(kind, tensor name): norm} of the tensors ``reference`` holds (those that differed) — _SPREAD_FACTOR times
    the most that torch's own step moves when every float weight is nudged by rounding (relative ``_NUDGE``), over
    ``_NUDGE_TRIALS`` nudges. Of each nudged step only those tensors are kept (``Kept``).

    Where an activation sits within rounding of a kink (a ReLU or max input near its switch
    point), the two sides' different (both valid) rounding can put it on different sides, and
    the gradient through it differs by far more than the tolerance. Nudged weights move such
    activations the same way, so torch differs from itself by a like amount; a wrong gradient
    does not depend on rounding and is not excused. Run only after a first comparison failed.
    """
    generator = torch.Generator().manual_seed(0)
    nudge = _NUDGE.get(dtype, _NUDGE[torch.float32])
    spread = {}
    for _ in range(_NUDGE_TRIALS):
        moved = run_torch(_nudged(weights, nudge, generator), sink=Kept(like=reference))
        for kind, field_name in _KINDS:
            ours = getattr(reference, field_name)
            for name, value in getattr(moved, field_name).items():
                norm = _SPREAD_FACTOR * _norm_of_difference(value, ours[name])
                spread[kind, name] = max(spread.get((kind, name), 0.0), norm)
        del moved  # not held while the next step runs
    return spread


def _nudged(weights: dict, nudge: float, generator) -> dict:
    """``weights`` with every float tensor moved by a relative ``nudge`` times a standard normal draw."""
    return {name: tensor * (1 + nudge * torch.randn(tensor.shape, generator=generator).to(tensor.device, tensor.dtype))
            if tensor.is_floating_point() else tensor for name, tensor in weights.items()}  # fmt: skip


# What a mismatch means, by the step checked.
FIRST_STEP = ("orttrainer's first step differs from torch autograd on the same batch and weights (dropout off on both "
              "sides), so training would not do what torch does")  # fmt: skip
FIRST_EVAL = ("eval_step differs from the module in eval mode on the same batch and weights. The eval graph is the "
              "training graph run in inference mode (dropout off, BatchNorm on its running statistics), as in the legacy "
              "ORTTrainer, so a branch forward takes only when not self.training is not in it; evaluate with the module "
              "itself (model.eval(): it holds the trained weights)")  # fmt: skip


def check(ort: StepResult, run_torch, weights: dict, dtype: torch.dtype, where: dict, mode: str,
          subject=FIRST_STEP) -> None:  # fmt: skip
    """Compare ``ort`` with torch's step on ``weights`` (``run_torch(weights, sink=...)``: ``torch_step`` or
    ``torch_eval``), tensor by tensor as torch computes them (``Comparison``); differences that rounding at a kink
    explains are excused (``rounding_spread``); report the rest under ``subject``."""
    if mode == "off":
        return
    comparison = Comparison(ort, dtype, where)
    run_torch(weights, sink=comparison)
    differences = comparison.differences()
    if differences:
        spread = rounding_spread(run_torch, weights, comparison.kept, dtype)
        differences = [difference for difference in differences if not _excused(difference, ort, comparison.kept, spread)]
    report(differences, mode, subject)


def _excused(difference: Difference, ort: StepResult, reference: StepResult, spread: dict) -> bool:
    """Whether ``difference`` is no larger than what rounding alone moves torch's own result by (``spread``)."""
    field_name = dict(_KINDS)[difference.kind]
    mine, theirs = getattr(ort, field_name)[difference.name], getattr(reference, field_name)[difference.name]
    key = (difference.kind, difference.name)
    return key in spread and _norm_of_difference(mine, theirs) <= spread[key]


def report(differences: list, mode: str, subject=FIRST_STEP) -> None:
    """Raise (mode "error") or warn (mode "warn") about ``differences``, saying first what they mean (``subject``)."""
    if not differences or mode == "off":
        return
    lines = [
        f"{d.kind} '{d.name}'{f' ({d.where})' if d.where else ''}: "
        + (f"L2 distance about {d.largest_absolute:.3g} (by {_PROJECTIONS} random projections), {d.largest_relative:.3g} "
           "of its norm" if d.projected else
           f"largest absolute difference {d.largest_absolute:.3g}, largest relative {d.largest_relative:.3g}")
        for d in differences
    ]  # fmt: skip
    message = subject + ":\n- " + "\n- ".join(lines) + "\n" + _HOW_TO_CHANGE
    if mode == "error":
        raise TorchMismatchError(message)
    warnings.warn(message, stacklevel=3)
