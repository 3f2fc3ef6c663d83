"""Normalization: BatchNormalization in inference mode (a BatchNorm in eval() inside a model in train(), which ONNX
Runtime's training optimizer would otherwise turn into a training-mode one) and with the batch's statistics (for
a plain ONNX Runtime build), and InstanceNormalization, each as its formula of means and variances. One family
because they share the question of which statistics a node uses (``batch_norm_trains``).
"""

import onnx

from ._building import node_attribute, node_output


def batch_norm_trains(node: onnx.NodeProto, opset_version: int) -> bool:
    """Whether a BatchNormalization computes batch statistics (training_mode from opset 14,
    the optional statistics outputs before)."""
    if opset_version >= 14:
        return bool(node_attribute(node, "training_mode", 0))
    return any(node.output[1:])


def inference_batch_norm(build):
    """BatchNormalization in inference mode (a BatchNorm the user put in eval(), inside a model
    trained in train()) as (x - mean) * (scale / sqrt(var + epsilon)) + bias.

    ONNX Runtime's training optimizer turns every BatchNormalization into its training-mode
    BatchNormInternal, which normalizes with the batch's statistics and overwrites the
    running ones in place (measured on 1.19.2), on a gradient path or not; so
    rewrite_for_training replaces these wherever they are. The running statistics are read,
    never trained; x, scale and bias get torch's gradients. Training-mode nodes are kept.
    """
    if batch_norm_trains(build.node, build.opset):
        return False
    x, scale, bias, mean, variance = build.node.input[:5]
    channel_axes = list(range(1, len(build.shape(x)) - 1))  # [C] -> [C, 1, ...] against [N, C, ...]
    epsilon = build.const(build.attribute("epsilon", 1e-5))
    factor = build.op("Div", [scale, build.op("Sqrt", [build.op("Add", [variance, epsilon])])])
    if channel_axes:
        factor, bias, mean = (build.unsqueeze(tensor, channel_axes) for tensor in (factor, bias, mean))
    build.op("Add", [build.op("Mul", [build.op("Sub", [x, mean]), factor]), bias], node_output(build))
    return True


def batch_statistics_batch_norm(build):
    """A training-mode BatchNormalization as its value, (x - mean) / sqrt(var + epsilon) * scale + bias
    with the batch's mean and biased variance over every axis but the channels': the inference graph
    of a BatchNorm without running statistics, which a plain (not training) ONNX Runtime build runs."""
    if not batch_norm_trains(build.node, build.opset):
        return False
    x, scale, bias = build.node.input[:3]
    rank = len(build.shape(x))
    axes = [0] + list(range(2, rank))
    centered = build.op("Sub", [x, build.reduce("ReduceMean", x, axes, 1)])
    variance = build.reduce("ReduceMean", build.op("Mul", [centered, centered]), axes, 1)
    std = build.op("Sqrt", [build.op("Add", [variance, build.const(build.attribute("epsilon", 1e-5))])])
    channel_axes = list(range(1, rank - 1))
    scale, bias = (build.unsqueeze(tensor, channel_axes) if channel_axes else tensor for tensor in (scale, bias))
    build.op("Add", [build.op("Mul", [build.op("Div", [centered, std]), scale]), bias], node_output(build))


def instance_normalization(build):
    """(x - mean) / sqrt(var + eps) * scale + bias, statistics over the spatial axes."""
    x, scale, bias = build.node.input
    rank = len(build.shape(x))
    axes = list(range(2, rank))
    mean = build.reduce("ReduceMean", x, axes, 1)
    centered = build.op("Sub", [x, mean])
    variance = build.reduce("ReduceMean", build.op("Mul", [centered, centered]), axes, 1)
    std = build.op("Sqrt", [build.op("Add", [variance, build.const(build.attribute("epsilon", 1e-5))])])
    normalized = build.op("Div", [centered, std])
    channel_axes = list(range(1, rank - 1))
    scaled = build.op("Mul", [normalized, build.unsqueeze(scale, channel_axes)])
    build.op("Add", [scaled, build.unsqueeze(bias, channel_axes)], node_output(build))
