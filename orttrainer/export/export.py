"""torch module + loss function -> the forward+loss ONNX graph.

The exported graph takes the model_desc inputs (the label last when a loss_fn is
given) and returns the loss first, then the model's outputs. It holds no weights: they are
graph inputs named exactly like the keys of the module's ``state_dict()``. The export runs the
user's module itself (the trainer trains its tensors in place) and leaves it as it was.

Everything that would make the graph train something other than the module is either
handled or refused here, before any graph is built: hooks the graph cannot hold, custom
autograd Functions, and every exporter warning that says the trace may differ from the
module (data-dependent control flow, Python values baked in, buffers mutated in place).
Submodules keep the train/eval mode the user gave them (a frozen BatchNorm stays frozen).
"""

import ast
import contextlib
import functools
import io
import linecache
import re
import sys
import warnings
from dataclasses import dataclass

import onnx
import torch
from onnx import numpy_helper
from torch.nn.utils.parametrizations import _SpectralNorm
from torch.nn.utils.spectral_norm import SpectralNorm as _SpectralNormHook
from torch.onnx import TrainingMode
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from . import forward_effects, symbolics
from ..api import model_outputs
from ..graph import rewrites

WRAPPED = "model."  # prefix the wrapper adds to every weight name


class ExportError(ValueError):
    """The module cannot be exported as a graph that trains like it; the message says why and where."""


class _ModelWithLoss(torch.nn.Module):
    """Passes the inputs to ``forward`` by keyword (so that forward's defaults hold for those
    the batch leaves out), with the step's ``constants`` (Python values the trace bakes in), and
    returns the graph's outputs: the loss first, then the model's outputs as tensors
    (model_outputs.flatten; ``form`` says how, after a call)."""

    def __init__(self, model, loss_fn, forward_names, constants):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.forward_names = forward_names
        self.constants = dict(constants or {})
        self.form = None

    def forward(self, *inputs):
        outputs = self.model(**dict(zip(self.forward_names, inputs)), **self.constants)
        loss = None
        if self.loss_fn is not None:
            given = outputs
            if isinstance(outputs, (tuple, list)):  # a 1-tuple is passed as its tensor, a namedtuple as itself
                given = outputs[0] if len(outputs) == 1 else outputs if isinstance(outputs, tuple) else tuple(outputs)
            loss = self.loss_fn(given, inputs[-1])
        tensors, self.form = model_outputs.flatten(outputs, type(self.model).__name__, loss)
        return tuple(tensors)


def with_loss(model, loss_fn, forward_names, constants=None) -> torch.nn.Module:
    """``model`` + ``loss_fn`` as one module taking the graph's inputs and returning its outputs;
    ``constants`` ({name: Python value}) go to forward with the inputs."""
    return _ModelWithLoss(model, loss_fn, forward_names, constants)


def sample_outputs(model, loss_fn, forward_names, inputs, constants=None):
    """Run model (+ loss) once in eval mode without autograd, leaving the module as it was:
    (the graph's outputs, their model_outputs.OutputForm).

    "As it was" includes the attributes forward assigns: NLLB-MoE's router sets its expert capacity in
    eval mode only, and the training graph traced after this run trained with that capacity, other than
    torch, without a word (the check's torch side ran the same changed module). Attributes are restored
    by identity, dicts by their items (a list forward appends to in place is not).
    """
    wrapper = with_loss(model, loss_fn, forward_names, constants)
    attributes = {layer: _attributes_of(layer) for layer in model.modules()}  # the training flags among them
    tensors = forward_effects.module_state(model, loss_fn, attributes=False)
    model.eval()
    try:
        with torch.no_grad(), _DifferentiationRefused():
            outputs = wrapper(*inputs)
        # a clamp makes its change at the first run only; in-place ops the version counter sees the export names
        _refuse_state_changes(tensors, model, loss_fn, unseen_only=True)
        return outputs, wrapper.form
    finally:
        _restore_attributes(attributes)


def _attributes_of(layer: torch.nn.Module) -> dict:
    """{name: (value, a copy of its items if it is a dict)}: what forward can reassign, and the dicts it can fill in
    place (hooks it installs, buffers it registers)."""
    return {name: (value, dict(value) if isinstance(value, dict) else None) for name, value in vars(layer).items()}


def _restore_attributes(saved: dict) -> None:
    """Give each module of ``saved`` ({module: ``_attributes_of`` it as it was}) its attributes back: what was
    reassigned gets its old value, what was added goes, a dict gets its old items. transformers' output capture
    marks its hooks installed in an attribute, the hooks in the module's hook dicts: both go together."""
    for layer, attributes in saved.items():
        current = vars(layer)
        for name in [name for name in current if name not in attributes]:
            del current[name]
        for name, (value, items) in attributes.items():
            if current.get(name, _ABSENT) is not value:
                current[name] = value
            if items is not None and _items_changed(value, items):
                value.clear()
                value.update(items)


def _items_changed(now: dict, then: dict) -> bool:
    return now.keys() != then.keys() or any(now[key] is not item for key, item in then.items())


_ABSENT = object()


# ------------------------------------------------------------------ the module to export
def refuse_unexportable(model: torch.nn.Module) -> None:
    """Refuse, before anything runs, a module whose weights or layers the graph cannot train as torch does."""
    refuse_weight_dtypes(model)
    refuse_untrainable_modules(model)


@contextlib.contextmanager
def as_trained(model: torch.nn.Module, eval_mode: bool = False):
    """``model`` in the modes it trains in during the block (or, with ``eval_mode``, in eval()), and afterwards as it
    was: its modes and the attributes forward assigns or installs (``_restore_attributes``: transformers' output
    capture hooks), and its buffers (``forward_effects.buffers_kept``: forward in training mode moves BatchNorm's
    statistics). The trainer runs the user's module itself, which no export or check may leave changed.

    Submodules the user put in ``eval()`` stay in eval (a frozen BatchNorm keeps its running statistics, as in a
    torch loop). A root module in ``eval()`` is trained in ``train()`` mode throughout, as the legacy ORTTrainer did.
    """
    attributes = {layer: _attributes_of(layer) for layer in model.modules()}  # the training flags among them
    if eval_mode:
        model.eval()
    elif not model.training:
        model.train()
    try:
        with forward_effects.buffers_kept(model):
            yield model
    finally:
        _restore_attributes(attributes)


def _backward_hook_owners(model: torch.nn.Module) -> list:
    owners = []
    if torch.nn.modules.module._global_backward_hooks or torch.nn.modules.module._global_backward_pre_hooks:
        owners.append("a global module backward hook (torch.nn.modules.module.register_module_full_backward_hook)")
    for path, layer in model.named_modules():
        if layer._backward_hooks or layer._backward_pre_hooks:
            owners.append(f"module '{path or type(model).__name__}' ({type(layer).__name__}) has a backward hook")
    for name, parameter in model.named_parameters():
        if parameter._backward_hooks or getattr(parameter, "_post_accumulate_grad_hooks", None):
            owners.append(f"parameter '{name}' has a gradient hook")
    return owners


def refuse_weight_dtypes(model: torch.nn.Module) -> None:
    """Refuse trainable weights that are not float32: onnxruntime-training's gradient builder
    seeds and combines gradients in float32 only, and fails on float64, float16 and bfloat16 weights."""
    others = [f"'{name}' is {parameter.dtype}" for name, parameter in model.named_parameters()
              if parameter.requires_grad and parameter.dtype != torch.float32]
    if others:
        shown = ", ".join(others[:3]) + (f" (and {len(others) - 3} more)" if len(others) > 3 else "")
        raise TypeError(
            f"trainable weights must be float32, and {shown} (ONNX Runtime's gradient builder makes float32 "
            "gradients only); convert the module with model.float(), and for float16 compute keep float32 weights "
            "and set mixed_precision.enabled"
        )


def refuse_untrainable_modules(model: torch.nn.Module) -> None:
    """Refuse, by inspecting the module, what the ONNX graph would silently drop."""
    problems = [f"{owner}: ONNX Runtime computes the gradients, so it would never run" for owner in _backward_hook_owners(model)]
    scripted = []  # path prefixes of the torch.jit.script modules found
    for path, layer in model.named_modules():
        trains = layer.training or not model.training  # a root in eval() is trained in train() mode (as_trained)
        if isinstance(layer, torch.nn.modules.batchnorm._BatchNorm) and layer.track_running_stats and layer.momentum is None \
                and trains:  # fmt: skip
            raise NotImplementedError(
                f"module '{path}' ({type(layer).__name__}) uses momentum=None (cumulative average); set a momentum"
            )
        if isinstance(layer, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and layer.max_norm is not None:
            problems.append(
                f"module '{path}' ({type(layer).__name__}) has max_norm={layer.max_norm}: torch renormalises rows in place "
                "during forward, which an ONNX graph cannot do; remove max_norm (or renormalise the weight yourself "
                "between steps)"
            )
        if isinstance(layer, torch.jit.ScriptModule) and not any(path.startswith(outer) for outer in scripted):
            scripted.append(f"{path}." if path else "")  # its submodules are scripted with it
            problems.append(
                f"module '{path or getattr(layer, 'original_name', 'model')}' is a torch.jit.script module, which torch's exporter cannot "
                "trace as part of a model: give the trainer the plain module (before torch.jit.script)"
            )
        if isinstance(layer, torch.nn.modules.lazy.LazyModuleMixin) and layer.has_uninitialized_params():
            problems.append(
                f"module '{path}' ({type(layer).__name__}) creates its parameters at its first forward: run the model once "
                "on a batch before creating the trainer, so that the trainer starts from your module's weights"
            )
        if _spectral_norm_updates(layer):
            owner = path.rsplit("parametrizations.", 1)[0].rstrip(".") if isinstance(layer, _SpectralNorm) else path
            problems.append(
                f"module '{owner}' ({type(model.get_submodule(owner)).__name__}) has spectral_norm: in training mode torch's "
                "power iteration updates its u and v vectors in place at every forward, which an ONNX graph cannot do; "
                "remove spectral_norm or train this model with torch"
            )
    if problems:
        raise ExportError("cannot train this model the way torch would:\n- " + "\n- ".join(problems))


def _spectral_norm_updates(layer: torch.nn.Module) -> bool:
    """Whether forward runs spectral_norm's power iteration on ``layer`` (the parametrization, or the older hook)."""
    if isinstance(layer, _SpectralNorm):
        return layer.training and layer.n_power_iterations > 0
    return layer.training and any(isinstance(hook, _SpectralNormHook) for hook in layer._forward_pre_hooks.values())


class _DifferentiationRefused(TorchFunctionMode):
    """Refuses ``torch.autograd.grad`` and ``Tensor.backward`` inside forward or the loss (a gradient
    penalty): the exporter cannot trace a derivative, and the training graph is the gradient of
    forward + loss as a whole."""

    _NAMES = {torch.autograd.grad: "torch.autograd.grad", torch.Tensor.backward: "Tensor.backward"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self._NAMES:
            raise ExportError(
                f"forward or the loss function differentiates ({self._NAMES[func]} at "
                f"{forward_effects.user_location()}): ONNX Runtime trains with one gradient graph of forward + loss, which cannot "
                "hold a derivative taken inside them; train this model with torch"
            )
        return func(*args, **(kwargs or {}))


class _HookAndFunctionSpy(TorchFunctionMode):
    """Records ``Tensor.register_hook`` calls made while forward runs."""

    def __init__(self):
        super().__init__()
        self.hooks = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook):
            self.hooks.append(forward_effects.user_location())
        return func(*args, **(kwargs or {}))


def _unreachable_backward(_):
    raise RuntimeError("this forward ran only to be traced or inspected; orttrainer kept none of its activations")


def keeping_no_activations():
    """Autograd keeps none of the activations of a forward run only to be traced or inspected (it is never
    differentiated): GPT-2 of the benchmarks exports with 300 MB less. Grad mode, and every branch that
    reads it, stays as in training."""
    return torch.autograd.graph.saved_tensors_hooks(lambda tensor: None, _unreachable_backward)


# Custom autograd Functions whose hand-written backward is the gradient of their forward (checked at edge values
# by tests/test_same_as_torch.py against autograd of the forward): exported as their forward, they train as torch.
GRADIENT_OF_THEIR_FORWARD = {
    "transformers.models.bloom.modeling_bloom.GeLUFunction",  # BLOOM's tanh GELU, always through this Function
}


class _Context:
    """What a custom Function's forward may call on its ctx, doing nothing (``_functions_as_their_forward``)."""

    def save_for_backward(self, *tensors):
        pass

    def mark_non_differentiable(self, *tensors):
        pass


@contextlib.contextmanager
def _functions_as_their_forward():
    """The ``GRADIENT_OF_THEIR_FORWARD`` Functions of the modules loaded, applied as their forward with autograd on:
    a Function's forward runs without autograd, which ``_NoGradResultsDetached`` would record as detaches."""
    patched = []
    for name in GRADIENT_OF_THEIR_FORWARD:
        module_name, _, qualname = name.rpartition(".")
        function = getattr(sys.modules.get(module_name), qualname, None)
        if function is not None:
            patched.append((function, function.__dict__.get("apply")))
            function.apply = staticmethod(functools.partial(function.forward, _Context()))
    try:
        yield
    finally:
        for function, apply in patched:
            if apply is None:
                del function.apply
            else:
                function.apply = apply


def _custom_functions(output) -> list:
    """Names of the custom torch.autograd.Functions in the autograd graph of ``output``, but those in
    ``GRADIENT_OF_THEIR_FORWARD``."""
    seen, found, stack = set(), [], [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            function = node._forward_cls
            name = f"{function.__module__}.{function.__qualname__}"
            if name not in found and name not in GRADIENT_OF_THEIR_FORWARD:
                found.append(name)
        stack.extend(child for child, _ in node.next_functions)
    return found


def _refuse_custom_backward(loss, hooks: list) -> None:
    """Refuse what carries a hand-written backward in the traced forward + loss (``loss``, ``hooks``: where forward
    registered a tensor hook, ``_HookAndFunctionSpy``).

    A custom ``torch.autograd.Function`` is exported as its forward ops, so its backward
    (a straight-through estimator, a gradient reversal) would be replaced by the
    gradient of those ops; a hook registered on a tensor inside forward would never run.
    """
    problems = [f"tensor.register_hook at {where}: ONNX Runtime computes the gradients, so the hook would never run"
                for where in hooks]  # fmt: skip
    functions = _custom_functions(loss) if isinstance(loss, torch.Tensor) else []
    problems += [f"custom torch.autograd.Function {name}: its backward would be replaced by the gradient of the ops "
                 "in its forward" for name in functions]  # fmt: skip
    if problems:
        raise ExportError(
            "cannot train this model the way torch would:\n- " + "\n- ".join(problems) + "\nTrain it with plain torch, "
            "or express the computation with standard differentiable ops."
        )


@contextlib.contextmanager
def _one_value_per_channel_explained():
    """torch's refusal of a BatchNorm over one value per channel, saying why the trainer runs into it."""
    try:
        yield
    except ValueError as error:
        if not str(error).startswith("Expected more than 1 value per channel when training"):
            raise
        raise ExportError(
            f"{error}: the trainer builds the graphs of a batch's shapes, eval_step's too, from forward in training "
            "mode, where BatchNorm needs more than one value per channel; use batches of two or more (to evaluate a "
            "single sample, use the module itself in eval(), which holds the trained weights)"
        ) from error


# ----------------------------------------------------------------- exporter warnings
@dataclass
class _Heard:
    """One exporter warning and the user's line that was running when it was raised."""

    category: type
    message: str
    filename: str
    lineno: int
    where: str

    def describe(self) -> str:
        """The user's line, and the line inside torch that raised the warning if it is another."""
        if self.where.startswith(f"{self.filename}:{self.lineno}"):
            return self.where
        return f"{self.where} (inside: {self.filename}:{self.lineno}: {linecache.getline(self.filename, self.lineno).strip()})"


# Exporter warnings that do not mean the graph differs from the module, each with why.
_HARMLESS = [
    # orttrainer chooses the TorchScript exporter deliberately (docs/stack_facts.md)
    (DeprecationWarning, r"You are using the legacy TorchScript-based ONNX export"),
    # torch's exporter calling one of its own deprecated helpers
    (DeprecationWarning, r"The feature will be removed\. Please remove usage of this function"),
    # symbolics.indexing.index turns negative indices into positive ones before torch's formula
    (UserWarning, r"Exporting aten::index operator of advanced indexing .* If indices include negative values"),
    # an optimisation of the exporter's skipped: the graph computes the same
    (UserWarning, r"Constant folding - Only steps=1 can be constant folded"),
    # a recurrent layer's initial state sized by the sample batch: graph_cache exports again at every
    # new shape signature and builds another graph when the trace differs
    (UserWarning, r"Exporting a model to ONNX with a batch_size other than 1, with a variable length with"),
    # len(tensor), a size of the sample batch (CLIP's contrastive loss, arange(len(logits))): likewise
    (torch.jit.TracerWarning, r"Using len to get tensor shape might cause the trace to be incorrect"),
    # BatchNorm's batch counter: the trainer counts batches itself
    (UserWarning, r"Removing mutation from node aten::add_ on block input: '[^']*num_batches_tracked'"),
]

# The exporter turned an in-place op on a graph input into a copy: a buffer (the module's state) or a
# tensor of the batch (the name of forward's argument, or a tensor made from it, e.g. by zeros_like).
_MUTATION = r"Removing mutation from node (\S+) on block input: '([^']*?)(\.\d+)?'"

# Exporter warnings that mean the graph may differ from the module: (pattern, why and what to do).
_DIFFERENT = [
    (r"ONNX export of embedding with padding_idx",
     "the padding row would be trained; use nn.Embedding/F.embedding, whose padding_idx orttrainer handles"),
    (r"(?i)dropout",
     "the exporter changes or drops a dropout; check the layer's dropout arguments"),
]  # fmt: skip

# Exporter warnings that a value of the batch became a constant (a Python number, or the branch
# a Python `if` took): harmless when it comes from the batch's shapes or a fixed width, wrong when
# it comes from the data (``int(mask.sum())``, ``if x.sum() > 0``). The graph then serves only
# its own shape signature, and the first batch of that signature with other values is exported
# again to show that the constants do not depend on them (graph_cache.py).
_FROM_VALUES = ("a Python value (an `if`, int(), float(), .item()) computed from the values of the batch or the "
                "weights: the trace keeps what the first batch gave, for every batch; use tensor ops (torch.where, masks) "
                "or train this model with torch")
_FROM_RANDOM = ("a Python value (an `if`, int(), float(), .item()) computed from a random draw (torch.rand: LayerDrop, "
                "a random skip of a layer): the trace keeps the first draw, so every step would take the same branch; "
                "draw with tensor ops (torch.where on the draw), or turn the random skip off (transformers: "
                "config.layerdrop, encoder_layerdrop, decoder_layerdrop = 0.0)")  # fmt: skip
_CONSTANT_TENSOR = r"torch\.tensor results are registered as constants"
_FROZEN_VALUE = (rf"Converting a tensor to a (Python (integer|float|number|index|boolean)|NumPy array)|Iterating over a tensor|"
                 rf"{_CONSTANT_TENSOR}")  # fmt: skip


def _only_complains(statements) -> bool:
    """True when every path through ``statements`` just raises or warns."""
    for statement in statements:
        if isinstance(statement, ast.Raise):
            continue
        if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call):
            function = statement.value.func
            if (function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")) == "warn":
                continue
        if isinstance(statement, ast.If) and _only_complains(statement.body) and _only_complains(statement.orelse):
            continue
        return False
    return True


@functools.lru_cache(maxsize=64)
def _statements_by_line(filename: str) -> dict:
    try:
        tree = ast.parse("".join(linecache.getlines(filename)))
    except (SyntaxError, ValueError):
        return {}
    return {node.lineno: node for node in ast.walk(tree) if isinstance(node, (ast.If, ast.Assert))}


def _is_argument_check(filename: str, lineno: int) -> bool:
    """True when the line is an ``assert``, or an ``if`` whose block only raises or warns.

    Such a check only decides whether to complain (torch's own shape checks in attention,
    losses and normalisation, a user's ``assert``): freezing it changes no value the graph
    computes. The check that matters at run time, batch norm's more than one value per
    channel, the trainer repeats on every step.
    """
    statement = _statements_by_line(filename).get(lineno)
    if isinstance(statement, ast.Assert):
        return True
    return isinstance(statement, ast.If) and not statement.orelse and _only_complains(statement.body)


def _is_harmless(heard: _Heard) -> bool:
    if heard.category.__name__ == "TracerWarning" and _is_argument_check(heard.filename, heard.lineno):
        return True
    return any(issubclass(heard.category, category) and re.search(pattern, heard.message) for category, pattern in _HARMLESS)


def _mutation_problem(found: re.Match, state_names, changed_state, changed_inputs):
    """Why the in-place op of a ``_MUTATION`` warning (``found``), which the exporter turned into a copy, makes
    the graph differ, or None (harmless: it changed a tensor made from the batch, not the batch or the
    module's state). The exporter names the values of ``tensor[mask] = value`` as the input an ``index_put_``
    changes when they are a weight (Wav2Vec2's masked_spec_embed): a weight the trace left unchanged is not taken
    for changed there."""
    op, target = found.group(1), found.group(2)
    if target in state_names and (target in changed_state or op != "aten::index_put_"):
        return (f"forward changes the buffer '{target[len(WRAPPED):]}' in place ({op}), and the graph cannot: torch would "
                "update it every step, orttrainer never")
    if changed_inputs:
        return (f"forward changes its input {', '.join(repr(name) for name in changed_inputs)} in place ({op}): "
                "torch's caller sees the change, the graph cannot make it; work on a copy (x = x * 2, not x.mul_(2))")
    return None


def _reason_graph_differs(heard: _Heard):
    for pattern, reason in _DIFFERENT:
        if re.search(pattern, heard.message):
            return reason
    return None


_SHAPE_OPS = ("aten::size", "aten::numel", "aten::dim", "onnx::Shape", "prim::shape")
_TO_PYTHON = (torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__,
              torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__)  # fmt: skip


# Traced ops that draw random numbers: a Python value computed from one (LayerDrop's ``torch.rand([]) < p``) is a
# draw the trace keeps for every step.
_RANDOM_OPS = frozenset(f"aten::{name}" for name in (
    "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm", "bernoulli", "bernoulli_",
    "normal", "normal_", "uniform_", "multinomial", "exponential_", "geometric_", "cauchy_", "log_normal_", "random_",
    "poisson"))  # fmt: skip


def _frozen_from(value):
    """Why the trace must not freeze the traced ``value`` as a Python value: ``_FROM_RANDOM`` when it depends on a
    random draw, ``_FROM_VALUES`` when on the values of a graph input (batch or weights), not only on shapes (some path
    from it back to an input avoids the size ops); None when it depends on shapes alone."""
    seen, pending, found = set(), [value], None
    while pending:
        value = pending.pop()
        if value.unique() in seen:
            continue
        seen.add(value.unique())
        node = value.node()
        if node.kind() in _RANDOM_OPS:
            return _FROM_RANDOM
        if node.kind() == "prim::Param":
            found = _FROM_VALUES
        elif node.kind() not in _SHAPE_OPS:
            pending.extend(node.inputs())
    return found


def _holds_no_values(data) -> bool:
    """Whether ``torch.tensor(data)`` is empty: a (nested) sequence without elements."""
    return isinstance(data, (list, tuple)) and all(_holds_no_values(item) for item in data)


class _ValuesTurnedPython(TorchFunctionMode):
    """Notes where the traced code turns a tensor that depends on the batch's or the weights'
    values into a Python value (an ``if`` on it, ``int(...)``): the trace freezes that value,
    which differs from batch to batch. One computed from shapes alone is the same for every
    batch of the graph's shape signature."""

    def __init__(self):
        super().__init__()
        self.from_values = {}  # user location (``forward_effects.user_location``) -> why its value must not be frozen (``_frozen_from``)
        self.making_empty_tensor = False  # a torch.tensor of no values is under way (``_holds_no_values``)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.tensor and args and _holds_no_values(args[0]):
            self.making_empty_tensor = True
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self.making_empty_tensor = False
        if func not in _TO_PYTHON or torch._C._get_tracing_state() is None:
            return func(*args, **(kwargs or {}))
        try:
            traced = torch._C._get_value_trace(args[0])
        except RuntimeError:  # not traced: a constant of the forward
            traced = None
        why = None if traced is None else _frozen_from(traced)
        if why is not None:
            self.from_values.setdefault(forward_effects.user_location(), why)
        return func(*args, **(kwargs or {}))

    @staticmethod
    def caller():
        """(file, line) that called the torch function under way, or None outside this mode: torch's
        warnings name this module's line, since every torch call of the traced code passes here."""
        frame = sys._getframe(1)
        while frame is not None and frame.f_code is not _ValuesTurnedPython.__torch_function__.__code__:
            frame = frame.f_back
        return None if frame is None else (frame.f_back.f_code.co_filename, frame.f_back.f_lineno)


class _NoGradResultsDetached(TorchFunctionMode):
    """Detaches, in the trace, what forward computes under ``torch.no_grad()`` from tensors that require grad.

    torch gives such a result no gradient; a trace records no grad mode, so ONNX Runtime would differentiate
    through it. The detach is recorded and cut as a user's ``detach()`` is (``symbolics.elementwise.detach``). In-place
    ops are left as they are: their result is the tensor they changed.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if torch.is_grad_enabled() or torch._C._get_tracing_state() is None or _changes_in_place(func):
            return result
        if not any(isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in pytree.tree_leaves((args, kwargs))):
            return result
        return pytree.tree_map(lambda leaf: leaf.detach() if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()
                               else leaf, result)  # fmt: skip


def _changes_in_place(func) -> bool:
    """``Tensor.add_``, ``Tensor.__iadd__``, ``Tensor.__setitem__`` and the like."""
    name = getattr(func, "__name__", "")
    return name == "__setitem__" or name.startswith("__i") or (name.endswith("_") and not name.endswith("__"))


class _ExporterWarnings:
    """Hears every warning raised during export, with the user's line that caused it.

    On exit: warnings that mean the graph may differ from the module become one
    ExportError naming each source line and the fix; harmless ones (``_HARMLESS``, one by
    one, with the reason) are dropped; all others reach the user unchanged.
    """

    def __init__(self, values: _ValuesTurnedPython, inputs: dict, state: dict):
        self.values, self.inputs, self.state = values, inputs, state

    def __enter__(self):
        self.heard = []
        self._versions = {name: tensor._version for name, tensor in {**self.inputs, **self.state}.items()}
        self._catcher = warnings.catch_warnings()
        self._catcher.__enter__()
        warnings.simplefilter("always")  # every occurrence, not once per location: each may name another line
        warnings.showwarning = self._hear
        return self

    def _hear(self, message, category, filename, lineno, file=None, line=None):
        if self.values.making_empty_tensor and re.search(_CONSTANT_TENSOR, str(message)):
            return  # an empty tensor holds no value of the batch (transformers' DynamicCache makes two per layer)
        if filename.startswith(forward_effects.ORTTRAINER_DIRECTORY):
            filename, lineno = _ValuesTurnedPython.caller() or (filename, lineno)
        self.heard.append(_Heard(category, str(message), filename, lineno, forward_effects.user_location()))

    def __exit__(self, *exc_info):
        self._catcher.__exit__(*exc_info)
        if exc_info[0] is not None:
            return False
        problems, self.frozen_values = [], []
        changed = [name for name, tensor in self.inputs.items() if tensor._version != self._versions[name]]
        changed_state = {name for name, tensor in self.state.items() if tensor._version != self._versions[name]}
        for heard in self.heard:
            if _is_harmless(heard):
                continue
            mutation = re.search(_MUTATION, heard.message)
            if mutation is not None:
                reason = _mutation_problem(mutation, self.state, changed_state, changed)
                if reason is not None and f"{heard.describe()}: {reason}" not in problems:
                    problems.append(f"{heard.describe()}: {reason}")
                continue
            if re.search(_FROZEN_VALUE, heard.message) and heard.where in self.values.from_values:
                problem = f"{heard.describe()}: {self.values.from_values[heard.where]}"
                problems += [problem] if problem not in problems else []
                continue
            if re.search(_FROZEN_VALUE, heard.message):
                self.frozen_values += [heard.describe()] if heard.describe() not in self.frozen_values else []
                continue
            reason = _reason_graph_differs(heard)
            if reason is None:
                warnings.warn_explicit(heard.message, heard.category, heard.filename, heard.lineno)
            elif f"{heard.describe()}: {reason}" not in problems:
                problems.append(f"{heard.describe()}: {reason}")
        if problems:
            raise ExportError(
                "the exported graph would not train like the module:\n- " + "\n- ".join(problems)
            )
        return False


# -------------------------------------------------------------------------- export
@dataclass(frozen=True)
class EmbeddingLookup:
    """What torch's embedding does to the gradient of one lookup beyond a plain gather."""

    padding_idx: int  # -1: none; else this row gets no gradient from this lookup
    scale_grad_by_freq: bool  # each row's gradient divided by how often the batch looks it up


def _dynamic_axes(entries):
    return {name: {index: dim for index, dim in enumerate(shape) if isinstance(dim, str)} for name, shape in entries}


def _loss_tensors_as_constants(model: onnx.ModelProto, wrapper) -> None:
    """The loss module's own tensors (``CrossEntropyLoss(weight=...)``'s class weights) as initializers holding their
    values: the trainer trains and binds the module's tensors only, and the loss's are constants of the graph (a
    change to them after the first step is refused, module_edits)."""
    loss_state = {name: tensor for name, tensor in wrapper.state_dict().items() if not name.startswith(WRAPPED)}
    constants = [graph_input for graph_input in model.graph.input if graph_input.name in loss_state]
    for graph_input in constants:
        model.graph.input.remove(graph_input)
        value = loss_state[graph_input.name].detach().cpu().numpy()
        model.graph.initializer.append(numpy_helper.from_array(value, graph_input.name))


def _strip_wrapper_prefix(model: onnx.ModelProto) -> None:
    """Rename ``model.<key>`` initializers (and their uses) to the torch state_dict key."""
    renames = {tensor.name: tensor.name[len(WRAPPED) :] for tensor in list(model.graph.initializer) + list(model.graph.input)
               if tensor.name.startswith(WRAPPED)}  # fmt: skip
    for initializer in model.graph.initializer:
        initializer.name = renames.get(initializer.name, initializer.name)
    for node in model.graph.node:
        for index, name in enumerate(node.input):
            if name in renames:
                node.input[index] = renames[name]
    for graph_input in model.graph.input:
        graph_input.name = renames.get(graph_input.name, graph_input.name)


def resolve_markers(model: onnx.ModelProto) -> dict:
    """Resolve the marker nodes ``symbolics`` wrote; return {Gather node name: EmbeddingLookup}.

    An embedding's marker on the gather indices is removed, its rules returned. A hardtanh marker
    becomes the Clip it stands for, marked ``rewrites.ZERO_GRADIENT_AT_BOUNDS``; a detach
    marker an Identity marked ``rewrites.STOP_GRADIENT``.
    """
    markers = {node.output[0]: node for node in model.graph.node if node.domain == symbolics.DOMAIN}
    lookups = {}
    for node in model.graph.node:
        if node.op_type == "Gather" and node.input[1] in markers:
            marker = markers[node.input[1]]
            attributes = {attribute.name: attribute.i for attribute in marker.attribute}
            lookups[node.name] = EmbeddingLookup(attributes["padding_idx"], bool(attributes["scale_grad_by_freq"]))
            node.input[1] = marker.input[0]
    for marker in markers.values():
        if marker.op_type == "HardTanh":
            marker.op_type, marker.domain, marker.doc_string = "Clip", "", rewrites.ZERO_GRADIENT_AT_BOUNDS
        elif marker.op_type == "Detach":
            marker.op_type, marker.domain, marker.doc_string = "Identity", "", rewrites.STOP_GRADIENT
    kept = [node for node in model.graph.node if node.domain != symbolics.DOMAIN]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    domains = [entry for entry in model.opset_import if entry.domain != symbolics.DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(domains)
    return lookups


def _refuse_draws_outside_torch(before: tuple, model, call, inputs, devices, serialized: bytes, export_again) -> None:
    """Refuses a forward (or loss) that drew from Python's random module or numpy's global generator while traced,
    unless the graph (``serialized``) is the same with every draw forced to either end of its range
    (``forward_effects.draws_decide_nothing``; ``export_again()`` exports once more).

    The trace cannot see such a draw: it keeps the first one's result as a constant, so every step would reuse it
    (older transformers drew LayerDrop with ``random.uniform``; Wav2Vec2's SpecAugment draws its masks with numpy)."""
    drawn = forward_effects.generators_drawn(before, forward_effects.generator_states())
    if not drawn or forward_effects.draws_decide_nothing(serialized, export_again, call.model):
        return
    locations = forward_effects.draw_locations(call, inputs, devices) or [
        "no line drew when forward ran again under a tracer: the draw depends on something forward changed, or "
        "another thread of the program drew from the generator during the export"]
    raise ExportError(
        f"{type(model).__name__}'s forward or loss draws from {' and '.join(drawn)} at:\n- " + "\n- ".join(locations)
        + "\nThe trace cannot see such a draw: it keeps the first draw as a constant, so every step would reuse it (a "
        "layer skipped always or never, the same mask on every batch) where torch draws anew each step. Draw with torch "
        "and keep the draw in tensor ops (a mask from torch.rand), turn the random behaviour off (transformers: "
        "config.layerdrop, mask_time_prob, mask_feature_prob = 0.0), or train this model with torch."
    )


def _refuse_state_changes(before: dict, model, loss_fn, unseen_only=False) -> None:
    """Refuses a forward that changed its modules' state in a way the graph cannot: torch carries the change into
    the next step (a counter that later takes a branch, a buffer's running value, a clamped weight), the graph
    starts every step from the state it was traced with. ``unseen_only``: see ``forward_effects.state_changes``."""
    changes = forward_effects.state_changes(before, model, loss_fn, unseen_only)
    if changes:
        raise ExportError(
            f"{type(model).__name__}'s forward or loss changes its own state, which the graph cannot: torch would carry "
            "the change into the next step, the graph starts every step from the state of the first:\n- "
            + "\n- ".join(changes)
            + "\nKeep such state out of forward (update it in the training loop, between steps), or train this model "
            "with torch."
        )


def export_to_onnx(model, inputs, loss_fn, forward_names, desc_inputs, desc_outputs, opset: int, constants=None,
                   loss_index=None):  # fmt: skip
    """Export ``model`` (+ ``loss_fn``) in the modes it trains in, names and dynamic axes from model_desc.

    ``model`` is in the modes it trains in (:func:`as_trained`); ``desc_inputs``/``desc_outputs`` are
    (name, shape) pairs, string dims become dynamic. The global torch RNG is left as it
    was (tracing runs dropout once). The module's weights and buffers are graph inputs of
    their type and shape, named by their state_dict keys, never initializers: their data
    stays in torch memory, so no model is too large for one protobuf (2 GiB) and none is
    serialized (docs/stack_facts.md). ``constants`` go to forward as they are, so the graph
    holds what they chose. With ``loss_index`` (the loss among the outputs), what carries a
    hand-written backward is refused (``_WeightsAsInputs``).
    Returns the ModelProto, {Gather node: EmbeddingLookup} and the locations where the trace
    froze a value of this batch (see ``_FROZEN_VALUE``).
    """
    wrapper = with_loss(model, loss_fn, forward_names, constants)
    devices = [inputs[0].device.index or 0] if inputs and inputs[0].is_cuda else []
    states_before = forward_effects.generator_states()

    def export_once():
        return _traced_export(model, wrapper, inputs, desc_inputs, desc_outputs, opset, devices, loss_index)

    serialized, heard, module_state_before = _export_from_the_state_of_a_first_call(model, loss_fn, export_once)
    mismatch = _outputs_differing_by_mode(model, wrapper, desc_outputs)
    if mismatch:
        raise mismatch
    _refuse_state_changes(module_state_before, model, loss_fn)  # first: the draws' exports put the tensors back
    _refuse_draws_outside_torch(states_before, model, wrapper, inputs, devices, serialized, export_once)
    exported = onnx.load_from_string(serialized)
    _loss_tensors_as_constants(exported, wrapper)
    _strip_wrapper_prefix(exported)
    lookups = resolve_markers(exported)
    rewrites.torch_pools(exported)  # first: torch's pools can make fewer windows than ONNX's, whose sizes folding reads
    rewrites.fold_static_sizes(exported, _module_tensor_names(model))
    return exported, lookups, heard.frozen_values


def _export_from_the_state_of_a_first_call(model, loss_fn, export_once):
    """``export_once()`` (serialized, heard) and the module's state it started from (``forward_effects.module_state``).

    A forward may set state at its first call in training mode and keep it (a cache filled, a flag set): the graph
    is traced from that state, as a forward run before the trace left it (buffers put back, as ``as_trained``
    does). So an export that changed the module's state, failing or not, is done again from the state it left, and
    the second export must change nothing (``_refuse_state_changes``)."""
    before = forward_effects.module_state(model, loss_fn)
    with forward_effects.buffers_kept(model):
        try:
            serialized, heard = export_once()
            failed = None
        except ExportError as error:
            failed = error
        changed = forward_effects.state_changes(before, model, loss_fn, unseen_only=False)
    if not changed and failed is not None:
        raise failed
    if not changed:
        return serialized, heard, before
    before = forward_effects.module_state(model, loss_fn)
    return (*export_once(), before)


class _WeightsAsInputs(torch.nn.Module):
    """``wrapper`` (a ``_ModelWithLoss``) traced with its weights and buffers (each tensor once, under its first
    state_dict name: tied weights are one input) as inputs of the trace, after the batch's ``count`` inputs.

    The module's own tensors are passed, so forward reads them as it always does and the tracer, which knows each
    tensor it was given, records every use as a use of that input. Not a parameter of the traced module: the
    TorchScript exporter gives a traced module's parameters by value to its ONNX shape inference, whose time then
    grows with the weights (GPT-2 small: 3 s of its 6 s; docs/stack_facts.md); inputs it leaves alone. Each input is named as the
    exporter names a parameter (the state_dict key), which its warnings quote (``_MUTATION``).

    With a ``loss_index``, what carries a hand-written backward is refused as soon as forward + loss have run
    (``_refuse_custom_backward``), before the exporter converts or complains: the trace is the forward that shows it.
    """

    def __init__(self, wrapper, count: int, loss_index=None):
        super().__init__()
        vars(self)["wrapper"] = wrapper  # not a submodule: its tensors would be the traced module's parameters
        self.count, self.loss_index = count, loss_index
        self.spy = _HookAndFunctionSpy()  # entered around the export, beneath _ValuesTurnedPython (which names lines)
        self.weights, seen = {}, set()
        for name, tensor in wrapper.state_dict(keep_vars=True).items():
            if isinstance(tensor, torch.Tensor) and id(tensor) not in seen:
                self.weights[name] = tensor
                seen.add(id(tensor))

    def forward(self, *inputs):
        for name, tensor in zip(self.weights, inputs[self.count :]):
            torch._C._get_value_trace(tensor).setDebugName(name)
        scopes, scope_of = torch.jit._trace._trace_module_map, torch._C._jit_onnx_create_full_scope_name
        if scopes is not None:
            scopes.update({layer: scope_of(torch.typename(type(layer)), _scope_name(name))
                           for name, layer in self.wrapper.named_modules() if layer is not self.wrapper})
        with _one_value_per_channel_explained():
            outputs = self.wrapper(*inputs[: self.count])
        if self.loss_index is not None:
            _refuse_custom_backward(outputs[self.loss_index], self.spy.hooks)
        return outputs


def _scope_name(path: str) -> str:
    """A submodule's name in the exporter's node names, as it names the submodules of the module it traces: the
    path from its last atom that is not a number (``model.h.0`` -> ``h.0``)."""
    atoms = path.split(".")
    last = max((index for index, atom in enumerate(atoms) if not atom.isnumeric()), default=0)
    return ".".join(atoms[last:])


def _traced_export(model, wrapper, inputs, desc_inputs, desc_outputs, opset, devices, loss_index=None):
    """One ``torch.onnx.export`` of ``wrapper`` (orttrainer's symbolics registered, exporter warnings heard; with
    ``loss_index``, custom backwards refused: ``_WeightsAsInputs``): the serialized model and the
    ``_ExporterWarnings`` that heard it."""
    buffer = io.BytesIO()
    try:
        values = _ValuesTurnedPython()
        inputs_by_name = {name: tensor for (name, _), tensor in zip(desc_inputs, inputs)}
        state = {WRAPPED + name: tensor for name, tensor in model.state_dict().items()}
        # autograd on whatever the caller's mode (an eval_step under torch.no_grad() builds a graph that trains)
        traced = _WeightsAsInputs(wrapper, len(inputs), loss_index)
        with torch.random.fork_rng(devices=devices), symbolics.exporting(), torch.enable_grad(), \
                keeping_no_activations(), _ExporterWarnings(values, inputs_by_name, state) as heard, traced.spy, \
                _functions_as_their_forward(), _NoGradResultsDetached(), values:
            torch.onnx.export(
                traced,
                (*inputs, *traced.weights.values()),
                buffer,
                dynamo=False,
                training=TrainingMode.PRESERVE,
                do_constant_folding=False,
                export_params=False,  # the weights are graph inputs: export_to_onnx
                opset_version=opset,
                input_names=[name for name, _ in desc_inputs] + list(traced.weights),
                output_names=[name for name, _ in desc_outputs],
                dynamic_axes=_dynamic_axes(list(desc_inputs) + list(desc_outputs)),
            )
    except ExportError:
        raise
    except Exception as error:
        # torch's own check of the output names comes first where the modes differ: say that, not what it says
        mismatch = _outputs_differing_by_mode(model, wrapper, desc_outputs)
        first_line = str(error).strip().split("\n", 1)[0]  # the rest is a dump of the traced graph: in the cause below
        failed = ExportError(f"torch.onnx.export of {type(model).__name__} failed: {first_line}{_known_fix(model, first_line)}")
        raise mismatch or failed from error
    return buffer.getvalue(), heard


def _known_fix(model, message: str) -> str:
    """What to do about an export failure orttrainer knows the cause of, or ''."""
    config = getattr(model, "config", None)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if "aten::histc" in message and experts and hasattr(model, "set_experts_implementation"):
        return (". transformers' mixture-of-experts layers count each expert's tokens with torch.histc in their default "
                "experts implementation, which does not export: call model.set_experts_implementation('batched_mm') "
                "before creating the trainer (the same experts, computed for every token and weighted by the routing)")
    if "unordered_map::at" in message:
        return (". torch's exporter fails this way on torch.utils.checkpoint(..., use_reentrant=True) in forward: pass "
                "use_reentrant=False (the gradients are the same; orttrainer trains the forward as if not checkpointed)")
    if "vector::_M_range_check" in message and any(isinstance(layer, torch.nn.RNNBase) for layer in model.modules()):
        return (". torch's exporter fails this way on nn.utils.rnn.pack_padded_sequence (a PackedSequence given to an "
                "LSTM, GRU or RNN): give the layer the padded batch instead and read each sequence's output at its last "
                "real step (states[torch.arange(batch), lengths - 1], the same values for a one-directional layer over "
                "right-padded sequences), or train this model with torch")
    return ""


def _outputs_differing_by_mode(model, wrapper, desc_outputs):
    """An ExportError if the traced forward returned another number of outputs than the eval-mode run or
    model_desc named (names are given by position; XLNet returns its memories in eval mode only), else None."""
    if wrapper.form is None or len(wrapper.form.names) == len(desc_outputs):
        return None
    return ExportError(
        f"{type(model).__name__} returns {wrapper.form.names} in training mode but "
        f"{[name for name, _ in desc_outputs]} in eval mode or model_desc: return the same outputs in both modes"
    )


def _module_tensor_names(model: torch.nn.Module) -> set:
    """The names of ``model``'s parameters and buffers, persistent or not: the graph's initializers of them."""
    tensors = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    return {name for name, _ in tensors}


def refuse_data_dependent_trace(first: bytes, again: bytes, frozen_values) -> None:
    """``again``, the graph exported from a batch of the same shapes but other values, must equal
    ``first`` (both serialized without the weights)."""
    if first != again:
        raise ExportError(
            "the exported graph depends on the values of the batch it was traced with, or on random draws the trace "
            "cannot see (a numpy Generator or random.Random of forward's own), since a batch of other values gives "
            "another graph; so it would train every later batch as if it were the first. Values frozen at:\n- "
            + "\n- ".join(frozen_values)
            + "\nKeep these computations in tensor ops, or train this model with torch."
        )
