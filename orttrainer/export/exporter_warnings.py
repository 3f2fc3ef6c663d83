"""Every warning torch's exporter raises during a trace, judged against the module.

Harmless ones are dropped (each with why); those that say the trace may differ from the module (Python values
computed from the batch's values or a random draw, buffers or inputs mutated in place, a dropout or padding row
changed) are refused with the user's line and the fix; the others reach the user. Python values the trace froze
from anything else are noted: a later batch of the same shapes must give the same graph
(``refuse_data_dependent_trace``).
"""

import ast
import functools
import linecache
import re
import sys
import warnings
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from . import forward_effects
from .as_trained import WRAPPED
from .size_guards import SizeGuards
from .refusals import ExportError


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


_LEN = r"Using len to get tensor shape might cause the trace to be incorrect"

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
    # len(tensor), a size of the sample batch (CLIP's contrastive loss, arange(len(logits))): likewise (the graph then
    # serves no other sizes without an export: ``sizes_read_untraced``)
    (torch.jit.TracerWarning, _LEN),
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


def _mutation_problem(found: re.Match, state_names, changed_state, changed_inputs, written):
    """Why the in-place op of a ``_MUTATION`` warning (``found``), which the exporter turned into a copy, makes
    the graph differ, or None (harmless: it changed a tensor made from the batch, not the batch or the
    module's state; or a buffer the trace saw changed, whose new value the graph returns for the trainer to write,
    ``trace._WeightsAsInputs``). The exporter names the values of ``tensor[mask] = value`` as the input an
    ``index_put_`` changes when they are a weight (Wav2Vec2's masked_spec_embed): a weight the trace left unchanged
    is not taken for changed there."""
    op, target = found.group(1), found.group(2)
    if target in written:
        return None
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


class ValuesTurnedPython(TorchFunctionMode):
    """Notes where the traced code turns a tensor that depends on the batch's or the weights'
    values into a Python value (an ``if`` on it, ``int(...)``): the trace freezes that value,
    which differs from batch to batch. One computed from shapes alone is the same for every
    batch of the graph's shape signature, and for every batch of other sizes that computes the
    same value from them: ``size_guards`` notes it."""

    def __init__(self):
        super().__init__()
        self.size_guards = SizeGuards()
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
        result = func(*args, **(kwargs or {}))
        if why is None and traced is not None:
            self.size_guards.note(traced, func.__name__, result, forward_effects.user_location())
        return result

    @staticmethod
    def caller():
        """(file, line) that called the torch function under way, or None outside this mode: torch's
        warnings name this module's line, since every torch call of the traced code passes here."""
        frame = sys._getframe(1)
        while frame is not None and frame.f_code is not ValuesTurnedPython.__torch_function__.__code__:
            frame = frame.f_back
        return None if frame is None else (frame.f_back.f_code.co_filename, frame.f_back.f_lineno)


class ExporterWarnings:
    """Hears every warning raised during export, with the user's line that caused it.

    On exit: warnings that mean the graph may differ from the module become one
    ExportError naming each source line and the fix; harmless ones (``_HARMLESS``, one by
    one, with the reason) are dropped; all others reach the user unchanged.
    """

    def __init__(self, values: ValuesTurnedPython, inputs: dict, state: dict, written: list):
        self.values, self.inputs, self.state = values, inputs, state
        self.written = written  # the buffers the trace returns written (filled by trace._WeightsAsInputs's forward)

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
            filename, lineno = ValuesTurnedPython.caller() or (filename, lineno)
        self.heard.append(_Heard(category, str(message), filename, lineno, forward_effects.user_location()))

    def __exit__(self, *exc_info):
        self._catcher.__exit__(*exc_info)
        if exc_info[0] is not None:
            return False
        problems, self.frozen_values, self.sizes_read_untraced = [], [], []
        changed = [name for name, tensor in self.inputs.items() if tensor._version != self._versions[name]]
        changed_state = {name for name, tensor in self.state.items() if tensor._version != self._versions[name]}
        for heard in self.heard:
            if re.search(_LEN, heard.message):  # a size as a Python int: the trace holds it, no guard sees it
                self.sizes_read_untraced += [heard.describe()] if heard.describe() not in self.sizes_read_untraced else []
            if _is_harmless(heard):
                continue
            mutation = re.search(_MUTATION, heard.message)
            if mutation is not None:
                reason = _mutation_problem(mutation, self.state, changed_state, changed, {WRAPPED + name for name in self.written})
                if reason is not None and f"{heard.describe()}: {reason}" not in problems:
                    problems.append(f"{heard.describe()}: {reason}")
                continue
            if re.search(_FROZEN_VALUE, heard.message) and heard.where in self.values.from_values:
                problem = f"{heard.describe()}: {self.values.from_values[heard.where]}"
                problems += [problem] if problem not in problems else []
                continue
            if re.search(_FROZEN_VALUE, heard.message) and heard.where in self.values.size_guards.guarded:
                continue  # a decision on sizes alone: a guard of the graph (size_guards.py)
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
