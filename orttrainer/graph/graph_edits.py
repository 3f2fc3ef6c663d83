"""Small edits and walks of an ONNX graph the graph modules share: the IR version ONNX Runtime loads,
node names, omitted trailing inputs, unused nodes, topological order, and what a node reads (its subgraphs'
outer-scope values included)."""

from collections import Counter

import onnx


MAX_IR_VERSION = 10  # the highest IR version ONNX Runtime 1.19 loads


def with_ir_version(model: onnx.ModelProto) -> onnx.ModelProto:
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


def remove_unused(graph: onnx.GraphProto) -> None:
    """Drop nodes none of whose outputs is read, and initializers nothing reads (one pass: a dropped node's
    inputs are counted down, and their writers dropped in turn where nothing reads them any more)."""
    nodes = list(graph.node)
    graph_outputs = {output.name for output in graph.output}
    reads = Counter(name for node in nodes for name in node.input)
    writer = {name: index for index, node in enumerate(nodes) for name in node.output}

    def unread(index):
        return all(reads[name] == 0 and name not in graph_outputs for name in nodes[index].output)

    dropped, pending = set(), [index for index in range(len(nodes)) if unread(index)]
    while pending:
        index = pending.pop()
        if index in dropped:
            continue
        dropped.add(index)
        for name in nodes[index].input:
            reads[name] -= 1
            if reads[name] == 0 and name in writer and writer[name] not in dropped and unread(writer[name]):
                pending.append(writer[name])
    if dropped:
        del graph.node[:]
        graph.node.extend(node for index, node in enumerate(nodes) if index not in dropped)
    unused = [initializer for initializer in graph.initializer
              if reads[initializer.name] == 0 and initializer.name not in graph_outputs]  # fmt: skip
    for initializer in unused:
        graph.initializer.remove(initializer)


def sort_topologically(graph: onnx.GraphProto) -> None:
    """Order nodes so that each comes after the producers of its inputs (appended nodes may not)."""
    produced_by = {output: node for node in graph.node for output in node.output}
    placed, ordered = set(), []

    def place(node):
        if id(node) in placed:
            return
        placed.add(id(node))
        for name in node_inputs(node):
            if name in produced_by:
                place(produced_by[name])
        ordered.append(node)

    for node in list(graph.node):
        place(node)
    del graph.node[:]
    graph.node.extend(ordered)


def node_inputs(node: onnx.NodeProto) -> list:
    """A node's inputs, including the outer-scope values its subgraphs (If/Loop/Scan) read."""
    names = list(node.input)
    for attribute in node.attribute:
        subgraphs = ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs)
        for subgraph in subgraphs:
            for inner in subgraph.node:
                names.extend(node_inputs(inner))
    return names
