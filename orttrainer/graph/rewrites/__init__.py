"""Rewrite ops onnxruntime-training cannot differentiate into equivalent ops it can.

Each rewrite is a small function ``(build) -> None`` that emits, through ``build``, nodes
computing the node's output from its inputs with ops that have gradient builders (and
fast CPU gradient kernels) in onnxruntime-training 1.19; one that returns ``False``
leaves this node as it is. Values and gradients match torch, also at 0, tiny, huge, infinite
and NaN inputs, ties and kinks (tests/test_rewrites.py, tests/test_boundary_values.py); each
docstring names what cannot match exactly. ``rewrite_for_training`` applies them to a whole
graph; only the training graph is rewritten, inference keeps the original (faster) ops.

One module per op family: activations.py (Softplus, Elu, Celu, Selu, HardSigmoid, PRelu, Relu/Clip
before a singular op), normalization.py (BatchNormalization, InstanceNormalization), pooling.py
(AveragePool, torch's ceil_mode pools), resizing.py (Resize), indexing.py (Gather, reversing Slice,
Pad, DepthToSpace, SpaceToDepth, Scatter with reduction), reductions.py (Reduce*, CumSum, Sum, Mean),
elementwise.py (Sinh, Cosh, Asinh, Acosh, Atanh, Sign), einsum.py (Einsum), convolutions.py
(ConvTranspose, auto_pad, grouped Conv) and arithmetic.py (broadcast gradients, Max/Min, Add of
quotients). _building.py holds what they all build with (``NodeBuilder``, ``replace_nodes``, ``where``,
``detached``, ...); shapes.py and folding.py what is known of a graph before it runs (inferred shapes,
folded sizes); table.py the table of rewrites and ``rewrite_for_training``. Here: the names the rest
of orttrainer uses.
"""

from ._building import (
    STOP_GRADIENT,
    GraphFacts,
    NodeBuilder,
    OpEmitter,
    RewriteError,
    SizesNeeded,
    detached,
    is_negative_zero,
    log1p,
    mask,
    node_attribute,
    node_attributes,
    opset,
    replace_nodes,
    sign_bit,
    stop_gradient,
    where,
)
from .activations import ZERO_GRADIENT_AT_BOUNDS, is_torch_hard_sigmoid
from .arithmetic import quotients_kept_apart
from .convolutions import explicit_convolution_pads, grouped_convolutions
from .folding import fold_static_sizes
from .normalization import batch_statistics_batch_norm
from .pooling import torch_pools
from .reductions import CUMPROD_PRODUCTS, cumprod_gradient, first_extreme, first_extreme_index, inclusive_scan
from .shapes import copy_with_inputs_for, shapes_in, static_shapes, structure_for_inference, symbolic_shapes
from .table import rewrite_for_training

__all__ = [
    "CUMPROD_PRODUCTS",
    "STOP_GRADIENT",
    "ZERO_GRADIENT_AT_BOUNDS",
    "GraphFacts",
    "NodeBuilder",
    "OpEmitter",
    "RewriteError",
    "SizesNeeded",
    "batch_statistics_batch_norm",
    "copy_with_inputs_for",
    "cumprod_gradient",
    "detached",
    "explicit_convolution_pads",
    "first_extreme",
    "first_extreme_index",
    "fold_static_sizes",
    "grouped_convolutions",
    "inclusive_scan",
    "is_negative_zero",
    "is_torch_hard_sigmoid",
    "log1p",
    "mask",
    "node_attribute",
    "node_attributes",
    "opset",
    "quotients_kept_apart",
    "replace_nodes",
    "rewrite_for_training",
    "shapes_in",
    "sign_bit",
    "static_shapes",
    "stop_gradient",
    "structure_for_inference",
    "symbolic_shapes",
    "torch_pools",
    "where",
]
