"""Mixed precision: the float16 conversion of a graph (the ops listed kept in float32), the loss scale
graph input, and float32 runs of the gradient ops ONNX Runtime 1.19 has no float16 CPU kernel for."""

import onnx
from onnx import helper

from .graph_edits import with_ir_version


LOSS_SCALE_INPUT = "orttrainer.loss_scale"
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


def to_mixed_precision(model: onnx.ModelProto, keep_float32) -> onnx.ModelProto:
    """Compute in float16: weights and inputs stay float32 graph inputs (cast on entry, so
    their gradients come back float32), as do the outputs named in ``keep_float32``."""
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    inputs = [graph_input.name for graph_input in model.graph.input]
    converted = convert_float_to_float16(
        model, keep_io_types=inputs + list(keep_float32), op_block_list=DEFAULT_OP_BLOCK_LIST + _FLOAT32_OPS
    )
    return with_ir_version(converted)


_NO_FLOAT16_GRADIENT_KERNEL = ("SliceGrad", "SplitTraining")  # SplitTraining: Concat's gradient (an LSTM's weights)


def float32_gradient_kernels(model: onnx.ModelProto) -> None:
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


def scale_loss(model: onnx.ModelProto, loss_name: str) -> str:
    """Multiply the loss by a float32 input (the loss scale), so that no re-export is needed."""
    model.graph.input.append(helper.make_tensor_value_info(LOSS_SCALE_INPUT, onnx.TensorProto.FLOAT, []))
    model.graph.node.append(helper.make_node("Mul", [loss_name, LOSS_SCALE_INPUT], [_SCALED_LOSS], name=_SCALED_LOSS))
    model.graph.output.append(helper.make_empty_tensor_value_info(_SCALED_LOSS))
    return _SCALED_LOSS
