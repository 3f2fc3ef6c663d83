"""Dropout made switchable: Dropouts of ratio 0 become Identities, and every other Dropout's ratio is
multiplied by a graph input (1 trains, 0 turns dropout off for the first-step check against torch); and the
other ops that draw random numbers."""

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .graph_edits import remove_unused, sort_topologically


DROPOUT_SCALE_INPUT = "orttrainer.dropout_scale"  # float scalar times every dropout ratio: 1 trains, 0 turns dropout off


# Ops that draw random numbers (Dropout aside, which the trainer turns off for the first-step check).
RANDOM_OPS = ("RandomUniform", "RandomUniformLike", "RandomNormal", "RandomNormalLike", "Multinomial", "Bernoulli")


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
    remove_unused(model.graph)


def dropout_ratio_times_input(model: onnx.ModelProto, scalable: bool = True) -> None:
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
    sort_topologically(graph)
