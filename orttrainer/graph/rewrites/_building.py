"""What every rewrite builds with: node attributes, the facts a rewrite may know about its graph
(``GraphFacts``), the opset-aware emitter (``OpEmitter``, which symbolics/ implements too, so that export and
rewrite write the same formulas) and ``NodeBuilder``, which emits one node's replacement; ``replace_nodes``,
which applies a table of rewrites to chosen nodes; and the small formulas several families share (``where``
and ``mask`` to select a branch, ``compare``, ``log1p``, and ``detached`` with what is built on it: torch's
detach as ``stop_gradient``, ``sign_bit``). Kept apart so that each family module reads only what it uses.
"""

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper


def node_attributes(node: onnx.NodeProto) -> dict:
    """``node``'s attributes by name (strings as str)."""
    return {attribute.name: _decoded(helper.get_attribute_value(attribute)) for attribute in node.attribute}


def node_attribute(node: onnx.NodeProto, name: str, default=None):
    """The value of ``node``'s attribute ``name`` (strings as str), or ``default``."""
    for attribute in node.attribute:
        if attribute.name == name:
            return _decoded(helper.get_attribute_value(attribute))
    return default


def _decoded(value):
    return value.decode() if isinstance(value, bytes) else value


class RewriteError(ValueError):
    """An op could be rewritten in general, but not this instance (e.g. a dynamic dimension)."""

    node_name = ""  # the node whose rewrite failed, set by the rewrite's caller


class SizesNeeded(RewriteError):
    """A node computes torch's values at some sizes only, and the graph leaves those sizes dynamic: it must be
    exported with them fixed."""


@dataclass
class GraphFacts:
    """What a rewrite may know about the whole graph besides the node it replaces."""

    opset: int
    shapes: dict  # tensor name -> static shape (None for dynamic dims)
    constants: dict  # tensor name -> value known before the run
    producers: dict  # tensor name -> the node that outputs it
    consumers: dict  # tensor name -> the nodes that read it, in graph order
    targets: set  # names of the nodes being replaced
    symbols: dict = field(default_factory=dict)  # tensor name -> shape with dim_param names (str) kept


class OpEmitter:
    """Opset-aware reductions and (un)squeezes over ``op`` and ``const``.

    The formulas below are written against this interface, so that symbolics/ emits the
    same constructions into torch's export graph as the rewrites emit into an ONNX graph.
    """

    opset: int

    def op(self, op_type, inputs, output=None, **attributes):
        raise NotImplementedError

    def const(self, value, dtype=np.float32):
        raise NotImplementedError

    def reduce(self, op_type, x, axes, keepdims, output=None):
        """ReduceX with ``axes`` as attribute or input, whichever this opset wants."""
        axes_as_input = self.opset >= (13 if op_type == "ReduceSum" else 18)
        if axes is None:
            return self.op(op_type, [x], output, keepdims=keepdims)
        if axes_as_input:
            return self.op(op_type, [x, self.const(axes, np.int64)], output, keepdims=keepdims)
        return self.op(op_type, [x], output, axes=list(axes), keepdims=keepdims)

    def unsqueeze(self, x, axes):
        if self.opset >= 13:
            return self.op("Unsqueeze", [x, self.const(axes, np.int64)])
        return self.op("Unsqueeze", [x], axes=list(axes))

    def squeeze(self, x, axes, output=None):
        if self.opset >= 13:
            return self.op("Squeeze", [x, self.const(axes, np.int64)], output)
        return self.op("Squeeze", [x], output, axes=list(axes))


class NodeBuilder(OpEmitter):
    """Emits the nodes replacing one node: unique names, constants, the node's facts."""

    def __init__(self, node: onnx.NodeProto, facts: GraphFacts):
        self.node, self.facts = node, facts
        self.opset, self.shapes, self.constants = facts.opset, facts.shapes, facts.constants
        self.nodes, self.initializers = [], []
        self._count = 0

    def fresh_name(self):
        """A node/tensor name no other replacement uses."""
        self._count += 1
        return f"{self.node.name}_rewritten_{self._count}"  # same scope, so error messages keep the module path

    def op(self, op_type, inputs, output=None, **attributes):
        name = self.fresh_name()
        self.nodes.append(helper.make_node(op_type, inputs, [output or name], name=name, **attributes))
        return output or name

    def const(self, value, dtype=np.float32):
        name = self.fresh_name()
        self.initializers.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def attribute(self, name, default=None):
        return node_attribute(self.node, name, default)

    def shape(self, name):
        """Static shape (None for dynamic dims) of a tensor, from ONNX shape inference."""
        if name not in self.shapes:
            raise RewriteError(f"{self.node.op_type} node '{self.node.name}': the shape of '{name}' is unknown")
        return self.shapes[name]

    def static_dims(self, name, dims):
        shape = self.shape(name)
        if any(shape[dim] is None for dim in dims):
            raise RewriteError(
                f"{self.node.op_type} node '{self.node.name}' needs static dimensions {list(dims)} of '{name}', got {shape}"
            )
        return [shape[dim] for dim in dims]

    def constant_input(self, index):
        name = self.node.input[index] if len(self.node.input) > index else ""
        if name not in self.constants:
            raise RewriteError(f"{self.node.op_type} node '{self.node.name}': input {index} must be a constant")
        return self.constants[name]

    def reduce_axes(self):
        """(axes, keepdims) of the Reduce node being replaced, wherever its opset keeps them."""
        keepdims = self.attribute("keepdims", 1)
        axes = self.attribute("axes")
        if axes is None and len(self.node.input) > 1 and self.node.input[1]:
            axes = [int(axis) for axis in self.constant_input(1).reshape(-1)]
        return axes, keepdims


def opset(model: onnx.ModelProto) -> int:
    return next(entry.version for entry in model.opset_import if entry.domain in ("", "ai.onnx"))


def replace_nodes(model: onnx.ModelProto, table: dict, targets, shapes=None, constants=None, symbols=None,
                  failed=None) -> list:  # fmt: skip
    """Replace, in place, each of ``targets`` by what ``table[op_type]`` builds; return their names.

    A table function that returns ``False`` keeps its node; ``shapes``, ``constants`` and
    ``symbols`` go into the :class:`GraphFacts` the functions see. With ``failed`` (a dict), a
    node whose function raises RewriteError is kept and its error recorded there by node name.
    """
    consumers = defaultdict(list)
    for node in model.graph.node:
        for name in node.input:
            consumers[name].append(node)
    producers = {output: node for node in model.graph.node for output in node.output}
    facts = GraphFacts(opset(model), shapes or {}, constants or {}, producers, consumers, {node.name for node in targets},
                       symbols or {})
    target_ids = {id(node) for node in targets}
    rebuilt, rewritten = [], []
    for node in model.graph.node:
        build = NodeBuilder(node, facts) if id(node) in target_ids else None
        if build is not None and _replaced(table, build, failed):
            rebuilt.extend(build.nodes)
            model.graph.initializer.extend(build.initializers)
            rewritten.append(node.name)
        else:
            rebuilt.append(node)
    del model.graph.node[:]
    model.graph.node.extend(rebuilt)
    return rewritten


def _replaced(table: dict, build: NodeBuilder, failed) -> bool:
    """Whether ``table``'s function built a replacement for the node (its RewriteError into ``failed``, if given)."""
    try:
        return table[build.node.op_type](build) is not False
    except RewriteError as error:
        error.node_name = build.node.name
        if failed is None:
            raise
        failed[build.node.name] = error
        return False


def node_output(build):
    return build.node.output[0]


def where(build, condition, if_true, if_false, output=None):
    """Where(condition, if_true, if_false); a float operand becomes a constant.

    A piecewise function is a Where of branches. ONNX Runtime gives the branch not taken a
    zero incoming gradient, and multiplies it by that branch's local derivatives: a branch
    that is inf or NaN where it is not taken, or has an infinite derivative there, turns the
    gradient into 0 * inf = NaN. So each branch below reads its input through a Where that
    replaces the values of the other branches by a safe constant.
    """
    operands = [build.const(value) if isinstance(value, float) else value for value in (if_true, if_false)]
    return build.op("Where", [condition, *operands], output)


def mask(build, condition):
    """1.0 where ``condition`` holds, else 0.0 (a float tensor), to select a branch by multiplying with it.

    In onnxruntime-training 1.19 a Where between tensors and its gradient (two more Wheres) cost
    about ten times a Mul, so the frequent activations select this way; the branch must be
    finite everywhere, 0 * inf being NaN. The mask itself is a Where between two constants
    (nothing to differentiate): ONNX Runtime's bool-to-float Cast and bool Not are scalar loops,
    about 5x slower for the same mask (benchmarks/NOTES.md §18).
    """
    return build.op("Where", [condition, build.const(1.0), build.const(0.0)])


def compare(build, op_type, x, value):
    """Greater/Less/GreaterOrEqual/LessOrEqual/Equal of ``x`` and a float constant."""
    return build.op(op_type, [x, build.const(value)])


def log1p(build, u, reaches_minus_one=True):
    """log(1 + u) to float32 accuracy, value and gradient, for finite u >= -1 (NaN stays NaN).

    w = 1 + u is rounded, and log(w) alone is 0 for |u| below float32's epsilon. For
    |u| <= 1 the rounding error (w - 1) - u is exact, so log(w) - ((w - 1) - u) / w is
    log1p(u) to within about 2 ulp (second-order remainder (u - w + 1)^2 / 2); for u > 1 the
    correction is below an ulp of the result. Its gradient is 1/w + ((w - 1) - u) / w^2 =
    1 / (1 + u) to the same accuracy, +inf at u = -1. If u ``reaches_minus_one``, the
    divisor is max(w, 0.5), to avoid 0/0 there (for u <= -0.5, w is exact and the
    correction 0); a Max and its gradient cost as much as the rest, so callers whose u
    stays >= 0 say so.
    """
    w = build.op("Add", [u, build.const(1.0)])
    error = build.op("Sub", [build.op("Sub", [w, build.const(1.0)]), u])
    divisor = build.op("Max", [w, build.const(0.5)]) if reaches_minus_one else w
    return build.op("Sub", [build.op("Log", [w]), build.op("Div", [error, divisor])])


# detached(): |v| below each bound is first multiplied by the power of two after it; |v| from 2^62 on by 2^-70
_DETACH_SCALES = [(2.0**-97, 2.0**120), (2.0**-57, 2.0**80), (2.0**-17, 2.0**40)]
_DETACH_LARGE = (2.0**62, 2.0**-70)
STOP_GRADIENT = "orttrainer: detach, no gradient"  # the doc_string of an Identity standing for torch's detach


def detached(build, v, output=None):
    """float32 v's value on no gradient path, exactly: ±0, denormals, ±inf and NaN included.

    ONNX Runtime's gradient builder stops at a Cast to an integer type, and has no op that
    passes a float unchanged without a gradient. So v, scaled by a power of two into
    [2^-17, 2^62), passes as its integer part and its fraction in steps of 2^-40, each through
    int64 (with 24 significant bits, both are exact), then is scaled back. ±inf and NaN, which
    have no integer part, and -0, which comes back +0, are selected from constants by masks,
    which carry no gradient either. (ONNX Runtime's Where turns a -0 it takes from its first
    branch into +0, from its second it keeps it.)
    """
    magnitude = build.op("Abs", [v])
    scale = where(build, build.op("GreaterOrEqual", [magnitude, build.const(_DETACH_LARGE[0])]), _DETACH_LARGE[1], 1.0)
    for bound, factor in reversed(_DETACH_SCALES):
        scale = where(build, build.op("Less", [magnitude, build.const(bound)]), factor, scale)
    scaled = build.op("Mul", [v, scale])
    whole = build.op("Cast", [build.op("Cast", [scaled], to=onnx.TensorProto.INT64)], to=onnx.TensorProto.FLOAT)
    fraction = build.op("Mul", [build.op("Sub", [scaled, whole]), build.const(2.0**40)])
    steps = build.op("Cast", [build.op("Cast", [fraction], to=onnx.TensorProto.INT64)], to=onnx.TensorProto.FLOAT)
    finite = build.op("Div", [build.op("Add", [whole, build.op("Mul", [steps, build.const(2.0**-40)])]), scale])
    infinite = where(build, build.op("Greater", [v, build.const(0.0)]), float("inf"), float("-inf"))
    kept = where(build, build.op("IsNaN", [v]), float("nan"), where(build, build.op("IsInf", [v]), infinite, finite))
    return where(build, build.op("Not", [is_negative_zero(build, v)]), kept, -0.0, output)


def is_negative_zero(build, v):
    """Where v is -0 (a bool tensor): equal to 0, with a reciprocal below 0."""
    zero = build.op("Equal", [v, build.const(0.0)])
    return build.op("And", [zero, build.op("Less", [build.op("Reciprocal", [v]), build.const(0.0)])])


def sign_bit(build, v):
    """Where v's sign bit is set (a bool tensor): below 0, or -0."""
    return build.op("Or", [build.op("Less", [v, build.const(0.0)]), is_negative_zero(build, v)])


def stop_gradient(build, elem_type=onnx.TensorProto.FLOAT):
    """torch's detach of the node's input (an Identity marked ``STOP_GRADIENT``): ``detached``, through float32
    for a float16 input (which float32 holds exactly)."""
    x, output = build.node.input[0], build.node.output[0]
    if elem_type == onnx.TensorProto.FLOAT:
        detached(build, x, output)
    else:
        build.op("Cast", [detached(build, build.op("Cast", [x], to=onnx.TensorProto.FLOAT))], output, to=elem_type)
