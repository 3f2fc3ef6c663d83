"""Gradients handed to onnxruntime-training's gradient builder for ops it has none for
(HardSwish, torch's HardSigmoid, the inverse trigonometric Atan, Asin, Acos, and RNN and the CTC
loss's ATen node, whose gradients are placeholders torch runs: torch_recurrent.py, torch_ctc.py).

The builder accepts, per op type, a gradient definition: nodes that read the forward node's
inputs ``I(i)`` and incoming gradients ``GO(i)`` and write the gradients of its inputs
``GI(i)``. An op given one stays a single forward node while the gradient is built, and its
gradient is the few elementwise passes of torch's own backward kernel, where an exact rewrite
into primitive ops (rewrites.py) has ONNX Runtime differentiate a dozen of them (benchmarks/NOTES.md §19).

ONNX Runtime's forward kernels for these ops round differently from torch's near the kinks, so
after the build the forward node is spelled out as torch computes it (``spell_forwards``), unless
torch's kernels will run it: between convolutions on torch, the forward node and its gradient's
nodes (``gradient_nodes``) are one torch call each (torch_convolutions.py).
The registry is the process's: a definition is registered once, for an op type that has no
gradient builder of its own.

One gradient the builder does have is not torch's: Clip's passes at the bounds, as torch's clamp's
does, while torch's hardtanh and relu6, exported as the same Clip, give 0 there. Their Clips are
marked (``ZERO_GRADIENT_AT_BOUNDS``) and their gradients made strict after the build
(``zero_gradient_at_bounds``).
"""

import json
from collections import defaultdict

import onnx
from onnxruntime.capi import _pybind_state as _ort

from . import nodes_for_torch
from .graph_edits import remove_unused
from .graph_errors import GradientBuildError, describe_node
from .rewrites import (
    CUMPROD_PRODUCTS, ZERO_GRADIENT_AT_BOUNDS, NodeBuilder, cumprod_gradient, is_torch_hard_sigmoid, node_attribute,
    replace_nodes,
)


def _constant(name: str, value: float):
    """A scalar Constant node of the forward input's element type."""
    return ("Constant", [], [name], {"value": {"value": value, "dtype": "IElemType(0)", "is_tensor": True}})


# torch's hardswish_backward: 0 for x <= -3, grad * (x / 3 + 1/2) strictly between the kinks,
# grad from 3 on. The branches are selected by multiplying with masks: a Where between two
# tensors costs ~30 Muls in onnxruntime 1.19, one between constants ~2 (benchmarks/NOTES.md §19).
_HARD_SWISH_GRADIENT = [
    _constant("minus_three", -3.0),
    _constant("three", 3.0),
    _constant("half", 0.5),
    _constant("minus_half", -0.5),
    _constant("zero", 0.0),
    _constant("one", 1.0),
    ("LessOrEqual", ["I(0)", "minus_three"], ["at_or_below_low"]),
    ("Where", ["at_or_below_low", "zero", "one"], ["above_low"]),
    ("Less", ["I(0)", "three"], ["below_high"]),
    ("Where", ["below_high", "zero", "minus_half"], ["past_high"]),
    ("Clip", ["I(0)", "minus_three", "three"], ["clipped"]),  # finite for x = ±inf
    ("Div", ["clipped", "three"], ["third"]),
    ("Add", ["third", "half"], ["curve"]),  # 1.5 from 3 on
    ("Add", ["curve", "past_high"], ["slope_above_low"]),
    ("Mul", ["slope_above_low", "above_low"], ["slope"]),
    ("Mul", ["GO(0)", "slope"], ["GI(0)"]),
]

# torch's hardsigmoid_backward: grad / 6 strictly between the kinks, 0 at and beyond them (a HardSigmoid of
# another alpha or beta is rewritten before the build, rewrites.activations.hard_sigmoid)
_HARD_SIGMOID_GRADIENT = [
    _constant("minus_three", -3.0),
    _constant("three", 3.0),
    _constant("sixth", 1 / 6),
    _constant("zero", 0.0),
    ("Greater", ["I(0)", "minus_three"], ["above_low"]),
    ("Less", ["I(0)", "three"], ["below_high"]),
    ("And", ["above_low", "below_high"], ["inside"]),
    ("Where", ["inside", "sixth", "zero"], ["slope"]),
    ("Mul", ["GO(0)", "slope"], ["GI(0)"]),
]

# torch's: atan grad / (x * x + 1); asin grad * rsqrt(1 - x * x), acos its negative (rsqrt as 1 / sqrt)
_ATAN_GRADIENT = [
    _constant("one", 1.0),
    ("Mul", ["I(0)", "I(0)"], ["square"]),
    ("Add", ["square", "one"], ["denominator"]),
    ("Div", ["GO(0)", "denominator"], ["GI(0)"]),
]


def _arc_sine_gradient(sign: str) -> list:
    return [
        _constant("one", 1.0),
        ("Mul", ["I(0)", "I(0)"], ["square"]),
        ("Sub", ["one", "square"], ["cosine_squared"]),
        ("Sqrt", ["cosine_squared"], ["cosine"]),
        ("Div", ["GO(0)", "cosine"], ["GI(0)"] if sign == "+" else ["positive"]),
    ] + ([] if sign == "+" else [("Neg", ["positive"], ["GI(0)"])])


# An RNN's gradient: one placeholder node that torch's autograd runs in a split session (torch_recurrent.py), reading
# the forward's inputs, its Y_h (which pairs the two) and the gradients of Y and Y_h
_RNN_GRADIENT = [
    ((nodes_for_torch.RNN.backward, nodes_for_torch.ATEN_DOMAIN),
     ["I(0)", "I(1)", "I(2)", "I(3)", "I(4)", "I(5)", "O(1)", "GO(0)", "GO(1)"],
     ["GI(0)", "GI(1)", "GI(2)", "GI(3)", "GI(5)"],
     {"operator": {"value": nodes_for_torch.RNN_GRADIENT, "dtype": "string"}}),
]  # fmt: skip

GRADIENT_DEFINITIONS = {"HardSwish": _HARD_SWISH_GRADIENT, "HardSigmoid": _HARD_SIGMOID_GRADIENT, "Atan": _ATAN_GRADIENT,
                        "Asin": _arc_sine_gradient("+"), "Acos": _arc_sine_gradient("-"), "RNN": _RNN_GRADIENT}  # fmt: skip

# A CTC loss's gradient: one placeholder node that torch's autograd runs in a split session (torch_ctc.py), reading the
# loss (which pairs it with its forward) and the loss's gradient, writing log_probs'
_CTC_GRADIENT = [
    (("ATen", nodes_for_torch.ATEN_DOMAIN), ["O(0)", "GO(0)"], ["GI(0)"],
     {"operator": {"value": nodes_for_torch.CTC_GRADIENT, "dtype": "string"}}),
]  # fmt: skip

# for ATen nodes, by their ``operator`` (the builder looks an ATen node's gradient up by operator and overload name)
ATEN_GRADIENT_DEFINITIONS = {nodes_for_torch.CTC_LOSS: _CTC_GRADIENT}

_registered = set()


def _node_definition(op_type, inputs, outputs, attributes=None):
    """``op_type``: an ONNX op's name, or (name, domain)."""
    definition = _ort.GradientNodeDefinition()
    definition.op_type, definition.domain = op_type if isinstance(op_type, tuple) else (op_type, "")
    definition.inputs, definition.outputs = inputs, outputs
    definition.attributes = [_attribute_definition(name, value) for name, value in (attributes or {}).items()]
    return definition


def _attribute_definition(name: str, value: dict):
    definition = _ort.GradientNodeAttributeDefinition()
    definition.name, definition.value_json = name, json.dumps(value["value"])
    definition.dtype, definition.is_tensor = value["dtype"], value.get("is_tensor", False)
    return definition


def register_gradient_definitions() -> None:
    """Give the gradient builder the definitions above (once per process)."""
    keys = {f"::{op_type}": nodes for op_type, nodes in GRADIENT_DEFINITIONS.items()}
    keys |= {f"{nodes_for_torch.ATEN_DOMAIN}::ATen::{operator}::": nodes for operator, nodes in ATEN_GRADIENT_DEFINITIONS.items()}
    for key, nodes in keys.items():
        if key not in _registered:
            _ort.register_gradient_definition(key, [_node_definition(*node) for node in nodes])
            _registered.add(key)


def _clipped_x_plus_three(build: NodeBuilder):
    """min(max(x + 3, 0), 6) of the node's input."""
    x = build.node.input[0]
    return build.op("Clip", [build.op("Add", [x, build.const(3.0)]), build.const(0.0), build.const(6.0)])


def _torch_hard_swish(build: NodeBuilder):
    """x * min(max(x + 3, 0), 6) / 6, torch's hardswish in its order of operations (same rounding)."""
    gate = _clipped_x_plus_three(build)
    build.op("Div", [build.op("Mul", [build.node.input[0], gate]), build.const(6.0)], build.node.output[0])


def _torch_hard_sigmoid(build: NodeBuilder):
    """min(max(x + 3, 0), 6) / 6, torch's hardsigmoid in its order of operations; another alpha or beta is kept
    (rewritten before the build when it is trained, rewrites.activations.hard_sigmoid)."""
    if not is_torch_hard_sigmoid(build.node):
        return False
    build.op("Div", [_clipped_x_plus_three(build), build.const(6.0)], build.node.output[0])


_TORCH_FORWARDS = {"HardSwish": _torch_hard_swish, "HardSigmoid": _torch_hard_sigmoid}


def spell_forwards(model: onnx.ModelProto, keep_op_types=()) -> list:
    """Replace, in place, each forward node of an op with a defined gradient by torch's formula, but those of
    ``keep_op_types`` (which torch's kernels will run); return their names."""
    spelled = set(_TORCH_FORWARDS) - set(keep_op_types)
    targets = [node for node in model.graph.node if node.op_type in spelled and node.domain in ("", "ai.onnx")]
    return replace_nodes(model, _TORCH_FORWARDS, targets)


def gradient_nodes(nodes, forward: onnx.NodeProto) -> list:
    """The nodes the builder made from ``forward``'s gradient definition, or [] if they are not all there.

    The builder names each '<forward node name>_Grad/<op type>_<index>' and turns the Constant nodes
    into initializers; the other op types must be the definition's, one for one, so that a graph
    changed after the build is never mistaken for it.
    """
    prefix = f"{forward.name}_Grad/"
    found = [node for node in nodes if node.name.startswith(prefix)]
    expected = sorted(node[0] for node in GRADIENT_DEFINITIONS[forward.op_type] if node[0] != "Constant")
    return found if sorted(node.op_type for node in found if node.op_type != "Constant") == expected else []


def torch_cumprod_gradients(model: onnx.ModelProto) -> None:
    """Make the gradient of each torch.cumprod torch's cumprod_backward, in place (``rewrites.cumprod_gradient``).

    Its scan (symbolics.reductions.cumprod) runs from a Cast of x to float64 to a Cast back marked
    ``rewrites.CUMPROD_PRODUCTS``. The builder's gradient of the scanned tensor ('<scanned>_grad') becomes torch's
    formula of x, the products and their gradient ('<products>_grad') summed over the cumprods that scan it (ONNX
    Runtime's optimizer merges the Casts of one x), unless other nodes read it too (``_scans_alone``); what only the
    builder's gradient computed is dropped.
    """
    producers = {output: node for node in model.graph.node for output in node.output}
    scans = defaultdict(list)  # the scanned tensor's gradient producer's name: [(x, scanned, products Cast, facts)]
    for node in model.graph.node:
        if node.op_type == "Cast" and node.doc_string.startswith(CUMPROD_PRODUCTS):
            facts = json.loads(node.doc_string[len(CUMPROD_PRODUCTS) :])
            scanned = _scanned(producers, node, facts["length"])
            target = producers.get(f"{scanned}_grad")
            if target is not None:  # on no gradient path otherwise
                scans[target.name].append((producers[scanned].input[0], scanned, node, facts))
    if not scans:
        return

    groups = {name: group for name, group in scans.items() if _scans_alone(model, producers, group)}

    def torch_gradient(build):
        gradients = []
        for x, scanned, products, facts in groups[build.node.name]:
            elem_type = node_attribute(products, "to")
            gradients.append(cumprod_gradient(build, x, products.output[0], f"{products.output[0]}_grad", facts["axis"],
                                              facts["rank"], facts["length"], elem_type))  # fmt: skip
        total = gradients[0] if len(gradients) == 1 else build.op("Sum", gradients)
        build.op("Cast", [total], build.node.output[0], to=onnx.TensorProto.DOUBLE)

    targets = [node for node in model.graph.node if node.name in groups]
    replace_nodes(model, {node.op_type: torch_gradient for node in targets}, targets)
    remove_unused(model.graph)


def _scans_alone(model: onnx.ModelProto, producers: dict, group) -> bool:
    """Whether the scans of ``group`` (the cumprods of one scanned tensor) are all that reads the scanned tensor and
    their own nodes, so that the builder's gradient of it is theirs alone. ONNX Runtime's optimizer merges equal
    nodes: the Cast and first Slice of a cumsum of the same x with a cumprod's. Where it did, the builder's gradient
    (through the products: torch's but where an infinity or NaN meets the others) is kept."""
    scanned = group[0][1]
    nodes = set().union(*(_scan_nodes(producers, scanned, products) for _, _, products, _ in group))
    outputs = {name for node in model.graph.node if node.name in nodes for name in node.output} | {scanned}
    readers = {node.name for node in model.graph.node if "_Grad/" not in node.name
               and not node.name.startswith("AccumulateGrad_") and outputs.intersection(node.input)}  # fmt: skip
    return readers <= nodes | {products.name for _, _, products, _ in group}


def _scanned(producers: dict, products: onnx.NodeProto, length: int) -> str:
    """The float64 tensor a torch.cumprod's scan starts from, walked back from its products' Cast through the
    ceil(log2 length) Muls of ``rewrites.inclusive_scan`` (each reads the previous step first) to the Cast of x."""
    name = products.input[0]
    for _ in range(max(length - 1, 0).bit_length()):
        step = producers.get(name)
        if step is None or step.op_type != "Mul":
            raise GradientBuildError(f"the scan of torch.cumprod ending at {describe_node(products)} is not the Muls "
                                     "its export wrote: orttrainer cannot give it torch's gradient")  # fmt: skip
        name = step.input[0]
    return name


def _scan_nodes(producers: dict, scanned: str, products: onnx.NodeProto) -> set:
    """Names of the nodes on the way from ``scanned`` to the products' Cast (the scan)."""
    found, stack = set(), [products.input[0]]
    while stack:
        node = producers.get(stack.pop())
        if node is not None and scanned not in node.output and node.name not in found:
            found.add(node.name)
            stack.extend(node.input)
    return found


_STRICT_COMPARISONS = {"GreaterOrEqual": ("Greater", 1), "LessOrEqual": ("Less", 2)}  # and the Clip input compared with


def zero_gradient_at_bounds(model: onnx.ModelProto) -> None:
    """Make the gradient of each Clip marked ``ZERO_GRADIENT_AT_BOUNDS`` torch's hardtanh_backward, in place.

    The builder masks dy with (x >= low) & (x <= high); torch's hardtanh_backward with (x > low) & (x < high).
    The two comparisons become strict: the same passes. A marked Clip on the gradient path whose gradient is
    not the builder's two comparisons of x with its bounds is an error, never a gradient left as it was.
    """
    marked = {node.name: node for node in model.graph.node if node.op_type == "Clip" and node.doc_string == ZERO_GRADIENT_AT_BOUNDS}
    comparisons = {}
    for node in model.graph.node:
        forward = marked.get(node.name.rpartition("_Grad/")[0])
        if forward is not None:
            comparisons.setdefault(forward.name, []).append(node)
    for name, gradient in comparisons.items():
        forward = marked[name]
        found = [node for node in gradient if node.op_type in _STRICT_COMPARISONS
                 and list(node.input) == [forward.input[0], forward.input[_STRICT_COMPARISONS[node.op_type][1]]]]  # fmt: skip
        if sorted(node.op_type for node in found) != sorted(_STRICT_COMPARISONS):
            raise RuntimeError(f"the gradient of Clip node {name!r} (a hardtanh) is not the gradient builder's comparisons "
                               f"of its input with both bounds: {[node.op_type for node in gradient]}")  # fmt: skip
        for node in found:
            node.op_type = _STRICT_COMPARISONS[node.op_type][0]
