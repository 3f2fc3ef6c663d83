"""What every symbolic builds with: torch's export graph as a ``rewrites.OpEmitter`` (so that rewrites.py's
formulas emit into it), constants of an exported value's type, bfloat16 inputs computed in float32, torch's loss
reductions, and the module a node comes from (for errors)."""

import functools

import numpy as np
import onnx
import torch
from torch.onnx._internal.torchscript_exporter import _type_utils

from ...graph import rewrites


DOMAIN = "orttrainer"  # custom-domain marker nodes, which exported_graph.resolve_markers resolves right after export


def _constant(g, value):
    return g.op("Constant", value_t=torch.tensor(value, dtype=torch.float32))


def _whole_sum(g, x):
    """The sum of every element of ``x``, 0-d, as torch's ``sum``, also of an empty tensor (0.0). torch's exporter
    keeps the dimensions (shape [1, 1, 1] for a [3, 2, 0] input) when the traced input has a size-0 dimension."""
    return g.op("ReduceSum", x, keepdims_i=0)


def _whole_mean(g, x):
    """The mean of every element of ``x``, 0-d, as torch's ``mean``: the sum over the element count, NaN (0 / 0) for an
    empty tensor, where ONNX Runtime's ReduceMean gives 0."""
    count = g.op("Cast", g.op("Size", x), to_i=_type_utils.JitScalarType.from_value(x).onnx_type())
    return g.op("Div", _whole_sum(g, x), count)


_REDUCTIONS = {0: None, 1: _whole_mean, 2: _whole_sum}


def _reduce(g, loss, reduction):
    """torch's reduction enum: 0 none, 1 mean, 2 sum (over every element)."""
    whole = _REDUCTIONS[reduction]
    return loss if whole is None else whole(g, loss)


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
        """A Constant of ``value`` in ``dtype``: a torch dtype (an exported value's, ``_dtype``) or a numpy one (the
        literal types of rewrites' formulas)."""
        return self.g.op("Constant", value_t=torch.as_tensor(value, dtype=_torch_dtype(dtype)))


def _torch_dtype(dtype) -> torch.dtype:
    """``dtype`` (torch's or numpy's) as torch's."""
    return dtype if isinstance(dtype, torch.dtype) else torch.from_numpy(np.empty(0, dtype)).dtype


def _dtype(value) -> torch.dtype:
    """The element type of an exported value, as torch's (for constants of the same type): numpy has no bfloat16,
    the type of a value torch.autocast computed in bfloat16."""
    return _type_utils.JitScalarType.from_value(value).dtype()


def _bfloat16_in_float32(symbolic):
    """``symbolic`` computing in float32 where its inputs are bfloat16 (values torch.autocast computed in bfloat16):
    those inputs cast to float32, the outputs torch's op gives in bfloat16 cast back. The symbolic's own float32
    formulas and constants then apply, and it rounds once, as torch's bfloat16 CPU kernels do (ONNX Runtime's CPU
    provider has no bfloat16 kernels for it either: graph/bfloat16.py)."""

    @functools.wraps(symbolic)
    def in_float32(g, *args, **kwargs):
        if not any(_is_bfloat16(arg) for arg in args):
            return symbolic(g, *args, **kwargs)
        widened = [g.op("Cast", arg, to_i=onnx.TensorProto.FLOAT) if _is_bfloat16(arg) else arg for arg in args]
        outputs = symbolic(g, *widened, **kwargs)
        several = isinstance(outputs, (tuple, list))
        rounded = [g.op("Cast", output, to_i=onnx.TensorProto.BFLOAT16) if _is_bfloat16(original) and output is not None
                   else output for output, original in zip(outputs if several else [outputs], g.original_node.outputs())]
        return type(outputs)(rounded) if several else rounded[0]

    return in_float32


def _is_bfloat16(value) -> bool:
    """Whether ``value`` (a symbolic's argument, or a node's output) is a bfloat16 tensor."""
    return (isinstance(value, torch._C.Value) and isinstance(value.type(), torch._C.TensorType)
            and value.type().scalarType() == "BFloat16")


def _module_scope(g) -> str:
    """The name of the module whose node is being exported ('bag' from torch's scope name
    'torch.nn.modules.sparse.EmbeddingBag::bag')."""
    return g.original_node.scopeName().rsplit("/", 1)[-1].split("::")[-1] or "?"
