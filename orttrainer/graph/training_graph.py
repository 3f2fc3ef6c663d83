"""The forward+loss graph -> a training graph (with gradients) and an eval graph (build_training_graphs).

This is the only module that touches onnxruntime-training internals
(``GradientGraphBuilder``, ``get_optimized_model``), so that a new ONNX Runtime version
changes one file.

Training graph outputs, in order: the model_desc outputs, the new running statistics
of every BatchNormalization (``running_statistics``), the new values of the buffers forward writes
(``outputs_for_trainer.WRITTEN_PREFIX``), then ``<weight>_grad`` for every
trainable weight (``gradient_outputs``). Weights are graph inputs in both graphs, so both
sessions read the same torch memory.
"""

import copy
import re
from collections import defaultdict
from dataclasses import dataclass, field

import onnx
import onnxruntime
from onnx import helper, numpy_helper
from onnxruntime.capi._pybind_state import GradientGraphBuilder, get_optimized_model

from . import cpu_kernels, defined_gradients, rewrites
from .dropout import drop_zero_dropouts, dropout_ratio_times_input
from .early_gathers import gather_rows_early
from .eval_graph import set_inference_mode, take_branches
from .float16 import float32_gradient_kernels, scale_loss, to_mixed_precision
from .graph_edits import (
    drop_trailing_empty_inputs, name_unnamed_nodes, node_inputs, remove_unused, sort_topologically, with_ir_version,
)
from .graph_errors import GradientBuildError, describe_node, module_path, node_error
from .outputs_for_trainer import expose_running_statistics, split_embedding_lookups, written_buffers
from .tensor_facts import TensorFacts, infer_tensor_facts, shapes_at
from . import nodes_for_torch


# How many outputs an op must expose for its gradient builder to find what it needs.
_OUTPUTS_NEEDED_BY_GRADIENT = {
    "Dropout": 2,  # mask
    "SoftmaxCrossEntropyLoss": 2,  # log_prob
    "LayerNormalization": 3,  # mean, inv_std_var
    "SimplifiedLayerNormalization": 2,
    "MaxPool": 2,  # indices
}

# Ops measured to have no gradient builder in onnxruntime-training 1.19 (docs/stack_facts.md, "Gradient graphs").
OPS_WITHOUT_GRADIENT = frozenset(
    """Softplus Elu Selu Celu PRelu HardSigmoid Mish Softsign InstanceNormalization
    ReduceMax ReduceMin ReduceProd ReduceL1 ReduceLogSum ReduceSumSquare Sum Mean CumSum Einsum
    Sinh Cosh Asinh Acosh Atanh Floor Ceil Round Sign Mod GridSample
    DepthToSpace SpaceToDepth LpNormalization LRN RNN""".split()
)

# Control flow before the loss makes the 1.19 gradient builder abort the whole process (a C++
# assertion), even when no weight is inside it; the exporter emits an If for ``squeeze()`` of a
# dimension whose size it cannot tell.
_CONTROL_FLOW = ("If", "Loop", "Scan")

# Inputs whose gradient onnxruntime-training 1.19 cannot build, by op type: {input index: what it is}.
_INPUTS_WITHOUT_GRADIENT = {"Pow": {1: "the exponent"}}


@dataclass
class TrainingGraphs:
    """What :func:`build_training_graphs` returns."""

    train: onnx.ModelProto
    eval: onnx.ModelProto
    gradient_outputs: dict = field(default_factory=dict)  # weight name -> gradient output name
    running_statistics: list = field(default_factory=list)  # RunningStatistics per BatchNormalization
    embedding_gradients: list = field(default_factory=list)  # EmbeddingGradient per lookup


def refuse_recurrent_layers_onnx_runtime_cannot_train(model: onnx.ModelProto) -> None:
    """Raise GradientBuildError for a recurrent layer onnxruntime-training 1.19's CPU kernels cannot
    train, before they fail at session creation or in a run: an LSTM or GRU going the other way through
    its sequence (they take the forward direction only, docs/stack_facts.md), and an RNN, whose
    gradient node is a placeholder only torch runs (torch_recurrent.py); and a CTC loss, which only torch
    runs (torch_ctc.py). Called for training graphs that stay on ONNX Runtime, and their eval graphs."""
    refuse_ctc_losses(model, f"{_CTC_ON_TORCH}, and this one cannot be split (it holds control flow, or an output no node "
                             "computes)")  # fmt: skip
    for node in model.graph.node:
        if nodes_for_torch.kind_of(node) is nodes_for_torch.RNN and node.op_type == nodes_for_torch.RNN.backward:
            forward = node.name.split("_Grad/")[0]
            where = f", module '{module_path(forward)}'" if module_path(forward) else ""
            raise GradientBuildError(f"RNN (node '{forward}'{where}): this graph cannot be split for torch's kernels (it "
                                     f"holds control flow, or an output no node computes){_RNN_HINT}")  # fmt: skip
        if node.op_type in ("LSTMTraining", "GRUTraining"):
            direction = nodes_for_torch.direction(node)
            if direction != "forward":
                raise GradientBuildError(
                    f"{describe_node(node)}: a {direction} {node.op_type[:-len('Training')]} trains only on torch's kernels "
                    "(onnxruntime-training's go forward only), which orttrainer uses on the CPU in float32 unless "
                    "mixed precision, debug.graph_save_paths.model_with_training_graph_after_optimization_path or "
                    "control flow in the graph keeps it on ONNX Runtime's. Train this model without those."
                )


def refuse_pool_gradients_of_dynamic_sizes(model: onnx.ModelProto) -> None:
    """Raise GradientBuildError for ONNX Runtime's MaxPoolGrad in a graph whose inputs leave sizes past the batch
    dynamic (an image's height and width): the kernel takes the sizes of the gradient it writes from the graph when
    the session opens (but the batch's, from dy in each run), and wrote past its buffer at a run (a segmentation
    fault). Called for graphs that stay on ONNX Runtime's kernels (mixed precision keeps its MaxPoolGrad); the
    trainer then builds such a graph per size."""
    gradient = next((node for node in model.graph.node if node.op_type == "MaxPoolGrad"), None)
    free = [graph_input.name for graph_input in model.graph.input
            if any(not dim.HasField("dim_value") for dim in graph_input.type.tensor_type.shape.dim[1:])]  # fmt: skip
    if gradient is not None and free:
        raise GradientBuildError(f"{describe_node(gradient)}: ONNX Runtime's MaxPoolGrad needs the sizes of its input "
                                 f"known when the session opens (all but the batch's), and inputs {free} leave some "
                                 "dynamic; give model_desc fixed sizes for them")  # fmt: skip


def refuse_ctc_losses(model: onnx.ModelProto, why: str, error=None) -> None:
    """Raise ``error`` (GradientBuildError by default) naming the first CTC loss in ``model`` (ONNX Runtime has none,
    torch_ctc.py), followed by ``why`` it cannot be run here."""
    for node in model.graph.node:
        if nodes_for_torch.is_ctc_loss(node):
            where = f", module '{module_path(node.name)}'" if module_path(node.name) else ""
            raise (error or GradientBuildError)(f"ctc_loss (node '{node.name}'{where}): ONNX Runtime has no CTC loss; {why}")


_CTC_ON_TORCH = "orttrainer runs it on torch's kernel, in a graph split for torch's kernels"


# elem_type 0: shape inference could not tell, so assume it may carry a gradient.
_MAYBE_FLOAT = {0, onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}


def _is_stop_gradient(node: onnx.NodeProto) -> bool:
    """An Identity standing for torch's detach (exported_graph.resolve_markers)."""
    return node.op_type == "Identity" and node.doc_string == rewrites.STOP_GRADIENT


def _nodes_reading(model: onnx.ModelProto, sources, elem_types: dict) -> list:
    """Nodes that read a floating-point value computed from ``sources``, in graph order.

    Integer tensors (shapes, indices) carry no gradient, and a detach none on, so values computed from them are not.
    """
    downstream = set(sources)
    found = []
    for node in model.graph.node:  # exported graphs are topologically sorted
        if any(name in downstream for name in node_inputs(node)):
            if not _is_stop_gradient(node):
                downstream.update(name for name in node.output if elem_types.get(name, 0) in _MAYBE_FLOAT)
            found.append(node)
    return found


def _nodes_between(model: onnx.ModelProto, sources, target: str, facts: TensorFacts = None):
    """Nodes on a floating-point path from any of ``sources`` to ``target`` (not through a detach)."""
    elem_types = (facts or infer_tensor_facts(model)).elem_types
    forward = [node for node in _nodes_reading(model, sources, elem_types) if not _is_stop_gradient(node)]
    upstream = {target}
    on_path = []
    for node in reversed(forward):
        if any(name in upstream for name in node.output):
            # not through integer inputs: the indices of a gather carry no gradient back to what chose them (argmax)
            upstream.update(name for name in node_inputs(node) if name and elem_types.get(name, 0) in _MAYBE_FLOAT)
            on_path.append(node)
    return list(reversed(on_path))


def _control_flow_before(model: onnx.ModelProto, loss_name: str) -> list:
    """The If/Loop/Scan nodes whose outputs the loss depends on."""
    upstream, found = {loss_name}, []
    for node in reversed(model.graph.node):  # exported graphs are topologically sorted
        if any(name in upstream for name in node.output):
            upstream.update(name for name in node.input if name)
            found += [node] if node.op_type in _CONTROL_FLOW else []
    return found[::-1]


def weights_reaching_loss(model: onnx.ModelProto, weight_names, loss_name: str, facts: TensorFacts = None) -> list:
    """The weights read by some node on a path to the loss (the others get no gradient)."""
    read = {name for node in _nodes_between(model, weight_names, loss_name, facts) for name in node_inputs(node)}
    return [name for name in weight_names if name in read]


def make_differentiable(model: onnx.ModelProto, weight_names, loss_name: str, facts: TensorFacts = None,
                        recurrent_on_torch: bool = False) -> None:
    """Rewrite (rewrites.py) the ops between weights and loss that have no usable gradient, then
    raise one GradientBuildError listing every op on that path that still has none.

    A rewrite keeps its node's inputs and outputs, so the path found before rewriting holds after. The path does
    not pass a detach (``stop_gradients`` cuts them later, after a conversion to float16). With
    ``recurrent_on_torch`` (the graph will be split for torch's recurrent kernels) an RNN torch can run trains.
    """
    on_path = _nodes_between(model, weight_names, loss_name, facts)
    without_gradient = [(node.name, describe_node(node) + _RNN_HINT * (node.op_type == "RNN")) for node in on_path
                        if node.op_type in OPS_WITHOUT_GRADIENT and not rewrites.is_torch_hard_sigmoid(node)
                        and not (recurrent_on_torch and _torch_trains_rnn(node))]  # fmt: skip
    untrainable_inputs = _untrainable_inputs(on_path, weight_names)
    try:
        rewritten = set(rewrites.rewrite_for_training(model, only_between={node.name for node in on_path}))
    except rewrites.RewriteError as error:
        where = module_path(error.node_name)
        raise GradientBuildError("cannot make this op differentiable" + (f" in module '{where}'" if where else "")
                                 + f": {error}") from error  # fmt: skip
    _read_weights_once_per_node(model, weight_names)
    missing = [description for name, description in without_gradient if name not in rewritten] + untrainable_inputs
    missing += [f"{describe_node(node)}: control flow, which the exporter writes e.g. for squeeze() of a dimension it "
                "cannot size (squeeze a known dimension, or index it with [:, 0]) and for repeat_interleave by repeats "
                "held in a tensor (repeat by a Python number, or gather by indices)"
                for node in _control_flow_before(model, loss_name)]  # fmt: skip
    if missing:
        listed = "; ".join(missing)
        raise GradientBuildError(f"onnxruntime-training has no gradient for these ops between the weights and the loss: {listed}")


_RNN_HINT = (" (an RNN trains on torch's kernels only, which orttrainer uses on the CPU in float32, without mixed precision "
             "or debug.graph_save_paths.model_with_training_graph_after_optimization_path, for a tanh or relu RNN over "
             "sequences of full length)")  # fmt: skip


def _torch_trains_rnn(node: onnx.NodeProto) -> bool:
    """An RNN node torch's kernels compute, with its six inputs (its gradient's definition reads them by position)."""
    return node.op_type == "RNN" and len(node.input) == 6 and nodes_for_torch.torch_can_run(node)


_DETACHED_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)


def stop_gradients(model: onnx.ModelProto, sources) -> None:
    """Replace each detach that reads a value computed from ``sources`` by ``rewrites.detached``: the same values,
    on no path the gradient builder follows (it follows an Identity). Other detaches stay Identities. The sources
    are what the builder differentiates for: the weights and the rows of their embedding lookups
    (``split_embedding_lookups``), so that a detach of looked-up rows (a VQ-VAE's ``q.detach()``) passes them none.

    Run on the graph as the builder gets it (float16 under mixed precision: ``rewrites.detached`` works in
    float32, which holds every float16 value exactly).
    """
    if not any(_is_stop_gradient(node) for node in model.graph.node):
        return
    sort_topologically(model.graph)  # the float16 conversion appends its casts of the weights
    elem_types = infer_tensor_facts(model).elem_types
    cut = [node for node in _nodes_reading(model, sources, elem_types) if _is_stop_gradient(node)]
    unsupported = [node for node in cut if elem_types.get(node.input[0], 0) not in (*_DETACHED_TYPES, 0)]
    if unsupported:
        raise GradientBuildError("detach() of a value computed from the weights is supported for float32 and float16 "
                                 "values; " + "; ".join(f"{describe_node(node)} detaches a "
                                                        f"{onnx.TensorProto.DataType.Name(elem_types[node.input[0]])} value"
                                                        for node in unsupported))  # fmt: skip
    detached_types = {node.name: elem_types.get(node.input[0], 0) or onnx.TensorProto.FLOAT for node in cut}
    rewrites.replace_nodes(model, {"Identity": lambda build: rewrites.stop_gradient(build, detached_types[build.node.name])}, cut)


def _private_normalization_constants(model: onnx.ModelProto, weight_names) -> None:
    """Give each BatchNormalization its own copy of a constant scale or bias that another node, or its own running
    variance, also reads. ONNX Runtime's optimizer merges equal constants (the ones of every affine-free
    ``F.batch_norm``, BiT's weight standardization), and the gradient builder names each node's scale and bias
    gradients '<input>_grad', needed or not: two nodes on one constant failed with a duplicate definition."""
    initializers = {initializer.name: initializer for initializer in model.graph.initializer}
    readers = defaultdict(int)
    for node in model.graph.node:
        for name in node.input:
            readers[name] += 1
    for node in model.graph.node:
        if node.op_type not in ("BatchNormalization", "BatchNormInternal"):  # the optimizer's training form is the second
            continue
        for index in (1, 2):
            name = node.input[index] if len(node.input) > index else ""
            if name in initializers and name not in weight_names and readers[name] > 1:
                private = numpy_helper.from_array(numpy_helper.to_array(initializers[name]), f"{name}.{node.name}")
                model.graph.initializer.append(private)
                node.input[index] = private.name


def _read_weights_once_per_node(model: onnx.ModelProto, weight_names) -> None:
    """A node that reads one weight at several inputs (``w * w``, ``torch.square(w)``) reads it again through an
    Identity: the gradient builder names the gradient of each such input '<weight>_grad' and fails on the duplicate;
    through the Identity the two are summed, as torch sums them."""
    weights, nodes = set(weight_names), []
    for node in model.graph.node:
        read = set()
        for index, name in enumerate(node.input):
            if name in weights and name in read:
                again = f"{name}.read_again.{node.name}.{index}"
                nodes.append(helper.make_node("Identity", [name], [again], name=again))
                node.input[index] = again
            read.add(name)
        nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def _untrainable_inputs(on_path, weight_names) -> list:
    """Descriptions of the ops on the path whose input carrying a gradient has no gradient
    builder (onnxruntime-training 1.19 builds none for Pow's exponent)."""
    carrying = set(weight_names) | {name for node in on_path for name in node.output}
    return [f"{describe_node(node)}, its input {index} ({what})" for node in on_path
            for index, what in _INPUTS_WITHOUT_GRADIENT.get(node.op_type, {}).items()
            if len(node.input) > index and node.input[index] in carrying]  # fmt: skip


def _add_outputs_needed_by_gradients(model: onnx.ModelProto) -> None:
    """Expose the optional outputs (masks, log_prob, statistics) gradient builders read."""
    for node in model.graph.node:
        needed = _OUTPUTS_NEEDED_BY_GRADIENT.get(node.op_type, 0)
        while len(node.output) < needed:
            node.output.append(f"{node.name}.output{len(node.output)}")
        for index in range(needed):
            if not node.output[index]:
                node.output[index] = f"{node.name}.output{index}"


def _builder_error(error: Exception, graph: onnx.GraphProto) -> GradientBuildError:
    """Translate the C++ builder's (or its graph optimizer's) message into one that names the op, node and module."""
    found = re.search(r"has not been registered: (\S+) for node (\S+)", str(error))
    if found:
        node = next((node for node in graph.node if node.name == found.group(2)), None)
        what = describe_node(node) if node is not None else f"{found.group(1)} (node '{found.group(2)}')"
        return GradientBuildError(f"onnxruntime-training has no gradient for {what}")
    doing = "building the gradient graph"
    return node_error(error, doing) or GradientBuildError(f"{doing} failed: {error}")


def _quiet_session_options() -> onnxruntime.SessionOptions:
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3  # the graph builder logs every transformer at INFO level
    return options


def build_training_graphs(forward: onnx.ModelProto, trainable, frozen, loss_name: str, output_names,
                          mixed_precision: bool = False, on_cpu: bool = False, lookups=None,
                          facts: TensorFacts = None, keep_for_torch=(), recurrent_on_torch: bool = False,
                          sample_shapes=None) -> TrainingGraphs:
    """Build the training graph (outputs, running stats, gradients) and the eval graph.

    ``forward`` is the forward+loss graph with weights as initializers; ``trainable``
    weights get gradients, ``frozen`` ones (buffers included) become inputs without.
    With ``mixed_precision`` both graphs compute in float16, and the gradients are those
    of the loss times the ``float16.LOSS_SCALE_INPUT`` input. ``on_cpu`` (the graphs run on the CPU)
    replaces, in float32 graphs, kernels measured slow there by fast equivalents and ones that
    differ from torch's by exact ones (``cpu_kernels``), and writes grouped 1-d and 3-d convolutions in a
    form whose gradient ONNX Runtime's CPU kernel computes in bounds (``rewrites.grouped_convolutions``),
    but for the op types ``keep_for_torch``
    (torch's kernels will run them, torch_convolutions.py), which also keep their forward nodes of a
    defined gradient unspelled (``defined_gradients.spell_forwards``). ``recurrent_on_torch``: the sessions
    will run recurrent layers and CTC losses on torch's kernels (torch_recurrent.py, torch_ctc.py), so an RNN
    and a CTC loss train (without it, a CTC loss is refused).
    ``lookups`` ({Gather node name: exported_graph.EmbeddingLookup}) carry torch's embedding gradient rules;
    ``facts`` (``infer_tensor_facts(forward)``), when the caller has them, spare an inference.
    ``sample_shapes`` ({graph input: shape} of the batch the graph is built at) let Gathers of rows move above the
    row-wise ops that computed them (``early_gathers``), so that those compute only the rows read.
    """
    if not recurrent_on_torch:
        refuse_ctc_losses(forward, f"{_CTC_ON_TORCH}, which orttrainer makes on the CPU only, without mixed precision or "
                                   "debug.graph_save_paths.model_with_training_graph_after_optimization_path")  # fmt: skip
    model = with_ir_version(rewrites.copy_with_inputs_for(forward, list(trainable) + list(frozen)))
    name_unnamed_nodes(model.graph)
    drop_trailing_empty_inputs(model.graph)
    drop_zero_dropouts(model)
    if sample_shapes and gather_rows_early(model, sample_shapes, kept=set(lookups or {})):
        facts = None  # they describe the tensors of ``forward``
    rewrites.explicit_convolution_pads(model)
    eval_model = copy.deepcopy(model)
    set_inference_mode(eval_model)
    take_branches(model, training=True)
    if mixed_precision:
        eval_model = to_mixed_precision(eval_model, [loss_name])

    make_differentiable(model, trainable, loss_name, facts, recurrent_on_torch)
    if on_cpu:
        rewrites.grouped_convolutions(model)
    if on_cpu and not mixed_precision:
        cpu_kernels.pool_before_relu(model)
    input_names = {graph_input.name for graph_input in model.graph.input}
    running_statistics = expose_running_statistics(model, input_names)
    embeddings = split_embedding_lookups(model, set(trainable), lookups or {})
    # a weight only looked up no longer does; inferred again: the rewrites added tensors the facts do not know
    graph_trainable = weights_reaching_loss(model, trainable, loss_name)
    rows = [embedding.rows_gradient[: -len("_grad")] for embedding in embeddings]
    model.graph.output.extend(helper.make_empty_tensor_value_info(embedding.indices_output) for embedding in embeddings)
    gradient_of = loss_name
    if mixed_precision:
        kept = [loss_name] + [o.name for o in model.graph.output if o.name not in output_names]
        model = to_mixed_precision(model, kept)
        gradient_of = scale_loss(model, loss_name)
    stop_gradients(model, [*graph_trainable, *rows])
    dropout_ratio_times_input(model, scalable=not mixed_precision)
    rewrites.quotients_kept_apart(model)
    options = _quiet_session_options()
    try:
        optimized = onnx.load_from_string(get_optimized_model(model.SerializeToString(), set(graph_trainable), options))
    except RuntimeError as error:
        raise _builder_error(error, model.graph) from error
    _add_outputs_needed_by_gradients(optimized)
    _private_normalization_constants(optimized, set(graph_trainable))
    defined_gradients.register_gradient_definitions()
    try:
        builder = GradientGraphBuilder(optimized.SerializeToString(), {gradient_of}, set(graph_trainable) | set(rows), gradient_of, options)
        builder.build()
    except RuntimeError as error:
        raise _builder_error(error, optimized.graph) from error
    train_model = onnx.load_from_string(builder.get_model())
    nodes_for_torch.complete_rnn_gradients(train_model)
    drop_empty_broadcast_reductions(train_model, model, sample_shapes)
    defined_gradients.zero_gradient_at_bounds(train_model)
    defined_gradients.torch_cumprod_gradients(train_model)
    defined_gradients.spell_forwards(train_model, keep_for_torch)
    defined_gradients.spell_forwards(eval_model, keep_for_torch)
    if on_cpu:
        for graph_model in (train_model, eval_model):
            cpu_kernels.centered_layer_norms(graph_model)
    if mixed_precision:
        float32_gradient_kernels(train_model)
    elif on_cpu:
        for graph_model in (train_model, eval_model):
            cpu_kernels.use_fast_cpu_kernels(graph_model, keep_for_torch, model)
            cpu_kernels.use_exact_cpu_kernels(graph_model, keep_for_torch)
    written = list(written_buffers(forward).values())
    gradient_outputs = _order_outputs(train_model, trainable, graph_trainable, output_names, running_statistics, written,
                                      embeddings)  # fmt: skip
    return TrainingGraphs(with_ir_version(train_model), eval_model, gradient_outputs, running_statistics, embeddings)


def _keeps_its_shape(own, other, own_sample=None, other_sample=None) -> bool:
    """Whether a tensor of shape ``own`` keeps it when broadcast with one of shape ``other`` (sizes, symbolic
    names, None where unknown): it has as many dims or more, and on each it has a static size above 1, the
    same size or name as the other (a name stands for one size in a graph: model_desc's check), the other's is
    a static 1, or both had the same size above 1 at the batch the graph is built at (``*_sample``: two sizes that
    broadcast at every batch and are equal and not 1 at one are the same size)."""
    if own is None or other is None or len(own) < len(other):
        return False
    samples = zip(reversed(own_sample), reversed(other_sample)) if own_sample and other_sample else ()
    same_at_sample = [isinstance(mine, int) and mine == theirs and mine > 1 for mine, theirs in samples]
    same_at_sample += [False] * (len(other) - len(same_at_sample))
    return all((mine is not None and ((isinstance(mine, int) and mine > 1) or mine == theirs)) or theirs == 1 or same
               for mine, theirs, same in zip(reversed(own), reversed(other), same_at_sample))  # fmt: skip


def _reduced_operand_keeps_its_shape(node, shape_of, nodes_by_name: dict, shapes: dict, samples: dict) -> bool:
    """For a ReduceSum that reads the axes ``BroadcastGradientArgs(Shape(a), Shape(b))`` gives one of a and b:
    whether that operand can never have been broadcast, from the forward graph's shapes (``samples``: at the batch
    it is built at)."""
    arguments = shape_of.get(node.input[1])
    if arguments is None:
        return False
    operands, position = arguments
    own, other = (shapes.get(name) for name in (operands[position], operands[1 - position]))
    if other is not None:
        return _keeps_its_shape(own, other, samples.get(operands[position]), samples.get(operands[1 - position]))
    # a MatMul's gradient compares the operand with its gradient before the reduction
    matmul = nodes_by_name.get(node.name.rpartition("_Grad/")[0])
    if matmul is None or matmul.op_type != "MatMul" or operands[position] not in matmul.input[:2] or own is None:
        return False
    other_name = matmul.input[1 - list(matmul.input).index(operands[position])]
    other = shapes.get(other_name)
    own_sample, other_sample = samples.get(operands[position]), samples.get(other_name)
    return other is not None and len(own) >= 2 and _keeps_its_shape(
        own[:-2], other[:-2] if len(other) > 2 else [], own_sample and own_sample[:-2],
        other_sample and (other_sample[:-2] if len(other_sample) > 2 else []))  # fmt: skip


def drop_empty_broadcast_reductions(model: onnx.ModelProto, forward: onnx.ModelProto, sample_shapes=None) -> None:
    """Remove, in place, the gradient builder's broadcast reductions that never reduce.

    Where it cannot see an operand's shape at build time, the builder sums the gradient over the axes
    ``BroadcastGradientArgs`` finds at run time (``ReduceSum`` with ``noop_with_empty_axes``). When the
    operand was not broadcast that sum is a copy of the gradient: 26 of them cost 2.9 ms of the encoder's
    step (benchmarks/NOTES.md §36). Those whose operand provably keeps its shape, by the shapes of the
    ``forward`` graph (``rewrites.symbolic_shapes``: a bias add's input, a residual sum of two [batch, ...]
    tensors, a MatMul's operand against a matrix, a product with a scalar) are skipped; the rest stay.
    With lengths dynamic the shapes lose them after a Reshape: the sizes at ``sample_shapes`` ({graph input: shape}
    of the batch the graph is built at) then tell (``_keeps_its_shape``).
    """
    if not any(node.op_type == "BroadcastGradientArgs" for node in model.graph.node):
        return  # a CNN's graph, typically: no shape inference for nothing
    shapes = rewrites.symbolic_shapes(forward)
    samples = shapes_at(forward, sample_shapes) if sample_shapes else {}
    producers = {output: node for node in model.graph.node for output in node.output}
    nodes_by_name = {node.name: node for node in model.graph.node}
    shape_of = {}  # axes tensor -> ((a, b), position) of the BroadcastGradientArgs that gives it
    for node in model.graph.node:
        if node.op_type == "BroadcastGradientArgs":
            sources = [producers.get(name) for name in node.input]
            if all(source is not None and source.op_type == "Shape" for source in sources):
                operands = tuple(source.input[0] for source in sources)
                shape_of.update({axes: (operands, position) for position, axes in enumerate(node.output) if axes})
    graph_outputs = {output.name for output in model.graph.output}
    renamed = {}
    for node in model.graph.node:
        if (node.op_type == "ReduceSum" and len(node.input) > 1 and node.output[0] not in graph_outputs
                and _reduced_operand_keeps_its_shape(node, shape_of, nodes_by_name, shapes, samples)):  # fmt: skip
            renamed[node.output[0]] = node.input[0]
    if not renamed:
        return

    def source(name):
        while name in renamed:
            name = renamed[name]
        return name

    for node in model.graph.node:
        node.input[:] = [source(name) for name in node.input]
    remove_unused(model.graph)


def _order_outputs(train_model, trainable, graph_trainable, output_names, running_statistics, written, embeddings) -> dict:
    """Put the training graph's outputs in the documented order (module docstring); return
    {weight: gradient output}. Every trainable weight must have its gradient (or embedding rows)."""
    gradient_outputs = {name: f"{name}_grad" for name in graph_trainable}
    by_name = {output.name: output for output in train_model.graph.output}
    looked_up = {embedding.weight for embedding in embeddings}
    missing = [name for name in trainable if name not in gradient_outputs and name not in looked_up]
    missing += [name for name in list(gradient_outputs.values()) + [e.rows_gradient for e in embeddings] if name not in by_name]
    if missing:
        raise GradientBuildError(f"the gradient graph has no output for {missing}: these weights do not reach the loss")
    stat_outputs = [name for stats in running_statistics for name in (stats.mean_output, stats.var_output, stats.count_output)]
    embedding_outputs = [name for e in embeddings for name in (e.rows_gradient, e.indices_output)]
    ordered = list(output_names) + stat_outputs + list(written) + list(gradient_outputs.values()) + embedding_outputs
    del train_model.graph.output[:]
    train_model.graph.output.extend(
        by_name[name] if name in by_name else helper.make_empty_tensor_value_info(name) for name in ordered
    )
    return gradient_outputs
