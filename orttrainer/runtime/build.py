"""From a torch module (or a forward+loss ONNX model), its loss and a first batch to a ready Runtime.

``TorchSource.export`` exports the module and loss at one batch (export/trace.py) and ``from_torch``
builds that export; ``from_onnx`` takes the graph as given. Both pick the weights to train
(parameters, or float initializers, that reach the loss), build the training and eval graphs
(training_graph.py), open the two sessions bound to the weight tensors (session.py) and, on several
ranks, check that every rank built the same graph and start from rank 0's weights. A torch
module gets one graph per batch shape signature where its trace needs it (graph_cache.py):
``from_torch(..., shared=runtime)`` builds another graph over the same weights and state.
The forward graph's shape inference (tensor_facts.TensorFacts) is done once per build and handed
to each pass that reads it.

The :class:`Runtime` holds what a step uses: the sessions, weights, BatchNorm statistics, the buffers
forward writes, embedding lookups, the dropout and loss-scale inputs, the typed model_desc, the forward graph,
the torch state that is not in the graph, and the checks every batch must pass.
"""

import copy
import warnings
from dataclasses import dataclass

import onnx
import onnxruntime
import torch
from onnx import numpy_helper

from ..graph import (
    bfloat16, convolution_work, cpu_kernels, defined_gradients, dropout, eval_graph, float16, graph_edits, graph_errors,
    index_ranges,
    outputs_for_trainer, recompute, rewrites, tensor_facts, training_graph,
)
from ..export import as_trained, refusals, trace, verify
from .. import progress
from ..update import amp
from . import session, torch_convolutions, torch_products
from ..api.model_desc import (FREE_SIZES, _ORTTrainerModelDesc, forward_keywords, forward_parameters, free_axes,
                               infer_model_desc, inferred_inputs)


class Runtime:
    """What a build leaves for the steps: sessions bound to the weights, and what a run needs.

    ``from_torch`` also fills ``aliases`` (tied weights: {alias: first name}), ``unexported_state``
    and ``batch_counters`` (torch state the graph does not hold), ``written_buffers`` (the buffers the training
    graph writes, ``_WrittenBuffer``), ``reference`` (a verify.Reference,
    for the first-step check against torch), ``eval_reference`` (a verify.ModuleCall, for the first
    eval_step's) and ``export_sample`` (the batch and torch's outputs, for debug.check_model_export).
    Runtimes of one trainer share ``weights``, these, ``owned`` and ``scales``.
    """

    def __init__(self, model_desc, onnx_model, graphs, sessions, weights: dict, trainable, scales, device):
        # the forward graph, its weights as graph inputs: their data lives in ``weights`` (a second copy
        # would hold the model's size for the whole run)
        self.onnx_model = rewrites.copy_with_inputs_for(onnx_model, weights)
        self.model_desc, self.device = model_desc, device
        self.train_session, self.eval_session = sessions
        self.weights, self.trainable = weights, trainable
        self.owned = trainable  # the weights this rank's optimizer updates (ZeRO-1: a part of them)
        for bound in sessions:
            for name, tensor in weights.items():
                if name in bound.input_names:
                    bound.bind_input(name, tensor)
        self.gradient_outputs = graphs.gradient_outputs
        self.batch_norms = [_BatchNormStatistics(stats, weights, self.train_session) for stats in graphs.running_statistics]
        self.scales = scales
        # mixed precision: the scale the loss is multiplied by, else None; dropout scale 0 turns dropout off (the check)
        self.loss_scale, self.dropout_scale = scales
        if self.loss_scale is not None:
            self.train_session.bind_input(float16.LOSS_SCALE_INPUT, self.loss_scale)
        if dropout.DROPOUT_SCALE_INPUT in self.train_session.input_names:
            self.train_session.bind_input(dropout.DROPOUT_SCALE_INPUT, self.dropout_scale)
        self.dropout_fixed = scales[0] is not None and any(node.op_type == "Dropout" for node in graphs.train.graph.node)
        self.embeddings = graphs.embedding_gradients
        for embedding in self.embeddings:
            self.train_session.bind_input(embedding.lookup_input, weights[embedding.weight])
        embedding_outputs = [name for e in self.embeddings for name in (e.rows_gradient, e.indices_output)]
        self.train_session.allocate_outputs([entry.name for entry in model_desc.outputs] + embedding_outputs)
        self.aliases, self.unexported_state, self.batch_counters = {}, {}, {}
        self.written_buffers = []
        self.reference = self.eval_reference = self.export_sample = self.index_ranges = None
        self.empty_inputs = []

    def bind_batch(self, bound, inputs) -> None:
        """Bind the batch's inputs; a run that fails names those of them that are empty (``run_error``)."""
        self.empty_inputs = [f"input '{entry.name}' of shape {tuple(tensor.shape)}"
                             for entry, tensor in zip(self.model_desc.inputs, inputs) if 0 in tensor.shape]  # fmt: skip
        for entry, tensor in zip(self.model_desc.inputs, inputs):
            if entry.name in bound.input_names:
                bound.bind_input(entry.name, tensor)

    @property
    def buffer_writes(self) -> list:
        """What a training step writes into buffers: every BatchNorm's statistics (``_BatchNormStatistics``) and the
        buffers forward writes (``_WrittenBuffer``), each with ``names``, ``tensors``, ``save_old``, ``restore_old``
        and ``update``."""
        return [*self.batch_norms, *self.written_buffers]

    def run_training(self):
        """Run the training graph once: (model_desc outputs, embedding outputs). The buffers a step writes are left
        as they were before the run (``update_buffers`` writes torch's values), or as they were when the run failed
        or had one value per channel."""
        for write in self.buffer_writes:
            write.save_old()
        try:
            outputs = self.train_session.run()
        except RuntimeError as error:
            self.restore_buffers()
            raise graph_errors.run_error(error, self.empty_inputs) from error
        _check_values_per_channel(self.batch_norms)
        count = len(self.model_desc.outputs)
        return outputs[:count], outputs[count:]

    def update_buffers(self) -> None:
        """Write the run's new values into the buffers, as torch's forward leaves them."""
        for write in self.buffer_writes:
            write.update()

    def restore_buffers(self) -> None:
        for write in self.buffer_writes:
            write.restore_old()

    def buffer_tensors(self) -> list:
        return [tensor for write in self.buffer_writes for tensor in write.tensors]

    def buffer_copies(self) -> dict:
        """{buffer name: CPU copy} of every buffer a step writes."""
        return {name: tensor.detach().cpu().clone()
                for write in self.buffer_writes for name, tensor in zip(write.names, write.tensors)}  # fmt: skip

    def run_eval(self, inputs, requested):
        self.bind_batch(self.eval_session, inputs)
        self.eval_session.allocate_outputs(requested)
        try:
            return self.eval_session.run()
        except RuntimeError as error:
            raise graph_errors.run_error(error, self.empty_inputs) from error

    def check_batch(self, inputs) -> None:
        """Before any run: token ids and class targets inside the range torch accepts
        (index_ranges.index_ranges, found at the first batch)."""
        by_name = {entry.name: tensor for entry, tensor in zip(self.model_desc.inputs, inputs)}
        if self.index_ranges is None:
            self.index_ranges = index_ranges.index_ranges(self.onnx_model, {name: list(t.shape) for name, t in by_name.items()})
        for bound in self.index_ranges:
            _check_index_range(bound, by_name[bound.input])

    def check_export(self) -> None:
        """debug.check_model_export: the eval graph must reproduce torch's eval-mode outputs of the first batch."""
        if self.export_sample is None:
            return
        inputs, torch_outputs = self.export_sample
        self.export_sample = None
        onnx_outputs = self.run_eval([tensor.to(self.device) for tensor in inputs], [e.name for e in self.model_desc.outputs])
        for entry, expected, actual in zip(self.model_desc.outputs, torch_outputs, onnx_outputs):
            if not torch.allclose(expected, actual.cpu(), rtol=1e-2, atol=1e-6):
                difference = (expected - actual.cpu()).abs().max().item()
                raise AssertionError(
                    f"debug.check_model_export: ONNX output '{entry.name}' differs from torch (max abs difference {difference})"
                )

    def inference_model(self, with_loss: bool = True) -> onnx.ModelProto:
        """The forward graph in inference mode (dropout off, BatchNorm on running statistics), without the loss
        unless ``with_loss``; its weights stay graph inputs (``onnx_file.save`` writes them from ``weights``)."""
        model = copy.deepcopy(self.onnx_model)
        eval_graph.set_inference_mode(model)
        if not with_loss:
            loss = self.model_desc.loss_output.name
            eval_graph.keep_outputs(model, [entry.name for entry in self.model_desc.outputs if entry.name != loss])
        leave_out = " (save_as_onnx(path, with_loss=False) leaves the loss out)" if with_loss else ""
        training_graph.refuse_ctc_losses(
            model, f"a plain onnxruntime.InferenceSession cannot run the saved graph{leave_out}", ValueError
        )
        eval_graph.spell_batch_statistics_norms(model)
        return model


def _check_index_range(bound, indices) -> None:
    outside = (indices < 0) | (indices >= bound.size)
    if bound.ignore_index is not None:
        outside &= indices != bound.ignore_index
    if bool(outside.any()):
        position = tuple(int(i) for i in outside.nonzero()[0])
        allowed = f"0..{bound.size - 1}" + (f" or {bound.ignore_index} (ignore_index)" if bound.ignore_index is not None else "")
        raise ValueError(
            f"input '{bound.input}' holds {int(indices[position])} at index {list(position)}, outside {allowed}: "
            f"it is read by {bound.consumer}; torch would raise too (an id past the vocabulary, a class past the "
            "number of classes)"
        )


# ------------------------------------------------------------------ torch module
@dataclass
class TorchExport:
    """The module + loss exported at one batch, before anything is built from it."""

    inputs: list  # the batch, on the module's device
    constants: dict  # the step's constants, given to forward as they are (model_desc.match_inputs)
    desc: _ORTTrainerModelDesc  # the user's, or inferred from this batch
    outputs: list  # torch's outputs for this batch (eval mode, no autograd), the loss among them
    state: dict  # the module's state_dict tensors themselves (detached: the trainer's weights are these)
    onnx_model: onnx.ModelProto
    lookups: dict  # {Gather node name: exported_graph.EmbeddingLookup}
    trace_facts: trace.TraceFacts  # what the trace took from this batch: frozen values, decisions on sizes


class TorchSource:
    """The user's module as the trainer exports it, at every batch shape signature that needs a graph. The trainer
    trains the module's own tensors in place (the sessions read their memory), so there is one copy of the weights,
    as in a torch loop, and the module holds the trained model after every step. On another device than the
    trainer's, the module is moved there first, as a torch loop does with ``model.to(device)``."""

    def __init__(self, model, loss_fn, input_names, options, model_desc, device):
        refusals.refuse_unexportable(model)
        if any(tensor.device != device for tensor in [*model.parameters(), *model.buffers()]):
            model.to(device)
        self.module, self.device = model, device
        self.described = f"{type(model).__name__} ({progress.size_of(model.parameters())})"
        self.forward_names = _forward_names(model, input_names, loss_fn)
        self.loss_fn, self.options, self.model_desc = loss_fn, options, model_desc
        # the kinds of sizes an inferred model_desc leaves dynamic (padded lengths, image sizes) until a graph needs
        # them fixed (fix_sizes)
        self.free_sizes = list(FREE_SIZES)

    def fix_sizes(self, inputs, kinds=FREE_SIZES) -> bool:
        """Fix, in this and every later export, the last kind of sizes among ``kinds`` still free that leaves an axis
        of ``inputs`` dynamic (a graph that cannot be exported or trained with them free); False if there is none
        (or the model_desc is the user's)."""
        if self.model_desc is not None:
            return False
        for kind in [kind for kind in reversed(self.free_sizes) if kind in kinds]:
            self.free_sizes.remove(kind)
            if any(free_axes(tensor, [kind]) for tensor in inputs):
                return True
        return False

    def export(self, input_names, inputs, constants, compared_with=None) -> TorchExport:
        """Export at this batch and these constants (forward's keywords baked into the trace); ``model_desc``
        None: inferred from them (the sizes of the batch dynamic: ``model_desc.infer_model_desc``). The graph holds no weights: they are graph inputs. The module
        is left as it was: its modes, attributes and buffers (forward in training mode moves BatchNorm's statistics).

        ``compared_with``: the model_desc of a built graph this export is only compared with (graph_cache: one built
        at the same shapes from other values, or at other sizes of axes it declares dynamic, ``declares_alike``): the
        export takes its names and dynamic axes, and neither the eval-mode run that infers them (``outputs`` is None)
        nor the custom-backward check that build ran is repeated.
        A branch on the values themselves is refused by every export (``exporter_warnings.ValuesTurnedPython``).
        """
        with progress.phase(f"exported {self.described} at {[list(tensor.shape) for tensor in inputs]}"), \
                as_trained.as_trained(self.module), amp.torch_autocast(self.options.mixed_precision, self.device):
            return self._export(input_names, inputs, constants, compared_with)

    def declares_alike(self, desc, input_names, inputs) -> bool:
        """Whether an export at ``inputs`` would declare its inputs as ``desc`` (a built graph's) does: the same names,
        and the same sizes where not dynamic."""
        if self.model_desc is not None:  # every export declares the user's
            return True
        declared = [(entry.name, list(entry.shape)) for entry in desc.inputs]
        return declared == [(name, list(shape)) for name, shape in inferred_inputs(input_names, inputs, self.free_sizes)]

    def _export(self, input_names, inputs, constants, compared_with) -> TorchExport:
        module, loss_fn = self.module, self.loss_fn
        # forward may change what it is given
        batch = [tensor.detach().to(self.device, copy=True) for tensor in inputs]
        if compared_with is None:
            outputs, form = as_trained.sample_outputs(module, loss_fn, self.forward_names, batch, constants)
            outputs = list(outputs)
            desc = self.model_desc or infer_model_desc(input_names, batch, outputs, form, self.free_sizes)
            # given the loss, the trace refuses custom backwards
            loss_index = _loss_index(desc, outputs, loss_fn, inferred=self.model_desc is None)
        else:
            outputs, desc, loss_index = None, compared_with, None
        with recompute.checkpointed_modules(module) as checkpointed:  # carried to the build in the graph's metadata
            onnx_model, lookups, trace_facts = trace.export_to_onnx(
                module, batch, loss_fn, self.forward_names, [(entry.name, entry.shape) for entry in desc.inputs],
                [(entry.name, entry.shape) for entry in desc.outputs], self.options._internal_use.onnx_opset_version,
                constants=constants, loss_index=loss_index,
            )  # fmt: skip
        recompute.mark_checkpointed(onnx_model, checkpointed)
        if bfloat16.casts_to_bfloat16(onnx_model):  # traced under torch.autocast
            onnx_model = bfloat16.compute_in_float32(onnx_model)
        state = {name: tensor.detach() for name, tensor in module.state_dict(keep_vars=True).items()}
        return TorchExport(batch, dict(constants), desc, outputs, state, onnx_model, lookups, trace_facts)


def from_torch(source, exported, device, providers, data_parallel=None, shared=None) -> Runtime:
    """Build the graph of ``exported``; its model_desc gets the dtypes of inputs and outputs.

    The first graph takes its weights from the module (on several ranks: checked against the
    other ranks' and synchronised). A later one, for another shape signature, gets ``shared``'s
    (a Runtime of this trainer): the same weight tensors, scales and torch-side state, so that
    one optimizer, one set of gradient buffers and one checkpoint serve every graph.
    """
    options, desc, module = source.options, exported.desc, source.module
    onnx_model = _postprocess(exported.onnx_model, options._internal_use.extra_postprocess)
    facts = tensor_facts.infer_tensor_facts(onnx_model)
    trainable = _trainable(module, onnx_model, desc.loss_output.name, options, facts)
    checked = options.debug.check_against_torch != "off" and not _random_draws_refuse_the_check(onnx_model)
    in_graph = _in_graph(onnx_model, exported.state)
    sample_shapes = {entry.name: list(tensor.shape) for entry, tensor in zip(desc.inputs, exported.inputs)}
    if shared is None:
        untrained = [name for name in in_graph if name not in trainable]
        weights = _module_tensors(exported.state, trainable + untrained)
        runtime = _build(onnx_model, desc, weights, trainable, options, device, providers, data_parallel, facts,
                         exported.lookups, sample_shapes=sample_shapes)  # fmt: skip
        runtime.aliases = _aliases(module)
        runtime.unexported_state = {name: tensor for name, tensor in exported.state.items()
                                    if name not in weights and name not in runtime.aliases}  # fmt: skip
        runtime.batch_counters = _batch_counters(module, exported.state)
    else:
        _check_same_weights(shared, in_graph, trainable)
        weights = {name: shared.weights[name] for name in in_graph}
        runtime = _build(onnx_model, desc, weights, trainable, options, device, providers, None, facts, exported.lookups,
                         shared.scales, sample_shapes)  # fmt: skip
        runtime.weights, runtime.owned = shared.weights, shared.owned
        runtime.aliases, runtime.unexported_state = shared.aliases, shared.unexported_state
        runtime.batch_counters = shared.batch_counters
    runtime.written_buffers = [_WrittenBuffer(name, output, exported.state[name], runtime.train_session)
                               for name, output in outputs_for_trainer.written_buffers(onnx_model).items()]  # fmt: skip
    if checked:  # the first train_step on this graph checks against torch, and the first eval_step
        runtime.reference = _torch_reference(source, exported)
        runtime.eval_reference = verify.ModuleCall(source.module, source.forward_names, exported.constants)
    for index, tensor in enumerate(exported.outputs):
        desc.add_type_to_output_description(index, tensor.dtype, getattr(desc.outputs[index], "dtype_amp", None))
    if options.debug.check_model_export:
        runtime.export_sample = (exported.inputs, exported.outputs)
    return runtime


def _torch_reference(source, exported) -> verify.Reference:
    """The torch side of the first-step check (torch's step is taken at the check, on the weights as they are then).
    Past ``verify.FULL_CHECK_BYTES`` of weights the gradients are kept as ``verify.Projected`` (said once)."""
    parameters = dict(source.module.named_parameters())
    projected = sum(tensor.numel() * tensor.element_size() for tensor in parameters.values()) > verify.FULL_CHECK_BYTES
    if projected:
        progress.say_once(f"the first-step check compares each gradient by {verify._PROJECTIONS} random projections "
                          f"(weights over {verify.FULL_CHECK_BYTES // 2**20} MiB: a second full set of gradients would "
                          "not fit in the memory torch's loop takes); outputs and buffers element by element")  # fmt: skip
    return verify.Reference(source.module, source.forward_names, exported.constants, projected)


def _module_tensors(state: dict, names) -> dict:
    """{name: the module's own tensor} of ``names``, which the sessions read in place: each must be one block of
    memory."""
    scattered = [name for name in names if not state[name].is_contiguous()]
    if scattered:
        raise ValueError(
            f"the module's tensors {scattered} are not contiguous in memory (a transposed view, e.g. "
            "nn.Parameter(w.t())): the trainer trains the module's own tensors in place, and ONNX Runtime reads each as "
            "one block; make them contiguous before the first step (with torch.no_grad(): p.data = p.data.contiguous())"
        )
    return {name: state[name] for name in names}


def _in_graph(onnx_model, state: dict) -> list:
    """The module's weights and buffers that the graph reads (graph inputs of the export), in state_dict order."""
    read = _graph_input_names(onnx_model)
    return [name for name in state if name in read]


def _graph_input_names(onnx_model) -> set:
    """The names of the graph's inputs and initializers: where a module's export reads its weights, or an extra
    postprocess (options._internal_use) may have put one."""
    return {value.name for value in [*onnx_model.graph.input, *onnx_model.graph.initializer]}


def _check_same_weights(shared, in_graph, trainable) -> None:
    """A graph for other shapes or constants must read and train the weights the trainer already holds."""
    new = [name for name in in_graph if name not in shared.weights]
    new += sorted(set(trainable) - set(shared.trainable) - set(new))
    untrained = sorted(set(shared.trainable) - set(trainable))
    if new or untrained:
        raise NotImplementedError(
            "the graph for this batch's shapes and Python values uses other weights than the graph of earlier batches"
            + (f" (only here: {new})" if new else "") + (f" (trained only there: {untrained})" if untrained else "")
            + ": a branch on the batch's shapes, on its values (a mixture of experts looping over the experts its tokens "
            "are routed to) or on a value passed to the step switches parameters, and orttrainer trains one fixed set of "
            "weights for every graph; pad the batches to one shape and keep such values, compute every expert for every "
            "token, or train this model with torch"
        )


def _forward_names(module, input_names, loss_fn) -> list:
    """The inputs that go to ``forward`` (all but the label); each must be one of its parameters (or a
    keyword its ``**kwargs`` declares, ``model_desc.forward_keywords``)."""
    label_count = 1 if loss_fn is not None else 0
    forward_names = input_names[: len(input_names) - label_count]
    signature = forward_parameters(module)
    accepted = set(signature) | set(forward_keywords(module))
    not_in_forward = [name for name in forward_names if name not in accepted]
    if not_in_forward:
        raise ValueError(f"inputs {not_in_forward} are not parameters of {type(module).__name__}.forward{tuple(signature)}")
    return forward_names


def _loss_index(model_desc, outputs, loss_fn, inferred: bool) -> int:
    """Where the loss is among the sample outputs; it must be a floating-point scalar."""
    loss_output = model_desc.loss_output
    loss_index = [entry.name for entry in model_desc.outputs].index(loss_output.name)
    if loss_fn is not None and loss_index != 0:
        raise ValueError(
            f"with a loss_fn the loss is the first output (loss_fn's result, then the model's outputs), but model_desc "
            f"lists '{loss_output.name}' at position {loss_index} of its outputs: list it first"
        )
    if len(outputs) != len(model_desc.outputs):
        raise ValueError(
            f"model_desc lists {len(model_desc.outputs)} outputs but the model"
            + (" + loss_fn" if loss_fn else "")
            + f" returns {len(outputs)}"
        )
    loss = outputs[loss_index]
    if loss_fn is None and inferred and (loss.dim() != 0 or not loss.is_floating_point()):
        raise ValueError(
            f"no loss_fn was given, so the model's first output is taken as the loss, but it has shape {list(loss.shape)} "
            f"dtype {loss.dtype}: pass loss_fn=(output, label) -> scalar loss (e.g. torch.nn.functional.cross_entropy) "
            "and the label as the batch's last input, or return the scalar loss first from forward"
        )
    if loss.dim() != 0 or not loss.is_floating_point():
        raise ValueError(
            f"the loss output '{loss_output.name}' must be a floating-point scalar, got shape {list(loss.shape)} "
            f"dtype {loss.dtype}; reduce it (e.g. .mean()) in the model or loss_fn"
        )
    return loss_index


def _postprocess(onnx_model, postprocess):
    """``_internal_use.extra_postprocess``: the user's function on the exported graph, which it
    may change in place or return changed (the first-step check compares the result with torch)."""
    if postprocess is None:
        return onnx_model
    returned = postprocess(onnx_model)
    if returned is not None and not isinstance(returned, onnx.ModelProto):
        raise TypeError(
            f"options _internal_use.extra_postprocess must change the onnx.ModelProto in place or return one, "
            f"got {type(returned).__name__}"
        )
    return returned if returned is not None else onnx_model


def _trainable(module, onnx_model, loss_name, options, facts) -> list:
    """The parameters with requires_grad (and not in utils.frozen_weights) that reach the loss; the
    graph's other weights and buffers are bound without a gradient."""
    in_graph = _graph_input_names(onnx_model)
    aliases = _aliases(module)  # a tied weight frozen by any of its names
    frozen_names = {aliases.get(name, name) for name in options.utils.frozen_weights}
    requires_grad = [
        name
        for name, parameter in module.named_parameters()
        if parameter.requires_grad and name in in_graph and name not in frozen_names
    ]
    if not requires_grad:  # as the legacy trainer: the step runs, the update has nothing to do
        warnings.warn(
            f"{type(module).__name__} has no parameter to train (none, all with requires_grad=False, or all in "
            "options utils.frozen_weights): train_step runs its forward and returns its outputs, and updates nothing"
        )
        return []
    # a weight that reaches only other outputs gets no gradient in torch (grad None): it is not trained
    return training_graph.weights_reaching_loss(onnx_model, requires_grad, loss_name, facts)


def _aliases(module: torch.nn.Module) -> dict:
    """{alias: first name} of tensors the module's state_dict lists under several names (tied weights)."""
    first, aliases = {}, {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        aliases.update({name: first[id(tensor)]} if id(tensor) in first else {})
        first.setdefault(id(tensor), name)
    return aliases


def _batch_counters(module: torch.nn.Module, state: dict) -> dict:
    """``num_batches_tracked`` of every BatchNorm that counts in the modes it trains in (the graph does not)."""
    with as_trained.as_trained(module):
        return {
            f"{path}.num_batches_tracked": state[f"{path}.num_batches_tracked"]
            for path, layer in module.named_modules()
            if isinstance(layer, torch.nn.modules.batchnorm._BatchNorm) and layer.track_running_stats and layer.training
        }


# -------------------------------------------------------------------- ONNX model
def from_onnx(model: onnx.ModelProto, options, model_desc, device, providers, data_parallel=None) -> Runtime:
    """An ONNX forward+loss model (the trainer's own copy): float initializers that reach the loss are
    trained, unless frozen or BatchNorm statistics. ``model_desc`` None: the graph's inputs and outputs,
    the first output the loss."""
    if amp.compute_dtype(options.mixed_precision) == torch.bfloat16:
        raise ValueError("options mixed_precision.dtype torch.bfloat16 trains a torch.nn.Module, whose forward is traced "
                         "under torch.autocast (its policy chooses what computes in bfloat16); an ONNX model has no such "
                         "policy: pass the torch module, or use mixed_precision.dtype torch.float16")
    graph_edits.name_unnamed_nodes(model.graph)
    model_desc = model_desc or _model_desc_of(model)
    frozen_names = set(options.utils.frozen_weights)
    weights = {
        init.name: torch.from_numpy(numpy_helper.to_array(init).copy()).to(device)
        for init in model.graph.initializer
        if session.torch_dtype(init.data_type).is_floating_point
    }
    buffers = outputs_for_trainer.batch_norm_statistics(model)
    candidates = [name for name in weights if name not in frozen_names and name not in buffers]
    facts = tensor_facts.infer_tensor_facts(model)
    trainable = training_graph.weights_reaching_loss(model, candidates, model_desc.loss_output.name, facts)
    return _build(model, model_desc, weights, trainable, options, device, providers, data_parallel, facts)


def _model_desc_of(model: onnx.ModelProto) -> _ORTTrainerModelDesc:
    initializer_names = {init.name for init in model.graph.initializer}
    inputs = [(i.name, _shape_of(i)) for i in model.graph.input if i.name not in initializer_names]
    outputs = [(o.name, _shape_of(o), index == 0) for index, o in enumerate(model.graph.output)]
    return _ORTTrainerModelDesc({"inputs": inputs, "outputs": outputs})


def _shape_of(value_info):
    return [dim.dim_param if dim.dim_param else dim.dim_value for dim in value_info.type.tensor_type.shape.dim]


# ----------------------------------------------------------------------- both
def _build(onnx_model, model_desc, weights, trainable, options, device, providers, data_parallel, facts, lookups=None,
           scales=None, sample_shapes=None):  # fmt: skip
    """Gradient and eval graphs, their sessions bound to ``weights`` (and ``scales``: (loss scale or
    None, dropout scale), new ones if None), and on several ranks the check that every rank built
    the same (then all start from rank 0's weights). ``sample_shapes``: {input: shape} of the batch
    the graph is built at, when there is one."""
    frozen = [name for name in weights if name not in trainable]
    mixed_precision = amp.scales_loss(options.mixed_precision)  # float16; a bfloat16 graph computes in float32 (bfloat16.py)
    one_thread = device.type == "cpu" and convolution_work.small_convolutions_dominate(onnx_model, sample_shapes or {})
    convolutions = _convolutions_on_torch(options, device, onnx_model, sample_shapes or {})
    products = _bfloat16_products_on_torch(options, device, onnx_model)
    nodes = onnx_model.graph.node
    keep_for_torch = torch_convolutions.op_types_for_torch(nodes) if convolutions and torch_convolutions.runs_convolutions(
        nodes) else ()  # fmt: skip
    described = progress.size_of(weights[name] for name in trainable)
    with progress.phase(f"built the training graph ({described} to train)"):
        graphs = training_graph.build_training_graphs(
            onnx_model, trainable, frozen, model_desc.loss_output.name, [entry.name for entry in model_desc.outputs],
            mixed_precision, on_cpu=device.type == "cpu", lookups=lookups, facts=facts, keep_for_torch=keep_for_torch,
            recurrent_on_torch=_splits_for_torch(options, device), sample_shapes=sample_shapes,
        )  # fmt: skip
        recompute.apply(graphs.train, options.graph_transformer, recompute.checkpointed(onnx_model),
                        [entry.name for entry in model_desc.inputs])  # fmt: skip
    _save_debug_graphs(graphs, options.debug.graph_save_paths)
    with progress.phase(f"opened the ONNX Runtime sessions on {device}"):
        sessions = _open_sessions(graphs, device, providers, options, one_thread, convolutions, products)
    _record_input_types(model_desc, graphs.eval)
    if scales is None:
        loss_scale = torch.tensor(options.mixed_precision.loss_scaler.loss_scale, device=device) if mixed_precision else None
        scales = (loss_scale, torch.tensor(1.0, device=device))
    runtime = Runtime(model_desc, onnx_model, graphs, sessions, weights, trainable, scales, device)
    if data_parallel is not None:
        runtime.owned = data_parallel.start(weights, trainable, _rank_fingerprint(weights, trainable, options))
    return runtime


def _convolutions_on_torch(options, device, onnx_model, sample_shapes: dict) -> bool:
    """Whether a graph's convolutions run on torch's kernels (torch_convolutions.py): on the CPU in float32,
    by ``utils.convolution_kernels``; "auto": where they are enough work per convolution on the batch
    of ``sample_shapes`` to pay for the boundaries (``convolution_work.convolutions_worth_splitting``;
    benchmarks/NOTES.md §18, §26, §34). Not when the optimized graph is saved (one graph to save)."""
    kernels = options.utils.convolution_kernels
    if not _splits_for_torch(options, device) or kernels == "onnxruntime":
        return False
    return kernels == "torch" or convolution_work.convolutions_worth_splitting(onnx_model, sample_shapes)


def _bfloat16_products_on_torch(options, device, onnx_model) -> bool:
    """Whether a bfloat16 graph's matrix products run on torch's bfloat16 kernels (torch_products.py), by
    ``utils.bfloat16_matmul_kernels``; "auto": on a CPU with bfloat16 instructions, where they run at several
    times ONNX Runtime's float32 rate (benchmarks/NOTES.md §57); elsewhere they would be slower, said once."""
    kernels = options.utils.bfloat16_matmul_kernels
    if not _splits_for_torch(options, device) or kernels == "onnxruntime" or not bfloat16.casts_to_bfloat16(onnx_model):
        return False
    if kernels == "torch" or torch_products.fast_on_this_cpu():
        return True
    warnings.warn("orttrainer: this CPU has no bfloat16 instructions (AVX512-BF16, AMX), so the bfloat16 graph's "
                  "matrix products run as float32 ones in ONNX Runtime; utils.bfloat16_matmul_kernels 'torch' runs them "
                  "on torch's bfloat16 kernels", stacklevel=2)  # fmt: skip
    return False


def _splits_for_torch(options, device) -> bool:
    """Whether graphs may be cut for torch's kernels: on the CPU in float32 or bfloat16 (torch's kernels there
    compute as the graph does; a float16 graph's would not), and not when the optimized graph is saved (one
    graph to save)."""
    return (
        device.type == "cpu"
        and not amp.scales_loss(options.mixed_precision)
        and not options.debug.graph_save_paths.model_with_training_graph_after_optimization_path
    )


def _open_sessions(graphs, device, providers, options, one_thread: bool, convolutions: bool, products: bool):
    """(training session, eval session); a training graph ONNX Runtime has no kernel for is named, and so is the
    node of a graph it rejects.

    On the CPU with ``convolutions`` (``_convolutions_on_torch``), a graph runs its convolutions and the
    ReLU gradients between them on torch's kernels (torch_convolutions.py); the segments between them run
    on one thread, where ONNX Runtime's second thread would only contend with torch's (benchmarks/NOTES.md
    §18). LSTMs, GRUs and RNNs run on torch's (torch_recurrent.py), and with ``products`` a bfloat16 graph's matrix
    products (torch_products.py).
    """
    debug, user = options.debug, options.session_options

    def open_session(model, use_all_threads=True, optimized_model_path=""):
        # the user's session_options, when given, serve every session with their threads
        threads = 1 if one_thread or (not use_all_threads and user is None) else None
        with session.options_for_one_session(user, debug.deterministic_compute, optimized_model_path, threads) as chosen:
            return session.TorchBoundSession(model, device, providers, chosen)

    splits = _splits_for_torch(options, device)  # LSTMs and GRUs whatever the convolutions do (§21)

    def open_graph(model, optimized_model_path=""):
        if splits and torch_convolutions.can_split(model, convolutions, products):
            return torch_convolutions.SplitSession(model, open_session, convolutions, products)
        if convolutions:  # what the build left for torch's kernels, which will not run it
            cpu_kernels.use_fast_cpu_kernels(model)
            # the build replaced every exact kernel but those it left for torch (MaxPool): not twice
            replaced = set(cpu_kernels.EXACT_CPU_KERNELS) - set(torch_convolutions.STEPS_BETWEEN_CONVOLUTIONS)
            cpu_kernels.use_exact_cpu_kernels(model, keep_op_types=replaced)
            defined_gradients.spell_forwards(model)
        if device.type == "cpu":
            training_graph.refuse_recurrent_layers_onnx_runtime_cannot_train(model)
        training_graph.refuse_pool_gradients_of_dynamic_sizes(model)
        return open_session(model, optimized_model_path=optimized_model_path)

    try:  # only the training graph goes to the save path: the eval session would overwrite it
        train = open_graph(graphs.train, debug.graph_save_paths.model_with_training_graph_after_optimization_path)
        return train, open_graph(graphs.eval)
    except onnxruntime.capi.onnxruntime_pybind11_state.NotImplemented as error:
        raise graph_errors.missing_kernel_error(error, device, graphs.train) from error
    except graph_errors.ONNX_RUNTIME_ERRORS as error:  # one that names a node: say which op, node and module
        found = graph_errors.node_error(error, "opening a session")
        if found is None:
            raise
        raise found from error


def _record_input_types(model_desc, eval_model) -> None:
    """Input dtypes from the graph; outputs the graph computes in float16 get ``dtype_amp``."""
    types = {graph_input.name: graph_input.type.tensor_type.elem_type for graph_input in eval_model.graph.input}
    for index, entry in enumerate(model_desc.inputs):
        if entry.name in types:
            model_desc.add_type_to_input_description(index, session.torch_dtype(types[entry.name]))
    output_types = {output.name: output.type.tensor_type.elem_type for output in eval_model.graph.output}
    for index, entry in enumerate(model_desc.outputs):
        if output_types.get(entry.name) == onnx.TensorProto.FLOAT16:
            model_desc.add_type_to_output_description(index, getattr(entry, "dtype", torch.float32), torch.float16)


def _save_debug_graphs(graphs, paths) -> None:
    """options debug.graph_save_paths."""
    if paths.model_with_gradient_graph_path:
        onnx.save(graphs.train, paths.model_with_gradient_graph_path)
    if paths.model_with_training_graph_path:
        onnx.save(graphs.train, paths.model_with_training_graph_path)
    if paths.model_after_graph_transforms_path:
        onnx.save(graphs.eval, paths.model_after_graph_transforms_path)


def _random_draws_refuse_the_check(model: onnx.ModelProto) -> bool:
    """Warn and return True when the forward draws random numbers besides dropout (a stochastic depth's
    bernoulli_, noise): torch and ONNX Runtime cannot draw them alike, so the first-step check could not
    compare (its rounding estimate, rerunning torch, would excuse any difference instead)."""
    draws = [graph_errors.describe_node(node) for node in model.graph.node if node.op_type in dropout.RANDOM_OPS]
    if draws:
        warnings.warn(
            f"orttrainer: debug.check_against_torch skipped for this graph: its forward draws random numbers, which torch "
            f"and ONNX Runtime cannot draw alike ({'; '.join(draws[:3])}); set debug.check_against_torch to 'off' to "
            "silence this"
        )
    return bool(draws)


def _rank_fingerprint(weights: dict, trainable, options) -> bytes:
    """What every rank must share: the weights (names, shapes, dtypes, which train) and the options.
    Not the graph: ranks may start on batches of other shapes, whose graphs differ (a sequence-first
    attention bakes its sizes in) while the model is the same."""
    described = sorted((name, tuple(tensor.shape), str(tensor.dtype), name in trainable) for name, tensor in weights.items())
    return repr((described, _comparable_options(options))).encode()


def _comparable_options(options):
    """The options every rank must share (its own rank numbers aside)."""
    validated = dict(options._validated_opts)
    validated["distributed"] = {k: v for k, v in validated["distributed"].items() if k not in ("world_rank", "local_rank")}
    return sorted((key, repr(value)) for key, value in validated.items() if key not in ("session_options", "lr_scheduler"))


# ------------------------------------------------------- what a step relies on
class _BatchNormStatistics:
    """Carries one BatchNorm's running statistics back into the trainer's buffers as torch computes them.

    ONNX Runtime overwrites the running-stat inputs in place and uses the biased batch
    variance; torch uses the unbiased one. With the old variance saved before the run,
    ``new = ort + (ort - momentum * old) / (n - 1)`` is torch's value.
    """

    def __init__(self, stats, weights, bound_session):
        self.names = (stats.mean_input, stats.var_input)
        self.mean = weights[stats.mean_input]
        self.var = weights[stats.var_input]
        self.momentum = stats.momentum
        self.module = graph_errors.module_path(stats.node_name)
        self.new_mean = torch.empty_like(self.mean)
        self.new_var = torch.empty_like(self.var)
        self.old_mean = torch.empty_like(self.mean)
        self.old_var = torch.empty_like(self.var)
        self.count = torch.empty((), dtype=torch.int64, device=self.var.device)
        bound_session.bind_output(stats.mean_output, self.new_mean)
        bound_session.bind_output(stats.var_output, self.new_var)
        bound_session.bind_output(stats.count_output, self.count)

    def save_old(self):
        self.old_mean.copy_(self.mean)
        self.old_var.copy_(self.var)

    def restore_old(self):
        """Undo the run: ONNX Runtime wrote the new statistics into the inputs in place."""
        self.mean.copy_(self.old_mean)
        self.var.copy_(self.old_var)

    @property
    def tensors(self) -> tuple:
        return self.mean, self.var

    def update(self):
        self.mean.copy_(self.new_mean)
        self.var.copy_(self.new_var + (self.new_var - self.momentum * self.old_var) / (self.count - 1))


class _WrittenBuffer:
    """Carries the value a training forward leaves in a buffer it writes in place (the graph's output ``output``,
    outputs_for_trainer.WRITTEN_PREFIX) into the module's buffer ``tensor`` after the run. The old value is kept
    for ``restore_old``, which undoes a step (the first-step check's run)."""

    def __init__(self, name: str, output: str, tensor: torch.Tensor, bound_session):
        self.names, self.tensors = (name,), (tensor,)
        self.new, self.old = torch.empty_like(tensor), torch.empty_like(tensor)
        bound_session.bind_output(output, self.new)

    def save_old(self):
        self.old.copy_(self.tensors[0])

    def restore_old(self):
        self.tensors[0].copy_(self.old)

    def update(self):
        self.tensors[0].copy_(self.new)


def _check_values_per_channel(batch_norms) -> None:
    """torch refuses training-mode batch norm over one value per channel (its variance is undefined);
    so does the trainer, after undoing what the run did to the running statistics."""
    if not batch_norms or int(torch.stack([bn.count for bn in batch_norms]).min()) > 1:
        return
    for batch_norm in batch_norms:
        batch_norm.restore_old()
    modules = [f"'{bn.module}'" for bn in batch_norms if int(bn.count) <= 1]
    raise ValueError(
        f"Expected more than 1 value per channel when training: batch norm {', '.join(modules)} got 1 value per channel "
        "for this batch (e.g. a batch of 1 into BatchNorm1d); torch raises the same error. Drop or pad such batches."
    )
