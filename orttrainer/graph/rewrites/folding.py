"""Values a graph has before it runs: initializers, Constant nodes and the sizes and size arithmetic computed
from static shapes (``known_values``), which ``fold_static_sizes`` writes into the graph as Constants, inlining
each If they decide, so that the rewrites that need a static size find one. Its own module because it evaluates
nodes (ONNX's reference implementation) rather than rewriting them.
"""

import functools

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ._building import node_attribute
from .shapes import symbolic_shapes


def _constant_node_value(node) -> np.ndarray:
    """The value of a Constant node (None for anything else)."""
    if node is None or node.op_type != "Constant" or node_attribute(node, "value") is None:
        return None
    return numpy_helper.to_array(node_attribute(node, "value"))


def _inline_decided_ifs(model: onnx.ModelProto) -> list:
    """Replace, in place, each If whose condition is a Constant node (``fold_static_sizes`` makes one of the
    exporter's squeeze() of a dimension it could not size, e.g. after a split) by the nodes of the branch
    it always takes; return the If nodes' names. The gradient builder takes no control flow; the values
    are the If's own."""
    ifs = [node for node in model.graph.node if node.op_type == "If"]
    if not ifs:
        return []
    producers = {name: node for node in model.graph.node for name in node.output}
    taken = {}
    for node in ifs:
        condition = _constant_node_value(producers.get(node.input[0]))
        if condition is not None and condition.size == 1:
            taken[id(node)] = node_attribute(node, "then_branch" if condition.reshape(-1)[0] else "else_branch")
    nodes = []
    for node in model.graph.node:
        branch = taken.get(id(node))
        if branch is None:
            nodes.append(node)
            continue
        results = {output.name: mine for output, mine in zip(branch.output, node.output)}
        for inner in branch.node:
            copied = onnx.NodeProto()
            copied.CopyFrom(inner)
            copied.name = f"{node.name}/{inner.name or inner.op_type}"
            copied.output[:] = [results.get(name, name) for name in inner.output]
            copied.input[:] = [results.get(name, name) for name in inner.input]
            nodes.append(copied)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return [node.name for node in ifs if id(node) in taken]


_NOT_FOLDED = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli",
               "Dropout"}  # fmt: skip
_FOLDED_UP_TO = 64  # elements of a value fold_static_sizes folds: sizes and their arithmetic, not data


def known_values(model: onnx.ModelProto, symbols: dict = None, excluded=()) -> dict:
    """Tensor name -> value known before the run: initializers but ``excluded``, Constant nodes, with
    ``symbols`` (``symbolic_shapes``) the sizes of static dimensions (Shape, Size, a Gather or Slice of a Shape's
    static elements), and what only these feed (the exporter computes e.g. Resize scales with small chains
    of such nodes), evaluated by ONNX's reference implementation."""
    graph = model.graph
    graph_inputs = {graph_input.name for graph_input in graph.input}
    values = {initializer.name: numpy_helper.to_array(initializer) for initializer in graph.initializer
              if initializer.name not in excluded and initializer.name not in graph_inputs}  # fmt: skip
    shape_elements = {}  # a Shape's output -> its elements, None where a size is dynamic
    for node in graph.node:
        if node.op_type in _NOT_FOLDED or node.domain not in ("", "ai.onnx") or any(a.HasField("g") for a in node.attribute):
            continue
        if symbols is not None and node.op_type in ("Shape", "Size", "Gather", "Slice"):
            size_values = _static_sizes(node, symbols, shape_elements, values, list(model.opset_import))
            if size_values is not None:
                values.update(size_values)
                continue
        constant = _constant_node_value(node)
        if constant is not None:
            values[node.output[0]] = constant
            continue
        inputs = [name for name in node.input if name]
        if all(name in values for name in inputs):
            values.update(_evaluated(node, {name: values[name] for name in inputs}, list(model.opset_import)))
    return values


def _static_sizes(node: onnx.NodeProto, symbols: dict, shape_elements: dict, values: dict, opsets):
    """{output: value} of a Shape or Size, or a Gather or Slice of a Shape's elements, whose sizes ``symbols``
    has as numbers; None if they are not all static. What a Shape, Gather or Slice picks is kept in
    ``shape_elements`` (None for a dynamic size), for the next Gather or Slice."""
    if node.op_type in ("Gather", "Slice"):
        elements, positions = shape_elements.get(node.input[0]), None
        others = {name: values.get(name) for name in node.input[1:] if name}
        if elements is not None and all(value is not None for value in others.values()):
            positions = _evaluated(node, {node.input[0]: np.arange(len(elements)), **others}, opsets).get(node.output[0])
        if positions is None:
            return None
        sizes = np.asarray(np.asarray(elements, dtype=object)[positions], dtype=object)  # 0-d for a scalar index
    else:
        dims = symbols.get(node.input[0])
        if dims is None:
            return None
        sizes = np.asarray([dim if isinstance(dim, int) else None for dim in dims], dtype=object)
        if node.op_type == "Size":
            return None if None in sizes else {node.output[0]: np.array(int(np.prod(sizes)), np.int64)}
        sizes = sizes[node_attribute(node, "start", 0) : node_attribute(node, "end", len(sizes))]
    if sizes.ndim == 1:
        shape_elements[node.output[0]] = list(sizes)
    return None if any(size is None for size in sizes.ravel()) else {node.output[0]: sizes.astype(np.int64)}


def _evaluated(node: onnx.NodeProto, inputs: dict, opsets) -> dict:
    """{output: value} of ``node`` run on ``inputs`` by ONNX's reference implementation; {} for an op it lacks."""
    form = onnx.NodeProto()
    form.CopyFrom(node)
    form.name = ""
    form.input[:] = [f"i{index}" if name else "" for index, name in enumerate(node.input)]
    form.output[:] = [f"o{index}" for index in range(len(node.output))]
    opset_versions = tuple((opset.domain, opset.version) for opset in opsets)
    try:
        with np.errstate(divide="raise"):  # an integer division by 0 is numpy's 0, an error in a run
            results = _evaluator(form.SerializeToString(), opset_versions).run(
                None, {f"i{index}": inputs[name] for index, name in enumerate(node.input) if name})
        return dict(zip(node.output, results))
    except Exception:  # the reference evaluator lacks some ops; such values just stay unknown
        return {}


@functools.lru_cache(maxsize=256)
def _evaluator(serialized_node: bytes, opset_versions: tuple):
    """ONNX's reference evaluator of one node (inputs ``i<k>``, outputs ``o<k>``): made once per form of node, since
    making one takes ~0.3 ms and a transformer's export folds hundreds of Gathers and Unsqueezes of a few forms."""
    from onnx.reference import ReferenceEvaluator

    node = onnx.NodeProto.FromString(serialized_node)
    single = helper.make_model(
        helper.make_graph([node], "fold", [helper.make_tensor_value_info(name, 0, None) for name in node.input if name],
                          [helper.make_tensor_value_info(name, 0, None) for name in node.output]),
        opset_imports=[helper.make_opsetid(domain, version) for domain, version in opset_versions],
    )  # fmt: skip
    return ReferenceEvaluator(single)


def _read_nodes(nodes: list, graph_outputs: set) -> list:
    """``nodes`` without those whose outputs no node reads and the graph does not return (after folding,
    the Shapes and Gathers that only fed sizes), random ones kept."""
    while True:
        read = graph_outputs | {name for node in nodes for name in node.input} | _read_by_subgraphs(nodes)
        kept = [node for node in nodes if node.op_type in _NOT_FOLDED or any(name in read for name in node.output)]
        if len(kept) == len(nodes):
            return nodes
        nodes = kept


def _read_by_subgraphs(nodes) -> set:
    """Names the subgraphs of ``nodes`` (an If's branches, and the Ifs inside them) read."""
    subgraphs = [attribute.g for node in nodes for attribute in node.attribute if attribute.HasField("g")]
    return {name for graph in subgraphs for name in _read_by(graph)}


def _read_by(graph) -> set:
    return {name for node in graph.node for name in node.input} | _read_by_subgraphs(graph.node)


def fold_static_sizes(model: onnx.ModelProto, module_tensors=()) -> list:
    """Replace, in place, each node a run computes from constants and static sizes alone (values of at most
    ``_FOLDED_UP_TO`` elements: shapes and their arithmetic) by Constant nodes, and each If they decide by
    its branch (``_inline_decided_ifs``), until none is left; return the replaced nodes' names.

    ONNX's shape inference follows sizes through a few ops only (not Div, Pow or a Cast from float):
    DINOv2's position embeddings, reshaped to the square root of their count and resized to the image's
    patch grid, had no static size for the rewrites that need one. The graph's inputs declare every size
    but the dynamic ones, so these values are the run's. ``module_tensors`` (the module's parameters and
    buffers) are never read as constants: their values change.
    """
    replaced = []
    while True:
        values = known_values(model, symbolic_shapes(model), set(module_tensors))
        graph_outputs = {output.name for output in model.graph.output}
        nodes, folded = [], []
        for node in model.graph.node:
            known = node.op_type != "Constant" and all(name in values for name in node.output)
            if not known or any(np.size(values[name]) > _FOLDED_UP_TO or name in graph_outputs for name in node.output):
                nodes.append(node)
                continue
            folded.append(node.name)
            nodes += [helper.make_node("Constant", [], [name], name=f"{node.name}/folded{index}",
                                       value=numpy_helper.from_array(np.asarray(values[name]), name))
                      for index, name in enumerate(node.output)]  # fmt: skip
        del model.graph.node[:]
        model.graph.node.extend(_read_nodes(nodes, graph_outputs))
        done = folded + _inline_decided_ifs(model)
        if not done:
            return replaced
        replaced += done
