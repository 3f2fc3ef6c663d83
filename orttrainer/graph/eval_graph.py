"""The eval (inference) graph: dropout off, BatchNormalization on its running statistics, only the
outputs asked for, and BatchNormalizations on the batch's statistics spelled out for a plain ONNX Runtime build
(save_as_onnx)."""

import onnx

from . import rewrites
from .graph_edits import node_inputs, remove_unused


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
    remove_unused(model.graph)


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
    remove_unused(model.graph)
    read = {name for node in model.graph.node for name in node_inputs(node)} | set(names)
    inputs = [graph_input for graph_input in model.graph.input if graph_input.name in read]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
