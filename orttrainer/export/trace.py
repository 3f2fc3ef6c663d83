"""torch module + loss function -> the forward+loss ONNX graph: the trace itself.

The exported graph takes the model_desc inputs (the label last when a loss_fn is
given) and returns the loss first, then the model's outputs. It holds no weights: they are
graph inputs named exactly like the keys of the module's ``state_dict()``. The export runs the
user's module itself (the trainer trains its tensors in place) and leaves it as it was.

One ``torch.onnx.export`` (the TorchScript exporter, orttrainer's symbolics registered) with the weights as inputs
of the trace, its warnings judged (exporter_warnings.py), what the graph cannot hold refused (refusals.py), done
again from the state a first call leaves; then the exported model made the graph the trainer builds on
(exported_graph.py).
"""

import contextlib
import io
from dataclasses import dataclass

import onnx
import torch
from torch.onnx import TrainingMode
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from . import experts, export_failures, forward_effects, symbolics
from .buffer_writes import BufferWrites, changes_in_place, refuse_unseen_writes
from .as_trained import WRAPPED, keeping_no_activations, with_loss
from .exported_graph import loss_tensors_as_constants, name_written_buffers, resolve_markers, strip_wrapper_prefix
from .exporter_warnings import ExporterWarnings, ValuesTurnedPython
from .size_guards import NO_GUARDS, Guards
from .refusals import (ExportError, HookAndFunctionSpy, functions_as_their_forward, refuse_custom_backward,
                       refuse_draws_outside_torch, refuse_state_changes)
from ..graph import rewrites


def export_to_onnx(model, inputs, loss_fn, forward_names, desc_inputs, desc_outputs, opset: int, constants=None,
                   loss_index=None):  # fmt: skip
    """Export ``model`` (+ ``loss_fn``) in the modes it trains in, names and dynamic axes from model_desc.

    ``model`` is in the modes it trains in (:func:`as_trained.as_trained`); ``desc_inputs``/``desc_outputs`` are
    (name, shape) pairs, string dims become dynamic. The global torch RNG is left as it
    was (tracing runs dropout once). The module's weights and buffers are graph inputs of
    their type and shape, named by their state_dict keys, never initializers: their data
    stays in torch memory, so no model is too large for one protobuf (2 GiB) and none is
    serialized (docs/stack_facts.md). ``constants`` go to forward as they are, so the graph
    holds what they chose. With ``loss_index`` (the loss among the outputs), what carries a
    hand-written backward is refused (``_WeightsAsInputs``).
    Returns the ModelProto, {Gather node: exported_graph.EmbeddingLookup} and the trace's ``TraceFacts``.
    """
    wrapper = with_loss(model, loss_fn, forward_names, constants)
    devices = [inputs[0].device.index or 0] if inputs and inputs[0].is_cuda else []
    states_before = forward_effects.generator_states()

    def export_once():
        return _traced_export(model, wrapper, inputs, desc_inputs, desc_outputs, opset, devices, loss_index)

    with experts.traced_for_every_routing(model):
        serialized, facts, module_state_before = _export_from_the_state_of_a_first_call(model, loss_fn, export_once)
        mismatch = _outputs_differing_by_mode(model, wrapper, desc_outputs)
        if mismatch:
            raise mismatch
        # first: the draws' exports put the tensors back
        refuse_state_changes(module_state_before, model, loss_fn, written=facts.written_buffers)
        refuse_draws_outside_torch(states_before, model, wrapper, inputs, devices, serialized, export_once)
    exported = onnx.load_from_string(serialized)
    loss_tensors_as_constants(exported, wrapper)
    strip_wrapper_prefix(exported)
    name_written_buffers(exported, facts.written_buffers)
    lookups = resolve_markers(exported)
    rewrites.torch_pools(exported)  # first: torch's pools can make fewer windows than ONNX's, whose sizes folding reads
    rewrites.fold_static_sizes(exported, _module_tensor_names(model))
    return exported, lookups, facts


@dataclass
class TraceFacts:
    """What a trace took from its batch beyond the graph: ``frozen_values``, where it froze a Python value of unknown
    origin (``exporter_warnings._FROZEN_VALUE``); ``guards``, its decisions on sizes (``size_guards.Guards``);
    ``sizes_read_untraced``, where it read a size as a plain int (``len(tensor)``), which no guard sees;
    ``written_buffers``, the buffers forward wrote in place, whose new values the graph returns last
    (``_WeightsAsInputs``)."""

    frozen_values: list
    guards: Guards
    sizes_read_untraced: list
    written_buffers: list


def _export_from_the_state_of_a_first_call(model, loss_fn, export_once):
    """``export_once()`` (serialized, TraceFacts) and the module's state it started from (``forward_effects.module_state``).

    A forward may set state at its first call in training mode and keep it (a cache filled, a flag set): the graph
    is traced from that state, as a forward run before the trace left it (buffers put back, as ``as_trained``
    does). So an export that changed the module's state, failing or not, is done again from the state it left, and
    the second export must change nothing (``refuse_state_changes``)."""
    before = forward_effects.module_state(model, loss_fn)
    with forward_effects.buffers_kept(model):
        try:
            serialized, facts = export_once()
            failed = None
        except ExportError as error:
            failed = error
        written = [] if failed is not None else facts.written_buffers
        changed = forward_effects.state_changes(before, model, loss_fn, unseen_only=False, written=written)
    if not changed and failed is not None:
        raise failed
    if not changed:
        return serialized, facts, before
    before = forward_effects.module_state(model, loss_fn)
    return (*export_once(), before)


class _WeightsAsInputs(torch.nn.Module):
    """``wrapper`` (an ``as_trained._ModelWithLoss``) traced with its weights and buffers (each tensor once, under its first
    state_dict name: tied weights are one input) as inputs of the trace, after the batch's ``count`` inputs.

    The module's own tensors are passed, so forward reads them as it always does and the tracer, which knows each
    tensor it was given, records every use as a use of that input. Not a parameter of the traced module: the
    TorchScript exporter gives a traced module's parameters by value to its ONNX shape inference, whose time then
    grows with the weights (GPT-2 small: 3 s of its 6 s; docs/stack_facts.md); inputs it leaves alone. Each input is named as the
    exporter names a parameter (the state_dict key), which its warnings quote (``exporter_warnings._MUTATION``).

    With a ``loss_index``, what carries a hand-written backward is refused as soon as forward + loss have run
    (``refuse_custom_backward``), before the exporter converts or complains: the trace is the forward that shows it.

    The buffers forward writes in place (``forward_effects.writable_buffers``: a step counter, an exponential moving
    average) are returned after the outputs, ``written`` naming them: the exporter turns each in-place op into a new
    value, which the graph then returns for the trainer to copy into the buffer after each step (as torch's forward
    leaves it there); ``writes`` (buffer_writes.BufferWrites) makes it a value the eval graph does not take.
    """

    def __init__(self, wrapper, count: int, loss_index=None):
        super().__init__()
        vars(self)["wrapper"] = wrapper  # not a submodule: its tensors would be the traced module's parameters
        self.count, self.loss_index = count, loss_index
        self.spy = HookAndFunctionSpy()  # entered around the export, beneath ValuesTurnedPython (which names lines)
        self.size_guards, self.guards = None, NO_GUARDS  # set by _traced_export; compiled at the end of forward
        self.graph = None  # the traced graph, at the end of forward: an op the exporter cannot convert is found in it
        self.weights, seen = {}, set()
        for name, tensor in wrapper.state_dict(keep_vars=True).items():
            if isinstance(tensor, torch.Tensor) and id(tensor) not in seen:
                self.weights[name] = tensor
                seen.add(id(tensor))
        writable = forward_effects.writable_buffers(wrapper.model)
        self.buffers = {name: writable[name[len(WRAPPED) :]] for name in self.weights
                        if name.startswith(WRAPPED) and name[len(WRAPPED) :] in writable}  # fmt: skip
        self.written = []  # state_dict names of the buffers forward wrote, at the end of forward
        self.writes = BufferWrites(self.buffers)  # entered around the export, as the spy

    def forward(self, *inputs):
        for name, tensor in zip(self.weights, inputs[self.count :]):
            torch._C._get_value_trace(tensor).setDebugName(name)
        scopes, scope_of = torch.jit._trace._trace_module_map, torch._C._jit_onnx_create_full_scope_name
        if scopes is not None:
            scopes.update({layer: scope_of(torch.typename(type(layer)), _scope_name(name))
                           for name, layer in self.wrapper.named_modules() if layer is not self.wrapper})
        versions = {name: tensor._version for name, tensor in self.buffers.items()}
        with _one_value_per_channel_explained():
            outputs = self.wrapper(*inputs[: self.count])
        if self.loss_index is not None:
            refuse_custom_backward(outputs[self.loss_index], self.spy.hooks)
        self.graph = torch._C._get_tracing_state().graph()
        if self.size_guards is not None:  # the traced graph is the exporter's to change once forward returns
            self.guards = self.size_guards.compile(self.graph, list(inputs[: self.count]), list(self.weights.values()))
        written = [name for name, tensor in self.buffers.items() if tensor._version != versions[name]]
        refuse_unseen_writes(written, self.writes.marked)
        self.written[:] = [name[len(WRAPPED) :] for name in written]
        return (*outputs, *(self.buffers[name] for name in written))


def _scope_name(path: str) -> str:
    """A submodule's name in the exporter's node names, as it names the submodules of the module it traces: the
    path from its last atom that is not a number (``model.h.0`` -> ``h.0``)."""
    atoms = path.split(".")
    last = max((index for index, atom in enumerate(atoms) if not atom.isnumeric()), default=0)
    return ".".join(atoms[last:])


def _traced_export(model, wrapper, inputs, desc_inputs, desc_outputs, opset, devices, loss_index=None):
    """One ``torch.onnx.export`` of ``wrapper`` (orttrainer's symbolics registered, exporter warnings heard; with
    ``loss_index``, custom backwards refused: ``_WeightsAsInputs``): the serialized model and its ``TraceFacts``."""
    buffer, printed = io.BytesIO(), export_failures.PrintedOutput()
    traced = _WeightsAsInputs(wrapper, len(inputs), loss_index)
    try:
        values = ValuesTurnedPython()
        inputs_by_name = {name: tensor for (name, _), tensor in zip(desc_inputs, inputs)}
        state = {WRAPPED + name: tensor for name, tensor in model.state_dict().items()}
        # autograd on whatever the caller's mode (an eval_step under torch.no_grad() builds a graph that trains)
        traced.size_guards = values.size_guards
        # torch.autocast's bfloat16 copies of weights made before the trace (a forward under an autocast nested in
        # another, as accelerate's around a Trainer's model): the trace would read them as constants
        torch.clear_autocast_cache()
        with torch.random.fork_rng(devices=devices), symbolics.exporting(), torch.enable_grad(), \
                keeping_no_activations(), ExporterWarnings(values, inputs_by_name, state, traced.written) as heard, traced.spy, \
                functions_as_their_forward(), traced.writes, _NoGradResultsDetached(), values, printed:
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
        fix = _known_fix(model, first_line) or export_failures.what_to_do(first_line)
        failed = ExportError(f"torch.onnx.export of {type(model).__name__} failed: {first_line}"
                             f"{export_failures.where(error, traced.graph, wrapper)}{fix}{printed.note()}")  # fmt: skip
        raise mismatch or failed from error
    return buffer.getvalue(), TraceFacts(heard.frozen_values, traced.guards, heard.sizes_read_untraced, traced.written)


def _known_fix(model, message: str) -> str:
    """What to do about an export failure orttrainer knows the cause of, or ''."""
    kept = experts.other_implementations(model)
    if kept:
        return (f". {type(model).__name__} computes its experts in transformers' {' and '.join(map(repr, kept))} "
                "experts implementation, which the trainer traces as it is (it traces 'eager' and 'grouped_mm' in a "
                "form that computes the same experts for every routing); if the op is in the experts, call "
                "model.set_experts_implementation('grouped_mm') before creating the trainer")
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


class _NoGradResultsDetached(TorchFunctionMode):
    """Detaches, in the trace, what forward computes under ``torch.no_grad()`` from tensors that require grad.

    torch gives such a result no gradient; a trace records no grad mode, so ONNX Runtime would differentiate
    through it. The detach is recorded and cut as a user's ``detach()`` is (``symbolics.elementwise.detach``). An
    in-place op on a tensor that requires grad is refused (``_refuse_write_under_no_grad``).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tracing = torch._C._get_tracing_state() is not None
        if tracing and func in _WRITES_UNDER_NO_GRAD and _requires_grad(args, kwargs):  # its own ops are not seen here
            _refuse_write_under_no_grad(_WRITES_UNDER_NO_GRAD[func])
        writes_needing_grad = args and isinstance(args[0], torch.Tensor) and args[0].requires_grad
        if tracing and not torch.is_grad_enabled() and changes_in_place(func) and writes_needing_grad:
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
            _refuse_write_under_no_grad(name.replace("TensorBase.", "Tensor."))
        result = func(*args, **kwargs)
        if not tracing or torch.is_grad_enabled() or changes_in_place(func) or not _requires_grad(args, kwargs):
            return result
        return pytree.tree_map(lambda leaf: leaf.detach() if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()
                               else leaf, result)  # fmt: skip


# torch functions whose own code writes in place under no_grad into a tensor that requires grad; a function mode does
# not see the ops inside a function it was handed whole
_WRITES_UNDER_NO_GRAD = {torch.nn.functional.gaussian_nll_loss: "F.gaussian_nll_loss's clamp of its variances"}


def _requires_grad(args, kwargs) -> bool:
    return any(isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in pytree.tree_leaves((args, kwargs)))


def _refuse_write_under_no_grad(write: str) -> None:
    """ExportError for an in-place write under no_grad into a tensor that requires grad: torch changes the values and
    keeps the tensor's autograd history, so its gradient passes the write by; the graph holds the write as an op and
    differentiates through it (a clamp's gradient is 0 where it clamps)."""
    raise ExportError(
        f"{write} writes in place under torch.no_grad() into a tensor that requires grad, at "
        f"{forward_effects.user_location()}: torch's gradient passes that write by, the graph's would go through it (a "
        "clamp's gradient is 0 where it clamps), so training would differ where it changes a value. Compute the value "
        "out of place with grad on (for the Gaussian NLL: var = var.clamp(min=eps), then 0.5 * (var.log() + (input - "
        "target) ** 2 / var)), or train this model with torch"
    )


def _dynamic_axes(entries):
    return {name: {index: dim for index, dim in enumerate(shape) if isinstance(dim, str)} for name, shape in entries}
