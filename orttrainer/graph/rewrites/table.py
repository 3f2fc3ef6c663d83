"""The table of rewrites for training (``REWRITES``: op type -> the rewrite that replaces it) and
``rewrite_for_training``, which applies it to the nodes on a training graph's gradient path. Apart from the
families because it imports them all.
"""

import onnx

from ._building import opset, replace_nodes
from .activations import celu, elu, hard_sigmoid, prelu, select_before_singular, selu, softplus
from .arithmetic import broadcast_gradient, pairwise_extreme
from .convolutions import conv_transpose
from .einsum import einsum
from .elementwise import acosh, asinh, atanh, cosh, sign, sinh
from .folding import known_values
from .indexing import constant_index_gather, depth_to_space, edge_pad, reversing_slice, scatter_with_reduction, space_to_depth
from .normalization import batch_norm_trains, inference_batch_norm, instance_normalization
from .pooling import average_pool
from .reductions import (
    cumsum,
    reduce_extreme,
    reduce_keeping_dims,
    reduce_l1,
    reduce_log_sum,
    reduce_sum_square,
    variadic_mean,
    variadic_sum,
)
from .resizing import resize
from .shapes import static_shapes, symbolic_shapes


REWRITES = {
    "Softplus": softplus,
    "Elu": elu,
    "Celu": celu,
    "Selu": selu,
    "HardSigmoid": hard_sigmoid,
    "PRelu": prelu,
    "BatchNormalization": inference_batch_norm,
    "InstanceNormalization": instance_normalization,
    "AveragePool": average_pool,
    "Resize": resize,
    "Slice": reversing_slice,
    "Pad": edge_pad,
    "ReduceLogSumExp": reduce_keeping_dims,
    "ReduceL2": reduce_keeping_dims,
    "Gather": constant_index_gather,
    "DepthToSpace": depth_to_space,
    "SpaceToDepth": space_to_depth,
    "CumSum": cumsum,
    "ReduceMax": reduce_extreme,
    "ReduceMin": reduce_extreme,
    "ReduceSumSquare": reduce_sum_square,
    "ReduceL1": reduce_l1,
    "ReduceLogSum": reduce_log_sum,
    "Sum": variadic_sum,
    "Mean": variadic_mean,
    "Sinh": sinh,
    "Cosh": cosh,
    "Asinh": asinh,
    "Acosh": acosh,
    "Atanh": atanh,
    "Sign": sign,
    "Einsum": einsum,
    "ConvTranspose": conv_transpose,
    "ScatterElements": scatter_with_reduction,
    "Relu": select_before_singular,
    "Clip": select_before_singular,
    "ScatterND": scatter_with_reduction,
    **dict.fromkeys(("Where", "Add", "Sub", "Mul", "Div", "Pow"), broadcast_gradient),
    "Max": pairwise_extreme,
    "Min": pairwise_extreme,
}


def _is_target(node: onnx.NodeProto, only_between, opset_version: int) -> bool:
    """Whether ``rewrite_for_training`` replaces ``node``: an op with a rewrite on a gradient
    path; an inference-mode BatchNormalization anywhere (ONNX Runtime's training optimizer
    breaks it off the path too, see inference_batch_norm)."""
    if node.op_type == "BatchNormalization":
        return not batch_norm_trains(node, opset_version)
    return node.op_type in REWRITES and (only_between is None or node.name in only_between)


def rewrite_for_training(model: onnx.ModelProto, only_between=None) -> list:
    """Replace, in place, every node whose op type has a rewrite; return the rewritten node names.

    ``only_between`` (a set of node names) limits the rewrite to nodes on a gradient path
    (inference-mode BatchNormalization excepted, see ``_is_target``).
    """
    targets = [node for node in model.graph.node if _is_target(node, only_between, opset(model))]
    rewritten = []
    while targets:  # again for the nodes whose facts (a shape after a rewritten Resize) only a rewrite made known
        symbols, failed = symbolic_shapes(model), {}
        done = replace_nodes(model, REWRITES, targets, static_shapes(model, symbols), known_values(model), symbols, failed)
        rewritten += done
        if failed and not done:
            raise next(iter(failed.values()))
        targets = [node for node in model.graph.node if node.name in failed]
    return rewritten
