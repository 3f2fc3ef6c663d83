"""What every symbolic builds with: torch's export graph as a ``rewrites.OpEmitter`` (so that rewrites.py's
formulas emit into it), constants of an exported value's type, torch's loss reductions, and the module a node
comes from (for errors)."""

import numpy as np
import torch
from torch.onnx._internal.torchscript_exporter import _type_utils

from ...graph import rewrites


_REDUCTIONS = {0: None, 1: "ReduceMean", 2: "ReduceSum"}
DOMAIN = "orttrainer"  # custom-domain marker nodes, which exported_graph.resolve_markers resolves right after export


def _constant(g, value):
    return g.op("Constant", value_t=torch.tensor(value, dtype=torch.float32))


def _reduce(g, loss, reduction):
    """torch's reduction enum: 0 none, 1 mean, 2 sum (over every element)."""
    op = _REDUCTIONS[reduction]
    return loss if op is None else g.op(op, loss, keepdims_i=0)


def _attribute_suffix(value) -> str:
    """The exporter's attribute type suffix: f (float, floats), s (str), i (int, bool, ints)."""
    sample = value[0] if isinstance(value, (list, tuple)) and value else value
    return "s" if isinstance(sample, str) else "f" if isinstance(sample, float) else "i"


class _ExportGraph(rewrites.OpEmitter):
    """rewrites' formulas (log1p, first_extreme, detached) emitting into torch's export graph."""

    def __init__(self, g):
        self.g, self.opset = g, g.opset

    def op(self, op_type, inputs, output=None, **attributes):  # torch names the outputs
        suffixed = {f"{name}_{_attribute_suffix(value)}": value for name, value in attributes.items()}
        return self.g.op(op_type, *inputs, **suffixed)

    def const(self, value, dtype=np.float32):
        return self.g.op("Constant", value_t=torch.from_numpy(np.array(value, dtype=dtype)))


def _numpy_dtype(value) -> np.dtype:
    """The element type of an exported value, as numpy's (for constants of the same type)."""
    return torch.empty(0, dtype=_type_utils.JitScalarType.from_value(value).dtype()).numpy().dtype


def _module_scope(g) -> str:
    """The name of the module whose node is being exported ('bag' from torch's scope name
    'torch.nn.modules.sparse.EmbeddingBag::bag')."""
    return g.original_node.scopeName().rsplit("/", 1)[-1].split("::")[-1] or "?"
