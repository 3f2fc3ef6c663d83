"""The eval (inference) graph: dropout off, BatchNormalization on its running statistics, the values a forward
computes otherwise in eval mode (``IN_TRAINING``), no buffer written, only the outputs asked for, and BatchNormalizations on the batch's statistics spelled out for a plain ONNX Runtime build
(save_as_onnx)."""

import onnx
from onnx import helper

from . import rewrites
from .graph_edits import node_inputs, remove_unused
from .outputs_for_trainer import written_buffers


# The condition of a Where whose first value is the training forward's and second the eval-mode forward's (a buffer
# before a training forward's write, InstanceNorm on its running statistics): export.buffer_writes.in_training.
IN_TRAINING = "orttrainer.in_training"


def take_branches(model: onnx.ModelProto, training: bool) -> None:
    """Replace, in place, every ``Where(IN_TRAINING, training value, eval value)`` by the value of the mode, and drop
    what only the other computed."""
    for node in model.graph.node:
        if node.op_type == "Where" and node.input[0] == IN_TRAINING:
            kept = node.input[1 if training else 2]
            node.CopyFrom(helper.make_node("Identity", [kept], list(node.output), name=node.name))
    remove_unused(model.graph)


def set_inference_mode(model: onnx.ModelProto) -> None:
    """Dropout off, BatchNormalization on running statistics, the eval-mode values (``take_branches``), and the new
    values of the buffers a training forward writes no outputs (the eval graph: torch's forward in eval mode writes
    none). A BatchNormalization
    whose running statistics are neither graph inputs nor initializers has none (``track_running_stats=False``:
    placeholders computed in the graph, symbolics.layers.batch_norm): it normalizes by the batch's statistics in
    eval too, as torch's."""
    written = set(written_buffers(model).values())
    outputs = [output for output in model.graph.output if output.name not in written]
    del model.graph.output[:]
    model.graph.output.extend(outputs)
    take_branches(model, training=False)
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
