"""Graph outputs the trainer finishes with torch: the new running statistics of every training-mode
BatchNormalization (the trainer corrects the variance to torch's unbiased one), the new values of the buffers a
training forward writes in place (``WRITTEN_PREFIX``: the trainer copies them into the buffers), and the gradients
of the rows an embedding lookup read with their indices (the trainer scatter-adds them into the weight's gradient)."""

import copy
from dataclasses import dataclass

import onnx
from onnx import helper

from . import rewrites
from .graph_errors import GradientBuildError, describe_node


def batch_norm_statistics(model: onnx.ModelProto) -> set:
    """Names of the running mean/var inputs of BatchNormalization nodes (buffers, not weights)."""
    return {name for node in model.graph.node if node.op_type == "BatchNormalization" for name in node.input[3:5]}


# A graph output holding the value a training forward leaves in a buffer it writes in place (a step counter, an
# exponential moving average, spectral_norm's u and v): WRITTEN_PREFIX + the buffer's state_dict key.
WRITTEN_PREFIX = "orttrainer.written."


def written_buffers(model: onnx.ModelProto) -> dict:
    """{buffer name: graph output} of the buffers the graph's forward writes (``WRITTEN_PREFIX``)."""
    return {output.name[len(WRITTEN_PREFIX) :]: output.name for output in model.graph.output
            if output.name.startswith(WRITTEN_PREFIX)}  # fmt: skip


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


def expose_running_statistics(model: onnx.ModelProto, input_names) -> list:
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


def split_embedding_lookups(model: onnx.ModelProto, trainable, marked) -> list:
    """Point every Gather(axis 0) of a trainable weight at a gradient-free copy of its input.

    ``marked`` ({Gather node name: exported_graph.EmbeddingLookup}) are torch embeddings with
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
