"""Small ONNX nodes as torch ops, for the segments of a split graph that torch can take whole.

In a :class:`~orttrainer.torch_convolutions.SplitSession`, a segment between two torch steps is an
ONNX Runtime session of its own: each one costs binding its inputs, the run's overhead and its
outputs by DLPack, and runs on one thread while torch's kernels use all (benchmarks/NOTES.md §35).
A squeeze-excitation block, for one, leaves five such segments of small elementwise ops,
reductions and shape nodes between its convolutions. When every node of a segment is one of the
ops here, torch runs the segment node by node instead.

Each step computes what ONNX Runtime's kernel for the node computes, element for element
(tests/test_torch_ops.py checks them against ONNX Runtime at edge values), but for the sums of
``ReduceSum`` and ``GlobalAveragePool``, which add in torch's order: the order of torch's own
``sum`` and ``mean``, which autograd and ``adaptive_avg_pool2d`` use.
"""

import onnx
import torch

from ..graph.rewrites import node_attributes

TORCH_DOMAIN = "orttrainer.torch"  # nodes only torch runs (no ONNX Runtime kernel): a graph holding one must be split

# Cast targets whose conversions torch does as ONNX Runtime does, checked at edge values (NaN, ±inf and out of
# range to integers: the CPU's conversion, the type's lowest value, on both sides)
_CAST_TYPES = {onnx.TensorProto.FLOAT: torch.float32, onnx.TensorProto.DOUBLE: torch.float64,
               onnx.TensorProto.INT64: torch.int64, onnx.TensorProto.INT32: torch.int32, onnx.TensorProto.BOOL: torch.bool}


class NodeStep:
    """A node torch runs (subclasses: ``run``, values by name -> outputs by name)."""

    def __init__(self, node: onnx.NodeProto):
        self.node = node
        self.inputs = list(node.input)
        self.outputs = list(node.output)
        self.attributes = node_attributes(node)


class Sum(NodeStep):
    """A ``Sum`` (or ``Identity``) node as torch's additions, left to right, in place into the first sum while
    what is added does not broadcast it larger; an Identity hands its input on."""

    def run(self, values: dict) -> dict:
        total = values[self.inputs[0]]
        for index, name in enumerate(self.inputs[1:]):
            value = values[name]
            in_place = index > 0 and torch.broadcast_shapes(total.shape, value.shape) == total.shape
            total = total.add_(value) if in_place else total + value
        return {self.outputs[0]: total}


class FunctionStep(NodeStep):
    """A node whose ONNX op is one torch function of its inputs (numpy broadcasting on both sides)."""

    def __init__(self, node: onnx.NodeProto, function):
        super().__init__(node)
        self.function = function

    def run(self, values: dict) -> dict:
        return {self.outputs[0]: self.function(*(values[name] for name in self.inputs))}


def _divide(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """ONNX's Div: true division for floats, C++'s (towards zero) for integers."""
    return torch.div(a, b) if a.is_floating_point() else torch.div(a, b, rounding_mode="trunc")


class _Clip(NodeStep):
    """``Clip`` (opset 11 on: bounds as optional inputs) as ``torch.clamp``, NaN kept. A bound not given is, as in
    ONNX Runtime's kernel, the type's largest finite value: ±inf come out as ±FLT_MAX."""

    def run(self, values: dict) -> dict:
        x = values[self.inputs[0]]
        limits = torch.finfo(x.dtype) if x.is_floating_point() else torch.iinfo(x.dtype)
        low, high = (values[name] if name else None for name in (self.inputs + ["", ""])[1:3])
        return {self.outputs[0]: torch.clamp(x, limits.min if low is None else low, limits.max if high is None else high)}


class _Cast(NodeStep):
    def run(self, values: dict) -> dict:
        return {self.outputs[0]: values[self.inputs[0]].to(_CAST_TYPES[self.attributes["to"]])}


class _Size(NodeStep):
    def run(self, values: dict) -> dict:
        return {self.outputs[0]: torch.tensor(values[self.inputs[0]].numel(), dtype=torch.int64)}


class _Shape(NodeStep):
    """``Shape`` with its ``start`` and ``end`` (negative from the back, clamped: Python's slice)."""

    def run(self, values: dict) -> dict:
        shape = list(values[self.inputs[0]].shape)[self.attributes.get("start", 0) : self.attributes.get("end")]
        return {self.outputs[0]: torch.tensor(shape, dtype=torch.int64)}


class _Reshape(NodeStep):
    """``Reshape``: -1 inferred, 0 the input's size there unless ``allowzero``."""

    def run(self, values: dict) -> dict:
        x, shape = values[self.inputs[0]], values[self.inputs[1]].tolist()
        if not self.attributes.get("allowzero", 0):
            shape = [x.shape[index] if size == 0 else size for index, size in enumerate(shape)]
        return {self.outputs[0]: x.reshape(shape)}


class _Expand(NodeStep):
    """``Expand`` (broadcast both ways) as a view: torch's next op reads it without the copy ONNX Runtime writes;
    a segment that reads it gets it contiguous (``_Segment.run``)."""

    def run(self, values: dict) -> dict:
        x, shape = values[self.inputs[0]], values[self.inputs[1]].tolist()
        return {self.outputs[0]: x.expand(torch.broadcast_shapes(x.shape, tuple(shape)))}


class _WithAxes(NodeStep):
    def axes(self, values: dict):
        """The node's axes: its second input (opset 13 on), else its attribute, else None."""
        if len(self.inputs) > 1 and self.inputs[1]:
            return values[self.inputs[1]].tolist()
        return self.attributes.get("axes")


class _ReduceSum(_WithAxes):
    """``ReduceSum`` with ``keepdims`` and ``noop_with_empty_axes`` (no axes: all, as torch's ``sum`` over an
    empty list)."""

    def run(self, values: dict) -> dict:
        x, axes = values[self.inputs[0]], self.axes(values)
        keep = bool(self.attributes.get("keepdims", 1))
        if not axes and self.attributes.get("noop_with_empty_axes", 0):
            return {self.outputs[0]: x}
        return {self.outputs[0]: x.sum(dim=axes, keepdim=keep)}


class _Unsqueeze(_WithAxes):
    def run(self, values: dict) -> dict:
        x, axes = values[self.inputs[0]], self.axes(values)
        shape, rank = list(x.shape), x.dim() + len(axes)
        for axis in sorted(axis % rank for axis in axes):
            shape.insert(axis, 1)
        return {self.outputs[0]: x.reshape(shape)}


class _Squeeze(_WithAxes):
    """``Squeeze`` of the given axes, or of every size-1 axis; an axis of another size is an error, as in ONNX
    Runtime (torch's ``squeeze`` would keep it)."""

    def run(self, values: dict) -> dict:
        x, axes = values[self.inputs[0]], self.axes(values)
        axes = [axis % x.dim() for axis in axes] if axes else [axis for axis, size in enumerate(x.shape) if size == 1]
        if any(x.shape[axis] != 1 for axis in axes):
            raise ValueError(f"Squeeze node '{self.node.name}': axes {axes} of shape {list(x.shape)} are not all of size 1")
        return {self.outputs[0]: x.reshape([size for axis, size in enumerate(x.shape) if axis not in axes])}


class _Transpose(NodeStep):
    """``Transpose`` as a view (``perm`` default: the dims reversed); a segment that reads it gets it contiguous."""

    def run(self, values: dict) -> dict:
        x = values[self.inputs[0]]
        return {self.outputs[0]: x.permute(self.attributes.get("perm", list(reversed(range(x.dim())))))}


class _Concat(NodeStep):
    """``Concat``, and com.microsoft's ``ConcatTraining``, which also writes each input's length along the axis."""

    def run(self, values: dict) -> dict:
        parts = [values[name] for name in self.inputs]
        axis = self.attributes["axis"]
        produced = {self.outputs[0]: torch.cat(parts, dim=axis)}
        if len(self.outputs) > 1 and self.outputs[1]:
            produced[self.outputs[1]] = torch.tensor([part.shape[axis] for part in parts], dtype=torch.int64)
        return produced


class _Split(NodeStep):
    """``Split`` (and com.microsoft's ``SplitTraining``) into views, by the sizes given as the second input, else into
    parts of ceil(size / outputs) (equal parts; opset 18's ``num_outputs``, the last one smaller)."""

    def run(self, values: dict) -> dict:
        x, axis = values[self.inputs[0]], self.attributes.get("axis", 0)
        if len(self.inputs) > 1 and self.inputs[1]:
            sizes = values[self.inputs[1]].tolist()
        else:
            sizes = -(-x.shape[axis] // len(self.outputs))
        return {name: part for name, part in zip(self.outputs, torch.split(x, sizes, dim=axis)) if name}


class _GlobalAveragePool(NodeStep):
    """``GlobalAveragePool`` as torch's mean over the spatial dims (what ``adaptive_avg_pool2d`` to 1x1 computes)."""

    def run(self, values: dict) -> dict:
        x = values[self.inputs[0]]
        return {self.outputs[0]: x.mean(dim=tuple(range(2, x.dim())), keepdim=True)}


class _Scale(NodeStep):
    """com.microsoft ``Scale``: x times the scalar, or with ``scale_down`` times its reciprocal (ONNX Runtime's order)."""

    def run(self, values: dict) -> dict:
        x, scale = values[self.inputs[0]], values[self.inputs[1]].to(values[self.inputs[0]].dtype)
        return {self.outputs[0]: x * (1 / scale if self.attributes.get("scale_down", 0) else scale)}


class _BroadcastGradientArgs(NodeStep):
    """com.microsoft ``BroadcastGradientArgs`` (two shapes): for each, the axes of the broadcast result it was
    broadcast along, last axis first, as ONNX Runtime lists them (an axis both sides lack counts for the shorter)."""

    def run(self, values: dict) -> dict:
        a, b = (values[name].tolist() for name in self.inputs[:2])
        a_axes, b_axes = [], []
        rank = max(len(a), len(b))
        for axis in reversed(range(rank)):
            a_size = a[axis - rank + len(a)] if axis >= rank - len(a) else None
            b_size = b[axis - rank + len(b)] if axis >= rank - len(b) else None
            if a_size is None:
                a_axes.append(axis)
            elif b_size is None:
                b_axes.append(axis)
            elif a_size != b_size:
                if a_size != 1 and b_size != 1:
                    raise ValueError(f"{self.node.op_type} node '{self.node.name}': shapes {a} and {b} do not broadcast")
                (a_axes if a_size == 1 else b_axes).append(axis)
        produced = dict(zip(self.outputs, (torch.tensor(a_axes, dtype=torch.int64), torch.tensor(b_axes, dtype=torch.int64))))
        return {name: tensor for name, tensor in produced.items() if name}


_FUNCTIONS = {
    "Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": _divide, "Neg": torch.neg, "Relu": torch.relu,
    "Greater": torch.gt, "GreaterOrEqual": torch.ge, "Less": torch.lt, "LessOrEqual": torch.le, "Equal": torch.eq,
    "And": torch.logical_and, "Or": torch.logical_or, "Not": torch.logical_not, "Where": torch.where,
}  # fmt: skip
_STEPS = {
    "Sum": Sum, "Identity": Sum, "Clip": _Clip, "Cast": _Cast, "Size": _Size, "Shape": _Shape, "Reshape": _Reshape,
    "Expand": _Expand, "ReduceSum": _ReduceSum, "Unsqueeze": _Unsqueeze, "Squeeze": _Squeeze,
    "GlobalAveragePool": _GlobalAveragePool, "Transpose": _Transpose, "Concat": _Concat, "Split": _Split,
}  # fmt: skip
_MICROSOFT_STEPS = {"Scale": _Scale, "BroadcastGradientArgs": _BroadcastGradientArgs, "ConcatTraining": _Concat,
                    "SplitTraining": _Split}  # fmt: skip


def runs_on_torch(node: onnx.NodeProto) -> bool:
    """Whether ``node`` is one of the ops here, in a form its step computes as ONNX Runtime does."""
    if node.domain == "com.microsoft":
        return node.op_type in _MICROSOFT_STEPS
    if node.domain not in ("", "ai.onnx") or (node.op_type not in _FUNCTIONS and node.op_type not in _STEPS):
        return False
    attributes = node_attributes(node)
    if node.op_type == "Clip":
        return "min" not in attributes and "max" not in attributes  # opset 6's attribute bounds
    if node.op_type == "Cast":
        return attributes.get("to") in _CAST_TYPES
    return True


def step(node: onnx.NodeProto) -> NodeStep:
    """The torch step for a node ``runs_on_torch`` accepts."""
    if node.op_type in _FUNCTIONS and node.domain != "com.microsoft":
        return FunctionStep(node, _FUNCTIONS[node.op_type])
    steps = _MICROSOFT_STEPS if node.domain == "com.microsoft" else _STEPS
    return steps[node.op_type](node)
