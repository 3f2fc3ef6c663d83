"""What a forward does that its trace cannot record, and where in the user's code it does it.

A trace records tensor ops. Two kinds of effect escape it, and a graph built from it would start every step from
the first step's world while torch's loop carries on:

- draws from generators outside torch (Python's random module, numpy's global generator): the trace keeps the
  first draw's result as a constant (``generators_drawn``; ``draws_decide_nothing`` exports again with the draws
  forced to either end of their range; ``draw_locations`` finds the lines);
- changes to the modules' own state: Python attributes, tensors replaced or changed through ``.data``, parameters
  changed in forward, the variables forward hooks close over (``module_state`` before, ``state_changes`` after).

as_trained.py and trace.py take these snapshots around their runs of forward, refusals.py refuses with what they
find; ``user_location`` names the user's line of a finding or of an exporter warning. A third kind, the Python
values forward reads from the script (``values_read_by_name``: globals, ``args.tau``), is the same at the export
and changes later: module_edits.py compares them at every step.
"""

import argparse
import contextlib
import dataclasses
import functools
import inspect
import linecache
import os
import random
import sys
import sysconfig
import types
import warnings
from dataclasses import dataclass

import numpy as np
import torch

_TORCH_DIRECTORY = os.path.dirname(torch.__file__) + os.sep
ORTTRAINER_DIRECTORY = os.path.dirname(os.path.dirname(__file__)) + os.sep  # the package, above export/
# Where installed code lives (the standard library, site-packages): its globals are its own, not the training script's.
_INSTALLED_DIRECTORIES = tuple({sysconfig.get_paths()[key] + os.sep for key in ("stdlib", "platstdlib", "purelib", "platlib")})
_MISSING = object()


def user_location(frame=None) -> str:
    """'file:line: source' of the innermost frame outside torch, Python's warnings and random modules and orttrainer,
    from ``frame`` (default: the caller's) outwards."""
    frame = frame or sys._getframe(1)
    while frame is not None:
        if is_users_code(frame.f_code.co_filename):
            return source_line(frame.f_code.co_filename, frame.f_lineno)
        frame = frame.f_back
    return "(unknown location)"


def source_line(filename: str, lineno: int) -> str:
    """'file:line: source' (without the source where Python cannot read it)."""
    source = linecache.getline(filename, lineno).strip()
    return f"{filename}:{lineno}" + (f": {source}" if source else "")


@contextlib.contextmanager
def buffers_kept(module: torch.nn.Module):
    """``module``'s buffers as they were before the block (forward in training mode moves BatchNorm's statistics), put
    back by copying where they changed: not through its ``load_state_dict``, which its state_dict hooks may refuse,
    and not where they did not (a copy would count as a write: module_edits). Parameters are not copied (a model's
    size): a forward that changes them is refused (``state_changes``)."""
    buffers = list(module.buffers())
    saved = [buffer.detach().clone() for buffer in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in zip(buffers, saved):
                if not _same_bits(buffer, value):
                    buffer.copy_(value)


def _same_bits(tensor: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether two tensors of one dtype and shape hold the same bytes (a NaN equals itself)."""
    return torch.equal(tensor.detach().contiguous().view(-1).view(torch.uint8), other.contiguous().view(-1).view(torch.uint8))


def generator_states() -> tuple:
    """The states of the random generators forward may draw from unseen by the trace: Python's random module's
    and numpy's global one (``np.random``)."""
    return random.getstate(), np.random.get_state()


def generators_drawn(before: tuple, after: tuple) -> list:
    """The names of the generators whose states differ between ``before`` and ``after`` (``generator_states``)."""
    drawn = [] if after[0] == before[0] else ["Python's random module"]
    if not (np.array_equal(after[1][1], before[1][1]) and after[1][2:] == before[1][2:]):
        drawn.append("numpy's global generator (np.random)")
    return drawn


def is_users_code(filename: str) -> bool:
    """Whether code in ``filename`` is the user's: not torch's, orttrainer's, or Python's warnings or random modules."""
    return not (filename.startswith(_TORCH_DIRECTORY) or filename.startswith(ORTTRAINER_DIRECTORY)
                or filename in (warnings.__file__, random.__file__))  # fmt: skip


def draw_locations(call, inputs, devices) -> list:
    """The user's lines that draw from Python's random module or numpy's global generator in one run of ``call``.

    A line tracer on the user's code compares the generators' states at each of its events: a change was made by
    the user's line run last (numpy's generator methods are invisible to a profile hook)."""
    found, last = {}, {"line": None, "states": generator_states()}

    def trace_users_lines(frame, event, argument):
        states = generator_states()
        if last["line"] is not None and generators_drawn(last["states"], states):
            found.setdefault(last["line"])
        last["states"] = states
        if event == "line":
            last["line"] = user_location(frame)
        return trace_users_lines

    def trace_calls(frame, event, argument):
        return trace_users_lines if is_users_code(frame.f_code.co_filename) else None

    previous = sys.gettrace()
    sys.settrace(trace_calls)
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            call(*inputs)
    finally:
        sys.settrace(previous)
    return list(found)


def draws_decide_nothing(serialized: bytes, export_again, module: torch.nn.Module) -> bool:
    """Whether the graph stays ``serialized`` when every uniform draw returns the lowest value of its range, and again
    the highest: a draw compared with a probability of 0 (transformers' MusicGen draws LayerDrop's number at every
    layer, whatever ``layerdrop``) decides nothing the graph holds. A draw the forcing does not reach (another
    function of the generators) decides against. The module's tensors are put back after the two exports (the
    graphs hold none of their values: they are graph inputs, trace.export_to_onnx)."""
    with buffers_kept(module):
        for value in (0.0, 1.0 - 2.0**-53):
            before = generator_states()
            with _uniform_draws_forced_to(value):
                again, _ = export_again()
            if again != serialized or generators_drawn(before, generator_states()):
                return False
    return True


@contextlib.contextmanager
def _uniform_draws_forced_to(value: float):
    """Python's ``random.random``/``uniform`` and numpy's ``random``/``random_sample``/``rand``/``uniform`` return
    ``value`` (in [0, 1), scaled to their range) in this block."""

    def uniform(low=0.0, high=1.0, size=None):
        drawn = low + (high - low) * value
        return drawn if size is None else np.full(size, drawn)

    forced = [(random, "random", lambda: value), (random, "uniform", lambda low, high: uniform(low, high)),
              (np.random, "random", lambda size=None: uniform(size=size)),
              (np.random, "random_sample", lambda size=None: uniform(size=size)),
              (np.random, "rand", lambda *shape: uniform(size=shape or None)), (np.random, "uniform", uniform)]  # fmt: skip
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in forced]
    try:
        for owner, name, function in forced:
            setattr(owner, name, function)
        yield
    finally:
        for owner, name, function in saved:
            setattr(owner, name, function)


# Attributes every torch module has: torch's bookkeeping, which forward does not change as state of its own.
MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))  # what every module has in its __dict__


def _byte_sum(tensor: torch.Tensor) -> int:
    """A sum of a tensor's bytes, taken eight at a time as int64 (wrapping): a change of its values moves it. Eight
    at a time: a sum of single bytes took 0.65 s over GPT-2's weights (23M), this one 0.05-0.17 s."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if data.storage_offset() % 8:
        data = data.clone()
    whole = data.numel() - data.numel() % 8
    return int(data[:whole].view(torch.int64).sum()) + int(data[whole:].sum())


@dataclass(frozen=True)
class _Fingerprint:
    """A tensor's values (dtype, shape and ``_byte_sum``), which forward may change by reassigning the tensor, through
    ``.data`` (which the version counter does not see) or in place (which it counts), and who holds them."""

    values: tuple
    identity: int
    version: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "_Fingerprint":
        return cls((tensor.dtype, tuple(tensor.shape), _byte_sum(tensor)), id(tensor), tensor._version)

    def changed(self, now: "_Fingerprint", unseen_only: bool, in_place_counts: bool) -> bool:
        """Whether the values changed (a tensor replaced by an equal one, as Swin's window size is at every trace, did
        not); with ``unseen_only``, only where no in-place op of the same tensor counted it (the exporter names those).
        With ``in_place_counts`` an in-place op counts even where it left the values as they were (a parameter's
        clamp or renormalisation does so from its second run on)."""
        if now.values == self.values:
            return in_place_counts and not unseen_only and now.identity == self.identity and now.version != self.version
        return not unseen_only or now.identity != self.identity or now.version == self.version


def comparable(value) -> bool:
    """Whether a change of ``value`` can be judged: Python numbers, strings, None, and tuples of them."""
    if isinstance(value, tuple):
        return all(map(comparable, value))
    return value is None or isinstance(value, (bool, int, float, str))


def _scripts_code(filename: str) -> bool:
    """Whether ``filename`` is the user's own code: not torch's or orttrainer's, nor an installed package's."""
    return is_users_code(filename) and not filename.startswith(_INSTALLED_DIRECTORIES)


def _namespace_entries(namespace):
    """The dict that holds a namespace's values (a dict, argparse.Namespace, SimpleNamespace, or an instance of a
    dataclass of the user's: where a script keeps its hyper-parameters, ``args.tau``), or None for anything else. A
    package's dataclass is left out: a Hugging Face config is one, and ``save_pretrained`` sets its ``dtype``."""
    if isinstance(namespace, dict):
        return namespace
    if isinstance(namespace, (argparse.Namespace, types.SimpleNamespace)) or (
            dataclasses.is_dataclass(namespace) and not isinstance(namespace, type)
            and _scripts_code(getattr(sys.modules.get(type(namespace).__module__), "__file__", None) or "")):  # fmt: skip
        return getattr(namespace, "__dict__", None)  # a dataclass with slots has none
    return None


def _code_objects(code: types.CodeType):
    yield code
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):  # a lambda, comprehension or function inside
            yield from _code_objects(constant)


def _scripts_functions(model: torch.nn.Module, loss_fn) -> list:
    """[(module path or None, module or None, function)] of the forwards, forward hooks and loss written in the user's
    own files (not an installed package's), each function once per module that runs it (each module holds its own
    attributes)."""
    found, seen = [], set()

    def add(path, module, function):
        function = inspect.unwrap(getattr(function, "__func__", function))
        while isinstance(function, functools.partial):
            function = function.func
        code = getattr(function, "__code__", None)
        if code is None or (id(function), id(module)) in seen or not _scripts_code(code.co_filename):
            return
        seen.add((id(function), id(module)))
        found.append((path, module, function))

    for path, owner in state_owners(model, loss_fn):
        if isinstance(owner, torch.nn.Module):
            add(path, owner, type(owner).forward)
            for hook in [*owner._forward_pre_hooks.values(), *owner._forward_hooks.values()]:
                add(path, owner, hook)
    if callable(loss_fn) and not isinstance(getattr(loss_fn, "__self__", loss_fn), torch.nn.Module):
        add(None, None, loss_fn)
    return found


def values_read_by_name(model: torch.nn.Module, loss_fn) -> list:
    """[(description, dict, key, value)] of the Python numbers and strings that the user's forwards, forward hooks and
    loss read by name where a trace cannot see them change: module-level globals, and the attributes they name of a
    namespace (``_namespace_entries``) held as a global or as an attribute of the module (``args.tau``,
    ``self.hparams.tau``). The trace keeps their values of the first step; a loop that anneals one changes what torch
    computes. Only the attributes (or string keys) the code names are taken, so ``args.epoch`` set by the loop is no
    change unless forward reads it. Installed packages' code (torch, transformers) is not read."""
    entries = {}

    def add(description, holder, key):
        if comparable(holder[key]):
            entries.setdefault((id(holder), key), (description, holder, key, holder[key]))

    for path, module, function in _scripts_functions(model, loss_fn):
        codes = list(_code_objects(function.__code__))
        names = {name for code in codes for name in code.co_names}
        keys = names | {constant for code in codes for constant in code.co_consts if isinstance(constant, str)}
        reader = function.__qualname__ + (f" of module '{path or 'the model'}'" if module is not None else "")
        held = {name: function.__globals__[name] for name in names & function.__globals__.keys()}
        for name in held:
            add(f"global '{name}' read by {reader}", function.__globals__, name)
        if module is not None:
            held.update({name: value for name, value in vars(module).items() if name not in MODULE_INTERNALS})
        for name, namespace in held.items():
            holder = _namespace_entries(namespace)
            for key in keys & holder.keys() if holder is not None else ():
                add(f"'{name}.{key}' read by {reader}", holder, key)
    return list(entries.values())


def state_owners(model: torch.nn.Module, loss_fn) -> list:
    """[(qualified name, object)] of what holds the state forward and the loss run with: the model's modules, and the
    loss's modules (a module or a bound method's) or the loss object itself (a function's attributes)."""
    owners = list(model.named_modules())
    loss_owner = getattr(loss_fn, "__self__", loss_fn)  # a bound method's object
    if isinstance(loss_owner, torch.nn.Module):
        owners += [(f"loss_fn.{path}".rstrip("."), layer) for path, layer in loss_owner.named_modules()]
    elif hasattr(loss_owner, "__dict__"):  # a function's is its attributes
        owners.append(("loss_fn", loss_owner))
    return owners


def module_state(model: torch.nn.Module, loss_fn, attributes=True) -> dict:
    """{(kind, qualified name): fingerprint or value} of what a forward could change in ``model`` and ``loss_fn`` (a
    module, or an object with state of its own) without the trace recording it: parameters, buffers, and with
    ``attributes`` tensor and Python attributes and the variables the modules' forward hooks close over (a warm-up
    counter). BatchNorm's running statistics are left out: the graph updates them as torch does."""
    state = {}
    for path, owner in state_owners(model, loss_fn):
        prefix = f"{path}." if path else ""
        for name, value in vars(owner).items() if attributes else ():
            if name in MODULE_INTERNALS:
                continue
            if isinstance(value, torch.Tensor):
                state[("tensor attribute", prefix + name)] = _Fingerprint.of(value)
            elif comparable(value):
                state[("attribute", prefix + name)] = value
        if not isinstance(owner, torch.nn.Module):
            continue
        if attributes:
            state.update({("hook variable", description): value
                          for description, _, _, value in hook_variables(owner, path or "the model")})
        tracked = not isinstance(owner, torch.nn.modules.batchnorm._BatchNorm)
        for kind, tensors in (("buffer", owner._buffers if tracked else {}), ("parameter", owner._parameters)):
            for name, tensor in tensors.items():
                if tensor is not None:
                    state[(kind, prefix + name)] = _Fingerprint.of(tensor)
    return state


class _Cell:
    """A closure cell read as a dict of one entry (``get(None)``): a variable a hook closes over, which the enclosing
    function (a training script's ``main``) or ``nonlocal`` may rebind between steps."""

    __slots__ = ("cell",)

    def __init__(self, cell):
        self.cell = cell

    def get(self, key, default=None):
        try:
            return self.cell.cell_contents
        except ValueError:  # the variable was deleted
            return default


def hook_variables(layer: torch.nn.Module, where: str) -> list:
    """[(description, holder, key, value)] of the Python numbers and strings that the forward hooks of ``layer``
    close over, alone (holder: the variable's cell read as a dict, key None) or as values of a dict the hook holds
    (the dict and the value's key)."""
    found = []
    for hook in [*layer._forward_pre_hooks.values(), *layer._forward_hooks.values()]:
        code, cells = getattr(hook, "__code__", None), getattr(hook, "__closure__", None) or ()
        for name, cell in zip(code.co_freevars if code else (), cells):
            try:
                value = cell.cell_contents
            except ValueError:  # a cell not yet filled
                continue
            holder = value if isinstance(value, dict) else _Cell(cell)
            for key, item in value.items() if isinstance(value, dict) else [(None, value)]:
                if comparable(item):
                    variable = f"{name}[{key!r}]" if isinstance(value, dict) else name
                    found.append((f"{variable}, a variable of the forward hook {hook.__qualname__} of module '{where}'",
                                  holder, key, item))  # fmt: skip
    return found


def writable_buffers(module: torch.nn.Module) -> dict:
    """{qualified name: tensor} of the buffers a training forward may write in place for the graph to carry (the trace
    returns their new values, trace._WeightsAsInputs): all but BatchNorm's, whose statistics the graph's
    BatchNormalization updates and whose batch counter the trainer counts."""
    return {f"{path}.{name}" if path else name: tensor for path, layer in module.named_modules()
            if not isinstance(layer, torch.nn.modules.batchnorm._BatchNorm)
            for name, tensor in layer._buffers.items() if tensor is not None}  # fmt: skip


def buffers_written(before: dict, model: torch.nn.Module, loss_fn) -> list:
    """The buffers of ``before`` (``module_state``) that forward wrote in place since: the same tensor, its version
    counter moved."""
    after = module_state(model, loss_fn, attributes=False)
    return [name for (kind, name), value in before.items() if kind == "buffer" and (kind, name) in after
            and after[(kind, name)].identity == value.identity and after[(kind, name)].version != value.version]  # fmt: skip


def state_changes(before: dict, model: torch.nn.Module, loss_fn, unseen_only: bool, written=()) -> list:
    """What forward changed of ``before`` (``module_state``, taken with ``attributes`` unless ``unseen_only``), one line
    each; with ``unseen_only`` only tensors changed where their version counter did not count it. The buffers
    ``written`` in place (the graph carries their new values: ``writable_buffers``) are no change while they are the
    same tensors."""
    after = module_state(model, loss_fn, attributes=not unseen_only)
    changes = []
    for (kind, name), value in before.items():
        now = after.get((kind, name), _MISSING)
        tensor = isinstance(value, _Fingerprint)
        if now is _MISSING or (kind == "buffer" and name in written and now.identity == value.identity):
            continue
        if not value.changed(now, unseen_only, kind == "parameter") if tensor else now is value or now == value:
            continue  # a Python value: the same object is unchanged (a NaN too)
        if not tensor:
            changes.append(f"{name if kind == 'hook variable' else f'{kind} {name!r}'}: {value!r} -> {now!r}")
        elif kind == "parameter":
            changes.append(f"parameter '{name}': its values changed in forward (a .data update, F.embedding's max_norm "
                           "renormalising rows)")
        else:
            changes.append(f"{kind} '{name}': reassigned or changed through .data")
    return changes
