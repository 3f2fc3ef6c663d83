"""ONNX rewrites: the forward+loss graph -> a training graph (with gradients) and an eval graph.

This is the only module that touches onnxruntime-training internals
(``GradientGraphBuilder``, ``get_optimized_model``), so that a new ONNX Runtime version
changes one file.

Training graph outputs, in order: the model_desc outputs, the new running statistics
of every BatchNormalization (``running_statistics``), then ``<weight>_grad`` for every
trainable weight (``gradient_outputs``). Weights are graph inputs in both graphs, so both
sessions read the same torch memory.
"""

import copy
import re
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnxruntime
from onnx import helper, numpy_helper
from onnxruntime.capi._pybind_state import GradientGraphBuilder, get_optimized_model

from . import cpu_kernels, defined_gradients, rewrites
from ..runtime import torch_ctc, torch_recurrent

MAX_IR_VERSION = 10  # the highest IR version ONNX Runtime 1.19 loads

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

LOSS_SCALE_INPUT = "orttrainer.loss_scale"
DROPOUT_SCALE_INPUT = "orttrainer.dropout_scale"  # float scalar times every dropout ratio: 1 trains, 0 turns dropout off
_SCALED_LOSS = "orttrainer.scaled_loss"

# Kept in float32 under mixed precision: losses, normalisation statistics, softmax, exp/log
# and reductions (torch autocast's float32 list), besides the converter's own defaults;
# Slice, whose gradient has no float16 CPU kernel in ONNX Runtime 1.19; and MaxPool, whose
# float16 training graph crashes ONNX Runtime 1.19's session creation (segmentation fault);
# HardSwish and HardSigmoid, whose forwards defined_gradients spells out with float32 constants after the build;
# LSTM and GRU, whose training kernels in onnxruntime-training 1.19 take float32 only; ScatterElements and ScatterND,
# which sum in float32 only on the CPU (reduction 'add': scatter_add, index_add, index_put with accumulate=True).
_FLOAT32_OPS = [
    "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss", "Softmax", "LogSoftmax", "LayerNormalization",
    "BatchNormalization", "InstanceNormalization", "ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2",
    "ReduceLogSumExp", "Exp", "Log", "Pow", "Sqrt", "Reciprocal", "Div", "CumSum", "Erf", "Slice", "MaxPool", "HardSwish",
    "HardSigmoid", "LSTM", "GRU", "ScatterElements", "ScatterND",
]  # fmt: skip


# Below this many multiply-accumulates per image, a convolution is cheaper on one CPU thread
# than the thread-pool wake-ups ONNX Runtime's Conv/ConvGrad pay per image (benchmarks/NOTES.md §8).
SMALL_CONVOLUTION_MACS = 1_000_000
# Below this many multiply-accumulates per convolution on a batch (their total over the batch divided by
# their number), a graph runs faster whole than cut for torch's convolutions: each convolution adds
# boundaries that cost the same at any batch size, while what torch's kernels save grows with the
# batch (benchmarks/NOTES.md §26, §34).
SPLIT_CONVOLUTION_MACS = 3_000_000


class GradientBuildError(RuntimeError):
    """The gradient graph cannot be built; the message names the op types, nodes and modules."""


@dataclass
class EmbeddingGradient:
    """An embedding lookup whose weight gradient the trainer computes with torch.

    ONNX Runtime's CPU GatherGrad takes a lock per element (77 ms of a 240 ms encoder step);
    instead the Gather reads ``lookup_input`` (bound to the weight's memory, no gradient),
    the graph returns the gradient of the looked-up rows and the indices, and the trainer
    scatter-adds them into the weight's gradient with ``index_add_``.
    """

    weight: str
    lookup_input: str
    rows_gradient: str
    indices_output: str
    padding_idx: int = -1  # this row gets no gradient from this lookup (-1: none)
    scale_grad_by_freq: bool = False  # divide each row's gradient by its count in the batch


@dataclass
class TrainingGraphs:
    """What :func:`build_training_graphs` returns."""

    train: onnx.ModelProto
    eval: onnx.ModelProto
    gradient_outputs: dict = field(default_factory=dict)  # weight name -> gradient output name
    running_statistics: list = field(default_factory=list)  # RunningStatistics per BatchNormalization
    embedding_gradients: list = field(default_factory=list)  # EmbeddingGradient per lookup


def module_path(node_name: str) -> str:
    """The torch module a node came from, from the TorchScript exporter's scoped name.

    Each scope level is an attribute name, except numbered children, which carry their
    parent's name: ``/model/layer/self_attn/Softmax`` -> ``layer.self_attn``,
    ``/model/features/features.1/Conv`` -> ``features.1``; ``""`` when unknown.
    """
    levels = [part for part in node_name.split("/") if part][:-1]
    if levels and levels[0] == "model":  # the attribute under which export.py wraps the user's module
        levels = levels[1:]
    numbered_root = bool(levels) and levels[0].startswith("model.")  # children of a Sequential root: model.0, ...
    path = ""
    for level in levels:
        path = level if not path or level.startswith(path + ".") else f"{path}.{level}"
    return path[len("model.") :] if numbered_root else path


# Ops that draw random numbers (Dropout aside, which the trainer turns off for the first-step check).
RANDOM_OPS = ("RandomUniform", "RandomUniformLike", "RandomNormal", "RandomNormalLike", "Multinomial", "Bernoulli")


def describe_node(node: onnx.NodeProto) -> str:
    where = module_path(node.name)
    return f"{node.op_type} (node '{node.name}'" + (f", module '{where}')" if where else ")")


def refuse_recurrent_layers_onnx_runtime_cannot_train(model: onnx.ModelProto) -> None:
    """Raise GradientBuildError for a recurrent layer onnxruntime-training 1.19's CPU kernels cannot
    train, before they fail at session creation or in a run: an LSTM or GRU going the other way through
    its sequence (they take the forward direction only, docs/stack_facts.md), and an RNN, whose
    gradient node is a placeholder only torch runs (torch_recurrent.py); and a CTC loss, which only torch
    runs (torch_ctc.py). Called for training graphs that stay on ONNX Runtime, and their eval graphs."""
    refuse_ctc_losses(model, f"{_CTC_ON_TORCH}, and this one cannot be split (it holds control flow, or an output no node "
                             "computes)")  # fmt: skip
    for node in model.graph.node:
        if torch_recurrent.kind_of(node) is torch_recurrent.RNN and node.op_type == torch_recurrent.RNN.backward:
            forward = node.name.split("_Grad/")[0]
            where = f", module '{module_path(forward)}'" if module_path(forward) else ""
            raise GradientBuildError(f"RNN (node '{forward}'{where}): this graph cannot be split for torch's kernels (it "
                                     f"holds control flow, or an output no node computes){_RNN_HINT}")  # fmt: skip
        if node.op_type in ("LSTMTraining", "GRUTraining"):
            direction = torch_recurrent.direction(node)
            if direction != "forward":
                raise GradientBuildError(
                    f"{describe_node(node)}: a {direction} {node.op_type[:-len('Training')]} trains only on torch's kernels "
                    "(onnxruntime-training's go forward only), which orttrainer uses on the CPU in float32 unless "
                    "mixed precision, debug.graph_save_paths.model_with_training_graph_after_optimization_path or "
                    "control flow in the graph keeps it on ONNX Runtime's. Train this model without those."
                )


def refuse_ctc_losses(model: onnx.ModelProto, why: str, error=None) -> None:
    """Raise ``error`` (GradientBuildError by default) naming the first CTC loss in ``model`` (ONNX Runtime has none,
    torch_ctc.py), followed by ``why`` it cannot be run here."""
    for node in model.graph.node:
        if torch_ctc.is_forward(node):
            where = f", module '{module_path(node.name)}'" if module_path(node.name) else ""
            raise (error or GradientBuildError)(f"ctc_loss (node '{node.name}'{where}): ONNX Runtime has no CTC loss; {why}")


_CTC_ON_TORCH = "orttrainer runs it on torch's kernel, in a graph split for torch's kernels"


def batch_norm_statistics(model: onnx.ModelProto) -> set:
    """Names of the running mean/var inputs of BatchNormalization nodes (buffers, not weights)."""
    return {name for node in model.graph.node if node.op_type == "BatchNormalization" for name in node.input[3:5]}


def _with_ir_version(model: onnx.ModelProto) -> onnx.ModelProto:
    model.ir_version = min(model.ir_version, MAX_IR_VERSION)
    return model


def name_unnamed_nodes(graph: onnx.GraphProto) -> None:
    """Give every node a unique name (error messages and generated outputs use them)."""
    taken = {node.name for node in graph.node if node.name}
    for index, node in enumerate(graph.node):
        if not node.name:
            name = f"{node.op_type}_{index}"
            while name in taken:
                name += "_"
            node.name = name
            taken.add(name)


def drop_trailing_empty_inputs(graph: onnx.GraphProto) -> None:
    """Remove trailing '' inputs (omitted optionals): some gradient builders index them and
    abort the whole process (e.g. Pad's constant_value from torch's LocalResponseNorm)."""
    for node in graph.node:
        while node.input and not node.input[-1]:
            del node.input[-1]


def drop_zero_dropouts(model: onnx.ModelProto) -> None:
    """Turn, in place, every Dropout with a constant ratio of 0 into an Identity.

    torch's dropout with p=0 returns its input unchanged, and models keep such modules
    (transformers' configs with dropout 0, ``nn.TransformerEncoderLayer(dropout=0.0)``); ONNX
    Runtime would still run a Dropout and a DropoutGrad over the whole activation for each.
    A Dropout whose mask is read is left as it is.
    """
    constants = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            constants[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    read = {name for node in model.graph.node for name in node.input} | {output.name for output in model.graph.output}
    for node in model.graph.node:
        if node.op_type != "Dropout" or len(node.input) < 2 or node.input[1] not in constants:
            continue
        if np.any(constants[node.input[1]] != 0) or (len(node.output) > 1 and node.output[1] in read):
            continue
        node.op_type = "Identity"
        del node.input[1:]
        del node.output[1:]
        del node.attribute[:]
    _remove_unused(model.graph)


def set_inference_mode(model: onnx.ModelProto) -> None:
    """Dropout off and BatchNormalization on running statistics (the eval graph). A BatchNormalization
    whose running statistics are neither graph inputs nor initializers has none (``track_running_stats=False``:
    placeholders computed in the graph, symbolics.layers.batch_norm): it normalizes by the batch's statistics in
    eval too, as torch's."""
    stored = {graph_input.name for graph_input in model.graph.input} | {init.name for init in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Dropout" and len(node.input) > 2:
            node.input[2] = ""
        elif node.op_type == "BatchNormalization" and node.input[3] in stored:
            for attribute in node.attribute:
                if attribute.name == "training_mode":
                    attribute.i = 0
            del node.output[1:]
    _remove_unused(model.graph)


def spell_batch_statistics_norms(model: onnx.ModelProto) -> list:
    """Replace, in place, the BatchNormalizations ``set_inference_mode`` left on the batch's statistics by
    their formula (``rewrites.batch_statistics_batch_norm``); return their names. A plain ONNX Runtime
    build has no training-mode BatchNormalization kernel (the trainer's eval session, on
    onnxruntime-training, keeps the node)."""
    # set_inference_mode left the statistics outputs of these only
    targets = [node for node in model.graph.node if node.op_type == "BatchNormalization" and any(node.output[1:])]
    if not targets:
        return []
    table = {"BatchNormalization": rewrites.batch_statistics_batch_norm}
    return rewrites.replace_nodes(model, table, targets, shapes=rewrites.static_shapes(model))


def keep_outputs(model: onnx.ModelProto, names) -> None:
    """Keep only the graph outputs ``names``, and the nodes, initializers and inputs they need."""
    kept = [output for output in model.graph.output if output.name in names]
    del model.graph.output[:]
    model.graph.output.extend(kept)
    _remove_unused(model.graph)
    read = {name for node in model.graph.node for name in _node_inputs(node)} | set(names)
    inputs = [graph_input for graph_input in model.graph.input if graph_input.name in read]
    del model.graph.input[:]
    model.graph.input.extend(inputs)


def _remove_unused(graph: onnx.GraphProto) -> None:
    """Drop nodes none of whose outputs is read, and initializers nothing reads."""
    while True:
        used = {name for node in graph.node for name in node.input} | {output.name for output in graph.output}
        kept = [node for node in graph.node if any(name in used for name in node.output)]
        if len(kept) == len(graph.node):
            break
        del graph.node[:]
        graph.node.extend(kept)
    unused = [initializer for initializer in graph.initializer if initializer.name not in used]
    for initializer in unused:
        graph.initializer.remove(initializer)


def _dropout_ratio_times_input(model: onnx.ModelProto, scalable: bool = True) -> None:
    """Give every Dropout training_mode=True and, if ``scalable``, the ratio ``ratio * DROPOUT_SCALE_INPUT``.

    Training binds 1; the first-step check against torch binds 0, so that both sides
    compute without dropout from the same graph (ONNX Runtime's DropoutGrad ignores
    training_mode but honours the ratio). Float16 graphs keep constant ratios: ONNX
    Runtime 1.19's float16 DropoutGrad fails to load with a computed one. The explicit training_mode matters for attention
    dropout inside scaled-dot-product attention, exported without one: ONNX Runtime then
    skips the dropout and its gradient comes out wrong (docs/stack_facts.md).
    """
    dropouts = [node for node in model.graph.node if node.op_type == "Dropout"]
    if not dropouts:
        return
    graph = model.graph
    if scalable:
        graph.input.append(helper.make_tensor_value_info(DROPOUT_SCALE_INPUT, onnx.TensorProto.FLOAT, []))
    graph.initializer.extend([numpy_helper.from_array(np.array(True), "orttrainer.dropout_training_mode"),
                              numpy_helper.from_array(np.array(0.5, np.float32), "orttrainer.dropout_default_ratio")])  # fmt: skip
    for node in dropouts:
        while len(node.input) < 3:
            node.input.append("")
        ratio = node.input[1] or "orttrainer.dropout_default_ratio"
        node.input[1], node.input[2] = ratio, "orttrainer.dropout_training_mode"
        if not scalable:
            continue
        scale, scaled = f"{node.name}.dropout_scale", f"{node.name}.scaled_ratio"
        graph.node.extend([
            helper.make_node("CastLike", [DROPOUT_SCALE_INPUT, ratio], [scale], name=scale),
            helper.make_node("Mul", [ratio, scale], [scaled], name=scaled),
        ])  # fmt: skip
        node.input[1] = scaled
    _sort_topologically(graph)


def _sort_topologically(graph: onnx.GraphProto) -> None:
    """Order nodes so that each comes after the producers of its inputs (appended nodes may not)."""
    produced_by = {output: node for node in graph.node for output in node.output}
    placed, ordered = set(), []

    def place(node):
        if id(node) in placed:
            return
        placed.add(id(node))
        for name in _node_inputs(node):
            if name in produced_by:
                place(produced_by[name])
        ordered.append(node)

    for node in list(graph.node):
        place(node)
    del graph.node[:]
    graph.node.extend(ordered)


def _add_outputs_needed_by_gradients(model: onnx.ModelProto) -> None:
    """Expose the optional outputs (masks, log_prob, statistics) gradient builders read."""
    for node in model.graph.node:
        needed = _OUTPUTS_NEEDED_BY_GRADIENT.get(node.op_type, 0)
        while len(node.output) < needed:
            node.output.append(f"{node.name}.output{len(node.output)}")
        for index in range(needed):
            if not node.output[index]:
                node.output[index] = f"{node.name}.output{index}"


@dataclass
class RunningStatistics:
    """Where one training-mode BatchNormalization puts its new running statistics.

    ONNX Runtime updates the running variance with the *biased* batch variance (torch
    uses the unbiased one) and writes the new statistics into the running-stat inputs
    in place; ``count_output`` (values per channel) lets the trainer correct the variance.
    """

    mean_input: str
    var_input: str
    mean_output: str
    var_output: str
    count_output: str
    momentum: float  # ONNX convention: new = momentum * old + (1 - momentum) * batch
    node_name: str = ""


def _expose_running_statistics(model: onnx.ModelProto, input_names) -> list:
    """Make every training-mode BatchNormalization's running statistics graph outputs."""
    graph = model.graph
    found = []
    for node in list(graph.node):
        if node.op_type != "BatchNormalization" or len(node.output) < 3:
            continue
        x, running_mean, running_var = node.input[0], node.input[3], node.input[4]
        if running_mean not in input_names or running_var not in input_names:
            continue
        momentum = rewrites.node_attribute(node, "momentum", 0.9)
        count = f"{node.name}.values_per_channel"
        graph.node.extend(
            [
                helper.make_node("Size", [x], [f"{count}.total"], name=f"{count}.total"),
                helper.make_node("Size", [running_mean], [f"{count}.channels"], name=f"{count}.channels"),
                helper.make_node("Div", [f"{count}.total", f"{count}.channels"], [count], name=count),
            ]
        )
        found.append(RunningStatistics(running_mean, running_var, node.output[1], node.output[2], count, momentum, node.name))
    graph.output.extend(
        helper.make_empty_tensor_value_info(name)
        for stats in found
        for name in (stats.mean_output, stats.var_output, stats.count_output)
    )
    return found


# elem_type 0: shape inference could not tell, so assume it may carry a gradient.
_MAYBE_FLOAT = {0, onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}


def _node_inputs(node: onnx.NodeProto) -> list:
    """A node's inputs, including the outer-scope values its subgraphs (If/Loop/Scan) read."""
    names = list(node.input)
    for attribute in node.attribute:
        subgraphs = ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs)
        for subgraph in subgraphs:
            for inner in subgraph.node:
                names.extend(_node_inputs(inner))
    return names


def _split_embedding_lookups(model: onnx.ModelProto, trainable, marked) -> list:
    """Point every Gather(axis 0) of a trainable weight at a gradient-free copy of its input.

    ``marked`` ({Gather node name: export.EmbeddingLookup}) are torch embeddings with
    padding_idx or scale_grad_by_freq; their gradient rule travels with the lookup.
    """
    graph = model.graph
    inputs = {graph_input.name: graph_input for graph_input in graph.input}
    found, lookups = [], {}
    for node in list(graph.node):
        is_lookup = node.op_type == "Gather" and rewrites.node_attribute(node, "axis", 0) == 0
        if not is_lookup or node.input[0] not in trainable:
            if node.name in marked and node.input[0] not in inputs:
                raise GradientBuildError(
                    f"{describe_node(node)} is an embedding with padding_idx or scale_grad_by_freq over a computed "
                    "weight; orttrainer applies those only to an embedding that reads its weight directly"
                )
            continue
        weight = node.input[0]
        if weight not in lookups:
            lookups[weight] = f"{weight}.lookup"
            lookup = copy.deepcopy(inputs[weight])
            lookup.name = lookups[weight]
            graph.input.append(lookup)
        node.input[0] = lookups[weight]
        indices = f"{node.name}.indices"
        graph.node.append(helper.make_node("Identity", [node.input[1]], [indices], name=indices))
        rule = marked.get(node.name)
        found.append(EmbeddingGradient(weight, lookups[weight], f"{node.output[0]}_grad", indices,
                                       *((rule.padding_idx, rule.scale_grad_by_freq) if rule else ())))
    return found


@dataclass(frozen=True)
class TensorFacts:
    """What one ONNX shape inference says about a graph's tensors: element types and static shapes.

    Inference walks the whole graph. A build infers its forward graph once and hands the result
    to each question about that graph (which weights reach the loss, which nodes lie on gradient
    paths, how much work the convolutions are) instead of each question inferring it again.
    Rewriting weights into graph inputs, naming nodes or dropping empty inputs changes no fact.
    """

    elem_types: dict  # tensor name -> ONNX element type (0: unknown)
    shapes: dict  # tensor name -> [size, or None where dynamic], initializers included


def infer_tensor_facts(model: onnx.ModelProto) -> TensorFacts:
    """One ONNX shape inference of ``model``, as TensorFacts."""
    inferred = onnx.shape_inference.infer_shapes(rewrites.structure_for_inference(model)).graph
    elem_types = {
        info.name: info.type.tensor_type.elem_type
        for info in list(inferred.value_info) + list(inferred.output) + list(inferred.input)
    }
    shapes = rewrites.shapes_in(list(inferred.value_info) + list(inferred.input) + list(inferred.output))
    shapes.update({initializer.name: list(initializer.dims) for initializer in model.graph.initializer})
    return TensorFacts(elem_types, shapes)


def _is_stop_gradient(node: onnx.NodeProto) -> bool:
    """An Identity standing for torch's detach (export.resolve_markers)."""
    return node.op_type == "Identity" and node.doc_string == rewrites.STOP_GRADIENT


def _nodes_reading(model: onnx.ModelProto, sources, elem_types: dict) -> list:
    """Nodes that read a floating-point value computed from ``sources``, in graph order.

    Integer tensors (shapes, indices) carry no gradient, and a detach none on, so values computed from them are not.
    """
    downstream = set(sources)
    found = []
    for node in model.graph.node:  # exported graphs are topologically sorted
        if any(name in downstream for name in _node_inputs(node)):
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
            upstream.update(name for name in _node_inputs(node) if name and elem_types.get(name, 0) in _MAYBE_FLOAT)
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
    read = {name for node in _nodes_between(model, weight_names, loss_name, facts) for name in _node_inputs(node)}
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
    return node.op_type == "RNN" and len(node.input) == 6 and torch_recurrent.torch_can_run(node)


_DETACHED_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)


def stop_gradients(model: onnx.ModelProto, weight_names) -> None:
    """Replace each detach that reads a value computed from the weights by ``rewrites.detached``: the same values,
    on no path the gradient builder follows (it follows an Identity). Other detaches stay Identities.

    Run on the graph as the builder gets it (float16 under mixed precision: ``rewrites.detached`` works in
    float32, which holds every float16 value exactly).
    """
    if not any(_is_stop_gradient(node) for node in model.graph.node):
        return
    _sort_topologically(model.graph)  # the float16 conversion appends its casts of the weights
    elem_types = infer_tensor_facts(model).elem_types
    cut = [node for node in _nodes_reading(model, weight_names, elem_types) if _is_stop_gradient(node)]
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


def _builder_error(error: Exception, graph: onnx.GraphProto) -> GradientBuildError:
    """Translate the C++ builder's message into one that names the op and its module."""
    found = re.search(r"has not been registered: (\S+) for node (\S+)", str(error))
    if found:
        node = next((node for node in graph.node if node.name == found.group(2)), None)
        what = describe_node(node) if node is not None else f"{found.group(1)} (node '{found.group(2)}')"
        return GradientBuildError(f"onnxruntime-training has no gradient for {what}")
    return GradientBuildError(f"building the gradient graph failed: {error}")


def missing_kernel_error(error: Exception, device, model: onnx.ModelProto) -> GradientBuildError:
    """ONNX Runtime found no kernel for a (gradient) node of ``model`` on this device: say which op and module, and
    whether the graph casts to bfloat16 (torch.autocast inside forward)."""
    found = re.search(r"implementation for (\S+)\(\d+\) node with name '([^']*)'", str(error))
    if not found:
        return GradientBuildError(f"ONNX Runtime cannot run the training graph on {device}: {error}")
    op_type, node_name = found.groups()
    where = module_path(node_name.split("_Grad/")[0])  # '/model/layer/Op_Grad/OpGrad_0' -> the forward node
    bfloat16 = any(node.op_type == "Cast" and rewrites.node_attribute(node, "to") == onnx.TensorProto.BFLOAT16
                   for node in model.graph.node)  # fmt: skip
    return GradientBuildError(
        f"ONNX Runtime has no {device.type.upper()} kernel for {op_type} (node '{node_name}'"
        + (f", module '{where}')" if where else ")")
        + ("; the graph casts to bfloat16 (torch.autocast inside forward?), for which ONNX Runtime has few kernels: "
           "compute in float32, or use the option mixed_precision.enabled (float16)" if bfloat16 else "")
    )


def to_mixed_precision(model: onnx.ModelProto, keep_float32) -> onnx.ModelProto:
    """Compute in float16: weights and inputs stay float32 graph inputs (cast on entry, so
    their gradients come back float32), as do the outputs named in ``keep_float32``."""
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    inputs = [graph_input.name for graph_input in model.graph.input]
    converted = convert_float_to_float16(
        model, keep_io_types=inputs + list(keep_float32), op_block_list=DEFAULT_OP_BLOCK_LIST + _FLOAT32_OPS
    )
    return _with_ir_version(converted)


_NO_FLOAT16_GRADIENT_KERNEL = ("SliceGrad", "SplitTraining")  # SplitTraining: Concat's gradient (an LSTM's weights)


def _float32_gradient_kernels(model: onnx.ModelProto) -> None:
    """Run gradient ops that have no float16 CPU kernel in float32.

    ONNX Runtime's training transformers move casts across data-movement ops, so a Slice
    or Concat kept in float32 by the converter can end up in float16 anyway; its gradient
    then fails at the first run. The incoming gradient is cast to float32 and each result
    cast back (CastLike) to the type of the forward node's input at its position (Slice's
    data, Concat's i-th input), whatever the optimizer left it as.
    """
    forward = {node.name: node for node in model.graph.node}
    added = []
    for node in model.graph.node:
        if node.op_type not in _NO_FLOAT16_GRADIENT_KERNEL or "_Grad/" not in node.name:
            continue
        forward_inputs = forward[node.name.split("_Grad/")[0]].input
        gradient_in = node.input[0]
        node.input[0] = f"{node.name}.float32_in"
        added.append(helper.make_node("Cast", [gradient_in], [node.input[0]], name=node.input[0], to=onnx.TensorProto.FLOAT))
        for position, gradient_out in enumerate(node.output):
            if not gradient_out:
                continue
            node.output[position] = f"{node.name}.float32_out_{position}"
            added.append(helper.make_node("CastLike", [node.output[position], forward_inputs[position]], [gradient_out],
                                          name=f"{node.name}.cast_back_{position}"))
    model.graph.node.extend(added)


def _scale_loss(model: onnx.ModelProto, loss_name: str) -> str:
    """Multiply the loss by a float32 input (the loss scale), so that no re-export is needed."""
    model.graph.input.append(helper.make_tensor_value_info(LOSS_SCALE_INPUT, onnx.TensorProto.FLOAT, []))
    model.graph.node.append(helper.make_node("Mul", [loss_name, LOSS_SCALE_INPUT], [_SCALED_LOSS], name=_SCALED_LOSS))
    model.graph.output.append(helper.make_empty_tensor_value_info(_SCALED_LOSS))
    return _SCALED_LOSS


def _macs_per_sample(node: onnx.NodeProto, shapes: dict):
    """Multiply-accumulates of a Conv, Gemm or MatMul per sample (dim 0), or None if unknown."""
    output = shapes.get(node.output[0])
    if node.op_type == "Conv":
        weight = shapes.get(node.input[1])
        dims = (weight or [None]) + (output or [None, None])[2:]
    elif node.op_type in ("Gemm", "MatMul"):
        first = shapes.get(node.input[0])
        transposed = node.op_type == "Gemm" and rewrites.node_attribute(node, "transA", 0)
        contraction = None if not first else first[0] if transposed else first[-1]
        dims = (output or [None, None])[1:] + [contraction]
    else:
        return None
    return None if None in dims else int(np.prod(dims))


def _work_per_sample(model: onnx.ModelProto, facts: TensorFacts = None) -> list:
    """(node, multiply-accumulates per sample) of each Conv, Gemm and MatMul of known shapes; [] for a
    graph without convolutions (the questions asked of it are about convolutions).

    The forward graph answers for the training and eval graphs built from it: they hold the
    same Conv, Gemm and MatMul nodes on tensors of the same shapes.
    """
    if not any(node.op_type == "Conv" for node in model.graph.node):
        return []
    shapes = (facts or infer_tensor_facts(model)).shapes
    work = [(node, _macs_per_sample(node, shapes)) for node in model.graph.node]
    return [(node, macs) for node, macs in work if macs is not None]


def small_convolutions_dominate(model: onnx.ModelProto, facts: TensorFacts = None) -> bool:
    """True when convolutions below ``SMALL_CONVOLUTION_MACS`` per image do most of the work.

    Such graphs (LeNet-sized CNNs) train faster with one intra-op thread: ONNX Runtime's
    CPU Conv and ConvGrad open a thread-pool section per image, and with spinning off
    each costs a wake-up of the second thread worth more than its share of the work.
    """
    work = _work_per_sample(model, facts)
    small = sum(macs for node, macs in work if node.op_type == "Conv" and macs < SMALL_CONVOLUTION_MACS)
    return small > sum(macs for _, macs in work) / 2


def convolutions_worth_splitting(model: onnx.ModelProto, sample_shapes: dict) -> bool:
    """True when the convolutions average at least ``SPLIT_CONVOLUTION_MACS`` each on a batch of
    ``sample_shapes`` ({graph input: shape}, the first batch's; an input not given keeps its declared
    shape, and a batch size still unknown counts as 1) (torch_convolutions.py).

    One graph may serve batches of other sizes (a shape-generic trace): the first batch chooses for them.
    """
    convolutions = [node for node in model.graph.node if node.op_type == "Conv"]
    shapes = _shapes_at(model, sample_shapes) if convolutions else {}
    work = []
    for node in convolutions:
        per_sample = _macs_per_sample(node, shapes)
        if per_sample is not None:
            work.append(per_sample * (shapes[node.output[0]][0] or 1))
    return bool(work) and sum(work) >= SPLIT_CONVOLUTION_MACS * len(work)


def _quiet_session_options() -> onnxruntime.SessionOptions:
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3  # the graph builder logs every transformer at INFO level
    return options


def build_training_graphs(forward: onnx.ModelProto, trainable, frozen, loss_name: str, output_names,
                          mixed_precision: bool = False, on_cpu: bool = False, lookups=None,
                          facts: TensorFacts = None, keep_for_torch=(), recurrent_on_torch: bool = False) -> TrainingGraphs:
    """Build the training graph (outputs, running stats, gradients) and the eval graph.

    ``forward`` is the forward+loss graph with weights as initializers; ``trainable``
    weights get gradients, ``frozen`` ones (buffers included) become inputs without.
    With ``mixed_precision`` both graphs compute in float16, and the gradients are those
    of the loss times the ``LOSS_SCALE_INPUT`` input. ``on_cpu`` (the graphs run on the CPU)
    replaces, in float32 graphs, kernels measured slow there by fast equivalents and ones that
    differ from torch's by exact ones (``cpu_kernels``), and writes grouped 1-d and 3-d convolutions in a
    form whose gradient ONNX Runtime's CPU kernel computes in bounds (``rewrites.grouped_convolutions``),
    but for the op types ``keep_for_torch``
    (torch's kernels will run them, torch_convolutions.py), which also keep their forward nodes of a
    defined gradient unspelled (``defined_gradients.spell_forwards``). ``recurrent_on_torch``: the sessions
    will run recurrent layers and CTC losses on torch's kernels (torch_recurrent.py, torch_ctc.py), so an RNN
    and a CTC loss train (without it, a CTC loss is refused).
    ``lookups`` ({Gather node name: export.EmbeddingLookup}) carry torch's embedding gradient rules;
    ``facts`` (``infer_tensor_facts(forward)``), when the caller has them, spare an inference.
    """
    if not recurrent_on_torch:
        refuse_ctc_losses(forward, f"{_CTC_ON_TORCH}, which orttrainer makes on the CPU only, without mixed precision or "
                                   "debug.graph_save_paths.model_with_training_graph_after_optimization_path")  # fmt: skip
    model = _with_ir_version(rewrites.copy_with_inputs_for(forward, list(trainable) + list(frozen)))
    name_unnamed_nodes(model.graph)
    drop_trailing_empty_inputs(model.graph)
    drop_zero_dropouts(model)
    rewrites.explicit_convolution_pads(model)
    eval_model = copy.deepcopy(model)
    set_inference_mode(eval_model)
    if mixed_precision:
        eval_model = to_mixed_precision(eval_model, [loss_name])

    make_differentiable(model, trainable, loss_name, facts, recurrent_on_torch)
    if on_cpu:
        rewrites.grouped_convolutions(model)
    if on_cpu and not mixed_precision:
        cpu_kernels.pool_before_relu(model)
    input_names = {graph_input.name for graph_input in model.graph.input}
    running_statistics = _expose_running_statistics(model, input_names)
    embeddings = _split_embedding_lookups(model, set(trainable), lookups or {})
    # a weight only looked up no longer does; inferred again: the rewrites added tensors the facts do not know
    graph_trainable = weights_reaching_loss(model, trainable, loss_name)
    rows = [embedding.rows_gradient[: -len("_grad")] for embedding in embeddings]
    model.graph.output.extend(helper.make_empty_tensor_value_info(embedding.indices_output) for embedding in embeddings)
    gradient_of = loss_name
    if mixed_precision:
        kept = [loss_name] + [o.name for o in model.graph.output if o.name not in output_names]
        model = to_mixed_precision(model, kept)
        gradient_of = _scale_loss(model, loss_name)
    stop_gradients(model, graph_trainable)
    _dropout_ratio_times_input(model, scalable=not mixed_precision)
    rewrites.quotients_kept_apart(model)
    options = _quiet_session_options()
    optimized = onnx.load_from_string(get_optimized_model(model.SerializeToString(), set(graph_trainable), options))
    _add_outputs_needed_by_gradients(optimized)
    _private_normalization_constants(optimized, set(graph_trainable))
    defined_gradients.register_gradient_definitions()
    try:
        builder = GradientGraphBuilder(optimized.SerializeToString(), {gradient_of}, set(graph_trainable) | set(rows), gradient_of, options)
        builder.build()
    except RuntimeError as error:
        raise _builder_error(error, optimized.graph) from error
    train_model = onnx.load_from_string(builder.get_model())
    torch_recurrent.complete_rnn_gradients(train_model)
    drop_empty_broadcast_reductions(train_model, forward)
    defined_gradients.zero_gradient_at_bounds(train_model)
    defined_gradients.spell_forwards(train_model, keep_for_torch)
    defined_gradients.spell_forwards(eval_model, keep_for_torch)
    if on_cpu:
        for graph_model in (train_model, eval_model):
            cpu_kernels.centered_layer_norms(graph_model)
    if mixed_precision:
        _float32_gradient_kernels(train_model)
    elif on_cpu:
        for graph_model in (train_model, eval_model):
            cpu_kernels.use_fast_cpu_kernels(graph_model, keep_for_torch, model)
            cpu_kernels.use_exact_cpu_kernels(graph_model, keep_for_torch)
    gradient_outputs = _order_outputs(train_model, trainable, graph_trainable, output_names, running_statistics, embeddings)
    return TrainingGraphs(_with_ir_version(train_model), eval_model, gradient_outputs, running_statistics, embeddings)


def _keeps_its_shape(own, other) -> bool:
    """Whether a tensor of shape ``own`` keeps it when broadcast with one of shape ``other`` (sizes, symbolic
    names, None where unknown): it has as many dims or more, and on each it has a static size above 1, the
    same size or name as the other (a name stands for one size in a graph: model_desc's check), or the
    other's is a static 1."""
    if own is None or other is None or len(own) < len(other):
        return False
    return all((mine is not None and ((isinstance(mine, int) and mine > 1) or mine == theirs)) or theirs == 1
               for mine, theirs in zip(reversed(own), reversed(other)))  # fmt: skip


def _reduced_operand_keeps_its_shape(node, shape_of, nodes_by_name: dict, shapes: dict) -> bool:
    """For a ReduceSum that reads the axes ``BroadcastGradientArgs(Shape(a), Shape(b))`` gives one of a and b:
    whether that operand can never have been broadcast, from the forward graph's shapes."""
    arguments = shape_of.get(node.input[1])
    if arguments is None:
        return False
    operands, position = arguments
    own, other = (shapes.get(name) for name in (operands[position], operands[1 - position]))
    if other is None:  # a MatMul's gradient compares the operand with its gradient before the reduction
        matmul = nodes_by_name.get(node.name.rpartition("_Grad/")[0])
        if matmul is None or matmul.op_type != "MatMul" or operands[position] not in matmul.input[:2] or own is None:
            return False
        other = shapes.get(matmul.input[1 - list(matmul.input).index(operands[position])])
        return other is not None and len(own) >= 2 and _keeps_its_shape(own[:-2], other[:-2] if len(other) > 2 else [])
    return _keeps_its_shape(own, other)


def drop_empty_broadcast_reductions(model: onnx.ModelProto, forward: onnx.ModelProto) -> None:
    """Remove, in place, the gradient builder's broadcast reductions that never reduce.

    Where it cannot see an operand's shape at build time, the builder sums the gradient over the axes
    ``BroadcastGradientArgs`` finds at run time (``ReduceSum`` with ``noop_with_empty_axes``). When the
    operand was not broadcast that sum is a copy of the gradient: 26 of them cost 2.9 ms of the encoder's
    step (benchmarks/NOTES.md §36). Those whose operand provably keeps its shape, by the shapes of the
    ``forward`` graph (``rewrites.symbolic_shapes``: a bias add's input, a residual sum of two [batch, ...]
    tensors, a MatMul's operand against a matrix, a product with a scalar) are skipped; the rest stay.
    """
    if not any(node.op_type == "BroadcastGradientArgs" for node in model.graph.node):
        return  # a CNN's graph, typically: no shape inference for nothing
    shapes = rewrites.symbolic_shapes(forward)
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
                and _reduced_operand_keeps_its_shape(node, shape_of, nodes_by_name, shapes)):  # fmt: skip
            renamed[node.output[0]] = node.input[0]
    if not renamed:
        return

    def source(name):
        while name in renamed:
            name = renamed[name]
        return name

    for node in model.graph.node:
        node.input[:] = [source(name) for name in node.input]
    _remove_unused(model.graph)


def _order_outputs(train_model, trainable, graph_trainable, output_names, running_statistics, embeddings) -> dict:
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
    ordered = list(output_names) + stat_outputs + list(gradient_outputs.values()) + embedding_outputs
    del train_model.graph.output[:]
    train_model.graph.output.extend(
        by_name[name] if name in by_name else helper.make_empty_tensor_value_info(name) for name in ordered
    )
    return gradient_outputs


def where_in_graph(model: onnx.ModelProto, names) -> dict:
    """{name: the node that produces it (an output) or first reads it (a weight), with its torch module}."""
    producers = {output: node for node in model.graph.node for output in node.output}
    readers = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, node)
    found = {}
    for name in names:
        if name in producers:
            found[name] = f"from {describe_node(producers[name])}"
        elif name in readers:
            found[name] = f"read by {describe_node(readers[name])}"
    return found


@dataclass(frozen=True)
class IndexRange:
    """A graph input of integer indices and the range the op it feeds accepts, as torch checks it."""

    input: str
    size: int  # valid values are 0 .. size - 1
    ignore_index: object  # a value also accepted (a loss's ignore_index), or None
    consumer: str  # the op and module, for the error message


# Ops that pass indices through unchanged in value (a language model's labels.view(-1)).
_VALUE_PRESERVING = {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Cast", "Transpose"}


def index_ranges(model: onnx.ModelProto, sample_shapes: dict) -> list:
    """Integer graph inputs that reach an embedding lookup (Gather) or a class-index loss as
    indices, with the range torch accepts there: 0 .. rows - 1, 0 .. classes - 1 (or ignore_index).
    ``sample_shapes`` ({input: shape} of one batch) let shape inference find sizes a reshape
    computes (``logits.view(-1, vocab)``); the sizes used are those that do not depend on the batch.

    ONNX Runtime would accept negative indices (counted from the end) where torch raises,
    and fails out-of-range ones with a C++ message naming its own node; the trainer checks
    these ranges before each run instead (cheap: one comparison per index tensor).
    """
    integer_types = (onnx.TensorProto.INT64, onnx.TensorProto.INT32)
    integer_inputs = [i.name for i in model.graph.input if i.name in sample_shapes and i.type.tensor_type.elem_type in integer_types]
    readers = {}
    for node in model.graph.node:
        for position, name in enumerate(node.input):
            readers.setdefault(name, []).append((node, position))
    shapes = _shapes_at(model, sample_shapes)
    grown = {name: [size + 1 for size in shape] for name, shape in sample_shapes.items()}
    other = _shapes_at(model, grown)  # a size that moves with the batch's shape is no fixed bound
    shapes = {name: [size if size == other.get(name, [None] * len(shape))[index] else None for index, size in enumerate(shape)]
              for name, shape in shapes.items() if len(other.get(name, [])) == len(shape)}  # fmt: skip
    found = []
    for name in integer_inputs:
        pending, seen = [name], set()
        while pending:
            tensor = pending.pop()
            for node, position in readers.get(tensor, []):
                if node.op_type in _VALUE_PRESERVING and position == 0 and id(node) not in seen:
                    seen.add(id(node))
                    pending.extend(node.output)
                    continue
                bound = _index_bound(node, position, shapes)
                if bound is not None:
                    found.append(IndexRange(name, bound[0], bound[1], describe_node(node)))
    return found


def _shapes_at(model: onnx.ModelProto, sample_shapes: dict) -> dict:
    """Tensor name -> shape, inferred with the graph inputs fixed to ``sample_shapes``."""
    fixed = rewrites.structure_for_inference(model)
    for graph_input in fixed.graph.input:
        for dim, size in zip(graph_input.type.tensor_type.shape.dim, sample_shapes.get(graph_input.name, [])):
            dim.Clear()
            dim.dim_value = size
    inferred = onnx.shape_inference.infer_shapes(fixed, data_prop=True).graph
    shapes = {initializer.name: list(initializer.dims) for initializer in fixed.graph.initializer}
    shapes.update(rewrites.shapes_in(list(inferred.value_info) + list(inferred.input) + list(inferred.output)))
    return shapes


def _index_bound(node: onnx.NodeProto, position: int, shapes: dict):
    """(size, ignore_index) when ``node`` reads input ``position`` as indices into a static dimension."""
    if node.op_type == "Gather" and position == 1:
        axis = rewrites.node_attribute(node, "axis", 0)
        data = shapes.get(node.input[0])
        size = data[axis] if data and len(data) > axis else None
        return (size, None) if size else None
    if node.op_type in ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss") and position == 1:
        scores = shapes.get(node.input[0])
        size = scores[1] if scores and len(scores) > 1 else None
        return (size, rewrites.node_attribute(node, "ignore_index")) if size else None
    return None


class RunError(RuntimeError):
    """ONNX Runtime failed on a batch; the message names the op and the torch module it came from."""


def run_error(error: Exception, empty_inputs=()) -> RunError:
    """ONNX Runtime's 'Non-zero status code returned while running X node. Name:...' as one readable line;
    ``empty_inputs`` (descriptions of the batch's inputs with a dimension of size 0) are named as the likely cause."""
    found = re.search(r"running (\S+) node\. Name:'([^']*)' Status Message: (.*)", str(error), re.DOTALL)
    if not found:
        message = f"ONNX Runtime failed on this batch: {error}"
    else:
        op_type, node_name, status = found.groups()
        where = module_path(node_name.split("_Grad/")[0])
        status = status.strip().split(" ", 1)[-1] if status.startswith("/onnxruntime_src") else status.strip()
        message = (f"ONNX Runtime failed on this batch in {op_type} (node '{node_name}'"
                   + (f", module '{where}'" if where else "") + f"): {status}")  # fmt: skip
    if empty_inputs:
        message = (f"{message.rstrip('.')}. The batch is empty ({', '.join(empty_inputs)}): ONNX Runtime's kernels do "
                   "not all take a dimension of size 0, where torch's do; leave empty batches out")  # fmt: skip
    return RunError(message)
