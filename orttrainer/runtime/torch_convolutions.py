"""Run a CPU graph's convolutions (and LSTMs and GRUs, torch_recurrent.py, and CTC losses, torch_ctc.py) with
torch's kernels, everything else with ONNX Runtime.

onnxruntime-training 1.19's CPU ``Conv`` and ``ConvGrad`` kernels (im2col + GEMM) take longer
than torch's whole step on a ResNet; torch's oneDNN kernels do the same work several times
faster (benchmarks/NOTES.md §15, §18). :class:`SplitSession` cuts the graph at its
``Conv`` and ``ConvGrad`` nodes (and its LSTM and GRU nodes, torch_recurrent.py): torch runs
those (``aten::convolution`` and ``aten::convolution_backward``, with the arguments torch's own
``nn.Conv*d`` and autograd pass), the ReLU and BatchNorm gradients between them
(``threshold_backward``, ``native_batch_norm_backward``), hardswish and its gradient (``hardswish``,
``hardswish_backward``, where ONNX Runtime runs a dozen nodes) and the sums of the gradients torch
computed (§23, §26); the nodes between them run as ONNX Runtime
sessions of their own (segments), but for segments of small ops only, which torch runs too
(torch_ops.py, §35). Tensors cross a boundary without copies: a segment's outputs
come back by DLPack, its inputs are bound by pointer. Nodes are scheduled so that every
convolution ready at a point runs in the same gap between two segments, which keeps the number
of segments near the depth of the network.

The split session has :class:`~orttrainer.session.TorchBoundSession`'s interface, so the
trainer does not know which one it runs.
"""

import functools
import heapq

import onnx
import torch
from onnx import helper, numpy_helper

from ..graph import defined_gradients, nodes_for_torch
from . import session, torch_ctc, torch_ops, torch_products, torch_recurrent
from ..graph.rewrites import is_torch_hard_sigmoid, node_attributes
from .torch_ops import TORCH_DOMAIN, FunctionStep, NodeStep

TORCH_OPS = ("Conv", "ConvGrad")
# A HardSwish or HardSigmoid gradient's nodes (defined_gradients.py) collapsed into one node for torch; not
# ONNX Runtime ops, so a graph holding one cannot run anywhere but in a SplitSession.
HARD_SWISH_GRADIENT = "HardSwishGrad"
HARD_SIGMOID_GRADIENT = "HardSigmoidGrad"
_COLLAPSED_GRADIENTS = {"HardSwish": HARD_SWISH_GRADIENT, "HardSigmoid": HARD_SIGMOID_GRADIENT}
# A MaxPoolGrad (dy, indices) that also reads its MaxPool's input, whose shape torch's kernel needs; for
# torch only, like HARD_SWISH_GRADIENT.
MAX_POOL_GRADIENT = "MaxPoolGradFromInput"
_HALF_TYPES = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


class _Convolution:
    """A ``Conv`` or ``ConvGrad`` node as torch's call: the arguments torch's ``nn.Conv*d`` would pass.

    Padding that differs between the two ends of a dimension (``padding="same"`` with an even
    kernel, exported as ``auto_pad`` SAME_UPPER) is, as in torch's ``nn.Conv*d``, a zero-padded
    copy of the input for the difference.
    """

    def __init__(self, node: onnx.NodeProto):
        attributes = _attributes(node)
        self.kernel = list(attributes["kernel_shape"])
        dims = len(self.kernel)
        self.node = node
        self.auto_pad = attributes["auto_pad"]
        self.pads = list(attributes.get("pads", [0] * 2 * dims))
        self.stride = list(attributes.get("strides", [1] * dims))
        self.dilation = list(attributes.get("dilations", [1] * dims))
        self.groups = attributes.get("group", 1)
        self.inputs = list(node.input)
        self.outputs = list(node.output)

    def _padding(self, x: torch.Tensor):
        """(padding on both ends for torch's call, extra padding at (begin, end) of each spatial dimension)."""
        if self.auto_pad in ("SAME_UPPER", "SAME_LOWER"):  # ONNX: output size ceil(input / stride)
            begin, end = [], []
            for size, kernel, stride, dilation in zip(x.shape[2:], self.kernel, self.stride, self.dilation):
                total = max(((size + stride - 1) // stride - 1) * stride + (kernel - 1) * dilation + 1 - size, 0)
                small, large = total // 2, total - total // 2
                begin.append(small if self.auto_pad == "SAME_UPPER" else large)
                end.append(total - begin[-1])
        elif self.auto_pad == "VALID":
            begin = end = [0] * len(self.kernel)
        else:
            begin, end = self.pads[: len(self.kernel)], self.pads[len(self.kernel) :]
        both = [min(first, last) for first, last in zip(begin, end)]
        return both, [(first - common, last - common) for first, last, common in zip(begin, end, both)]

    @staticmethod
    def _padded(x: torch.Tensor, extra) -> torch.Tensor:
        if not any(size for ends in extra for size in ends):
            return x
        return torch.nn.functional.pad(x, [size for ends in reversed(extra) for size in ends])  # last dimension first

    def run(self, values: dict) -> dict:
        x = values[self.inputs[0 if self.node.op_type == "Conv" else 1]]
        padding, extra = self._padding(x)
        no_output_padding = [0] * len(self.kernel)
        if self.node.op_type == "Conv":
            w = values[self.inputs[1]]
            bias = values[self.inputs[2]] if len(self.inputs) > 2 and self.inputs[2] else None
            y = torch.convolution(self._padded(x, extra), w, bias, self.stride, padding, self.dilation, False, no_output_padding,
                                  self.groups)  # fmt: skip
            return {self.outputs[0]: y}
        dy, w = values[self.inputs[0]], values[self.inputs[2]]
        wanted = [index < len(self.outputs) and bool(self.outputs[index]) for index in range(3)]
        dx, dw, db = torch.ops.aten.convolution_backward(
            dy, self._padded(x, extra), w, [w.shape[0]] if wanted[2] else None, self.stride, padding, self.dilation, False,
            no_output_padding, self.groups, wanted,
        )  # fmt: skip
        if wanted[0] and dx.shape != x.shape:  # the gradient of the padded copy, cropped to the input
            for dim, (begin, _) in enumerate(extra, start=2):
                dx = dx.narrow(dim, begin, x.shape[dim])
            dx = dx.contiguous()
        return {name: gradient for name, gradient, needed in zip(self.outputs, (dx, dw, db), wanted) if needed}


class _BatchNormGradient(NodeStep):
    """A training ``BatchNormalizationGrad`` node (dy, x, scale, the forward's saved mean and inverse
    standard deviation) as torch's ``native_batch_norm_backward``, the call of torch's autograd."""

    def run(self, values: dict) -> dict:
        dy, x, scale, mean, inverse_std = (values[name] for name in self.inputs[:5])
        wanted = [index < len(self.outputs) and bool(self.outputs[index]) for index in range(3)]
        gradients = torch.ops.aten.native_batch_norm_backward(dy, x, scale, None, None, mean, inverse_std, True, 0.0, wanted)
        return {name: gradient for name, gradient, needed in zip(self.outputs, gradients, wanted) if needed}


class _MaxPool(NodeStep):
    """A ``MaxPool`` node as torch's ``max_pool{2,3}d_with_indices`` (1-D: as 2-D, as torch computes it),
    which takes NaN as a window's maximum where ONNX Runtime's kernel skips it. Its indices are handed
    on in ONNX's layout, flat over the whole input (torch's are flat within each (sample, channel) plane)."""

    def __init__(self, node: onnx.NodeProto):
        super().__init__(node)
        attributes = self.attributes
        self.kernel = list(attributes["kernel_shape"])
        dims = len(self.kernel)
        self.stride = list(attributes.get("strides", [1] * dims))
        self.padding = list(attributes.get("pads", [0] * 2 * dims))[:dims]
        self.dilation = list(attributes.get("dilations", [1] * dims))
        self.ceil_mode = bool(attributes.get("ceil_mode", 0))

    def _arguments(self):
        """kernel, stride, padding, dilation as torch's 2-D or 3-D kernels take them (1-D with a leading 1)."""
        if len(self.kernel) == 1:
            return [1] + self.kernel, [1] + self.stride, [0] + self.padding, [1] + self.dilation
        return self.kernel, self.stride, self.padding, self.dilation

    def _as_2d_or_3d(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.unsqueeze(-2) if len(self.kernel) == 1 else tensor

    def _as_given(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.squeeze(-2) if len(self.kernel) == 1 else tensor

    def _pool(self):
        return torch.ops.aten.max_pool3d_with_indices if len(self.kernel) == 3 else torch.ops.aten.max_pool2d_with_indices

    def run(self, values: dict) -> dict:
        x = values[self.inputs[0]]
        y, indices = self._pool()(self._as_2d_or_3d(x), *self._arguments(), self.ceil_mode)
        produced = {self.outputs[0]: self._as_given(y)}
        if len(self.outputs) > 1 and self.outputs[1]:
            plane = x.shape[2:].numel()
            planes = torch.arange(x.shape[0] * x.shape[1], dtype=torch.int64).view(*x.shape[:2], *[1] * len(self.kernel))
            produced[self.outputs[1]] = self._as_given(indices) + planes * plane
        return produced


class _MaxPoolGradient(_MaxPool):
    """A ``MAX_POOL_GRADIENT`` node (dy, ONNX's indices, the MaxPool's input; the MaxPool's attributes)
    as torch's ``max_pool{2,3}d_with_indices_backward``, the call of torch's autograd."""

    def run(self, values: dict) -> dict:
        dy, indices, x = (values[name] for name in self.inputs[:3])
        backward = (torch.ops.aten.max_pool3d_with_indices_backward if len(self.kernel) == 3
                    else torch.ops.aten.max_pool2d_with_indices_backward)  # fmt: skip
        within_plane = indices.remainder(x.shape[2:].numel())
        dx = backward(self._as_2d_or_3d(dy), self._as_2d_or_3d(x), *self._arguments(), self.ceil_mode,
                      self._as_2d_or_3d(within_plane))  # fmt: skip
        return {self.outputs[0]: self._as_given(dx)}


def max_pool_runs_on_torch(node: onnx.NodeProto) -> bool:
    """A MaxPool torch's kernel computes as ONNX defines it: explicit padding, the same at both ends
    and at most half the kernel, as torch requires (every MaxPool the exporter writes), row-major indices."""
    attributes = _attributes(node)
    kernel = list(attributes.get("kernel_shape", []))
    dims = len(kernel)
    pads = list(attributes.get("pads", [0] * 2 * dims))
    return (1 <= dims <= 3 and attributes["auto_pad"] in ("NOTSET", "VALID") and attributes.get("storage_order", 0) == 0
            and pads[:dims] == pads[dims:] and all(pad <= size // 2 for pad, size in zip(pads, kernel)))  # fmt: skip


def attach_max_pool_inputs(model: onnx.ModelProto) -> int:
    """Replace, in place, each MaxPoolGrad whose MaxPool torch runs (``max_pool_runs_on_torch``) by a
    ``MAX_POOL_GRADIENT`` node that also reads the MaxPool's input; return how many."""
    producers = {name: node for node in model.graph.node for name in node.output if name}
    replaced = 0
    for index, node in enumerate(model.graph.node):
        forward = producers.get(node.input[1]) if node.op_type == "MaxPoolGrad" and len(node.input) > 1 else None
        if forward is None or forward.op_type != "MaxPool" or not max_pool_runs_on_torch(forward):
            continue
        gradient = helper.make_node(MAX_POOL_GRADIENT, [node.input[0], node.input[1], forward.input[0]], list(node.output),
                                    name=node.name, domain=TORCH_DOMAIN)  # fmt: skip
        gradient.attribute.extend(forward.attribute)
        model.graph.node[index].CopyFrom(gradient)
        replaced += 1
    return replaced


def _attributes(node: onnx.NodeProto) -> dict:
    """A convolution node's attributes by name, ``auto_pad`` NOTSET when absent."""
    return {"auto_pad": "NOTSET", **node_attributes(node)}


def torch_can_run(node: onnx.NodeProto) -> bool:
    """A convolution torch's call computes as ONNX defines it (every Conv the exporter writes)."""
    if node.op_type not in TORCH_OPS or node.domain not in ("", "ai.onnx", "com.microsoft"):
        return False
    attributes = _attributes(node)
    known = attributes["auto_pad"] in ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")
    return known and "kernel_shape" in attributes and min(attributes.get("pads", [0])) >= 0


# Ops torch computes in one pass where the segments would take several: between two convolutions
# on torch they cost no extra boundary (benchmarks/NOTES.md §23, §26).
STEPS_BETWEEN_CONVOLUTIONS = ("ReluGrad", "BatchNormalizationGrad", "HardSwish", HARD_SWISH_GRADIENT, "HardSigmoid",
                              HARD_SIGMOID_GRADIENT, "MaxPool", MAX_POOL_GRADIENT)  # fmt: skip
_JOINING_OPS = ("Identity", "Sum")  # on torch when they only pass on and add what torch computed


def _torch_function(function):
    """Steps for nodes whose inputs, in order, are ``function``'s."""
    return functools.partial(FunctionStep, function=function)


_NODE_STEPS = {
    # ReluGrad (dy, the ReLU's input or output): dy where not x <= 0, NaN included; one pass, where ONNX
    # Runtime's exact spelling takes three
    "ReluGrad": _torch_function(lambda dy, x: torch.ops.aten.threshold_backward(dy, x, 0)),
    "BatchNormalizationGrad": _BatchNormGradient,
    # torch's rounding, which ONNX Runtime's kernels do not share (HardSigmoid: torch's form only,
    # rewrites.is_torch_hard_sigmoid), and torch's one-pass gradients of the collapsed groups (dy, x)
    "HardSwish": _torch_function(torch.nn.functional.hardswish),
    HARD_SWISH_GRADIENT: _torch_function(torch.ops.aten.hardswish_backward),
    "HardSigmoid": _torch_function(torch.nn.functional.hardsigmoid),
    HARD_SIGMOID_GRADIENT: _torch_function(torch.ops.aten.hardsigmoid_backward),
    "MaxPool": _MaxPool,
    MAX_POOL_GRADIENT: _MaxPoolGradient,
}


def _torch_runs_between(node: onnx.NodeProto) -> bool:
    """One of the ``STEPS_BETWEEN_CONVOLUTIONS`` that torch computes as ONNX defines it."""
    if node.op_type == "MaxPool":
        return max_pool_runs_on_torch(node)
    if node.op_type == "HardSigmoid":
        return is_torch_hard_sigmoid(node)
    return node.op_type in STEPS_BETWEEN_CONVOLUTIONS


def op_types_for_torch(nodes) -> tuple:
    """The op types the graph build leaves as they are for torch (no ONNX rewrite) in a graph of ``nodes``:
    ``STEPS_BETWEEN_CONVOLUTIONS``, and MaxPoolGrad when torch runs every MaxPool (``attach_max_pool_inputs``
    then makes them torch's; else all stay ONNX Runtime's fast scatter, which reads the indices either runs)."""
    pools = [node for node in nodes if node.op_type == "MaxPool"]
    return STEPS_BETWEEN_CONVOLUTIONS + (("MaxPoolGrad",) if all(max_pool_runs_on_torch(node) for node in pools) else ())


def runs_convolutions(nodes) -> bool:
    """Whether torch would run convolutions among ``nodes`` (then also ``STEPS_BETWEEN_CONVOLUTIONS``)."""
    return any(torch_can_run(node) for node in nodes)


def torch_nodes(nodes, convolutions: bool) -> set:
    """Names of the nodes torch runs: the LSTMs and GRUs torch can take (in training, both ways), the CTC
    losses, the bfloat16 products ``torch_products.rewrite`` left, and with ``convolutions`` the convolutions and,
    when there are any, the ``STEPS_BETWEEN_CONVOLUTIONS`` and the sums of torch's gradients."""
    names = torch_recurrent.torch_nodes(nodes) | torch_ctc.torch_nodes(nodes)
    names |= {node.name for node in nodes if torch_products.is_product(node)}
    if convolutions and runs_convolutions(nodes):
        names |= {node.name for node in nodes if torch_can_run(node) or _torch_runs_between(node)}
        names |= _joining_torch_gradients(nodes, names)
    return names


def collapse_defined_gradients(model: onnx.ModelProto) -> int:
    """Replace, in place, each HardSwish or HardSigmoid gradient's nodes (defined_gradients.py) by one
    ``HARD_SWISH_GRADIENT`` or ``HARD_SIGMOID_GRADIENT`` node (dy, x) for torch; return how many.

    A group that reads anything but the forward's input and one incoming gradient, or hands on
    more than one result, is left to ONNX Runtime (it computes the same, in more passes).
    """
    nodes = list(model.graph.node)
    graph_outputs = {output.name for output in model.graph.output}
    constants = {initializer.name for initializer in model.graph.initializer}
    collapsed = {}  # id of a gradient node: the node that replaces its group (None: dropped)
    for forward in [node for node in nodes if node.op_type in _COLLAPSED_GRADIENTS]:
        group = defined_gradients.gradient_nodes(nodes, forward)
        inside = {id(node) for node in group}
        written = {name for node in group for name in node.output if name}
        read = {name for node in group for name in node.input if name and name not in written | constants}
        handed_on = {name for node in nodes if id(node) not in inside for name in node.input if name in written}
        handed_on |= written & graph_outputs
        if not group or len(handed_on) != 1 or len(read) != 2 or forward.input[0] not in read:
            continue
        (gradient,) = read - {forward.input[0]}
        (result,) = handed_on
        for node in group:
            collapsed[id(node)] = None
        last = next(node for node in group if result in node.output)
        collapsed[id(last)] = helper.make_node(_COLLAPSED_GRADIENTS[forward.op_type], [gradient, forward.input[0]], [result],
                                               name=f"{forward.name}_Grad/torch", domain=TORCH_DOMAIN)  # fmt: skip
    kept = [collapsed.get(id(node), node) for node in nodes]
    del model.graph.node[:]
    model.graph.node.extend(node for node in kept if node is not None)
    return sum(node is not None for node in collapsed.values())


def _joining_torch_gradients(nodes, on_torch: set) -> set:
    """Identity and Sum nodes that only pass on and add what torch computed (a residual block's two
    gradient paths): on torch they cost no segment between two torch steps."""
    producers = {name: node.name for node in nodes for name in node.output if name}
    known, joining = set(on_torch), set()
    for node in nodes:  # in graph order: an Identity's output can feed a Sum
        if node.op_type in _JOINING_OPS and all(producers.get(name) in known for name in node.input):
            joining.add(node.name)
            known.add(node.name)
    return joining


def can_split(model: onnx.ModelProto, convolutions: bool = True, products: bool = False) -> bool:
    """Whether ``model`` has nodes for torch (``torch_nodes``, and with ``products`` the bfloat16 products,
    torch_products.py) and nothing the split cannot cut (subgraphs, graph outputs that no node computes)."""
    nodes = model.graph.node
    if not torch_nodes(nodes, convolutions) and not (products and torch_products.products_for_torch(model)):
        return False
    if any(attribute.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in nodes for attribute in n.attribute):
        return False
    if any(graph_input.type.tensor_type.elem_type in _HALF_TYPES for graph_input in model.graph.input):
        return False  # torch's CPU kernels here are float32 and float64 ones
    names = [node.name for node in nodes]
    if "" in names or len(set(names)) < len(names):
        return False  # the schedule tells the nodes on torch by name
    produced = {name for node in nodes for name in node.output}
    return all(output.name in produced for output in model.graph.output)


def schedule(nodes, on_torch) -> list:
    """Steps in run order: lists of ONNX Runtime nodes (segments) and single nodes torch runs (``on_torch(node)``).

    A topological order that runs every ONNX Runtime node it can before the next convolutions,
    and then every convolution that is ready: as few segments as the graph's dependencies allow.
    """
    producer = {name: index for index, node in enumerate(nodes) for name in node.output if name}
    waiting_on = [{producer[name] for name in _reads(node) if name in producer} for node in nodes]
    readers = [[] for _ in nodes]
    for index, needed in enumerate(waiting_on):
        for source in needed:
            readers[source].append(index)
    on_torch = [on_torch(node) for node in nodes]
    ready = {True: [], False: []}
    for index, needed in enumerate(waiting_on):
        if not needed:
            heapq.heappush(ready[on_torch[index]], index)
    steps = []
    while ready[False] or ready[True]:
        segment = []
        while ready[False]:
            index = heapq.heappop(ready[False])
            segment.append(nodes[index])
            _release(index, readers, waiting_on, on_torch, ready)
        if segment:
            steps.append(segment)
        convolutions = []
        while ready[True]:
            convolutions.append(heapq.heappop(ready[True]))
        for index in convolutions:
            steps.append(nodes[index])
            _release(index, readers, waiting_on, on_torch, ready)
    return steps


def _release(index, readers, waiting_on, on_torch, ready) -> None:
    for reader in readers[index]:
        waiting_on[reader].discard(index)
        if not waiting_on[reader]:
            heapq.heappush(ready[on_torch[reader]], reader)


def _reads(node: onnx.NodeProto) -> list:
    return [name for name in node.input if name]


class _Segment:
    """Consecutive ONNX Runtime nodes as a session of their own."""

    def __init__(self, nodes, inputs, outputs, model: onnx.ModelProto, open_session):
        self.nodes, self.inputs, self.outputs = nodes, inputs, outputs
        self.model, self.open_session = model, open_session  # open_session: ONNX model -> TorchBoundSession
        self.session = None
        self.allocated = list(outputs)  # outputs ONNX Runtime allocates
        self.bound = {}  # outputs written into the caller's tensors: {name: tensor}

    def open(self, values: dict) -> None:
        """Build the session for inputs like ``values`` (their dtypes and ranks; graph inputs keep their declared shapes)."""
        model = self.model
        read = {name for node in self.nodes for name in node.input}
        initializers = [init for init in model.graph.initializer if init.name in read]
        constant = {init.name for init in initializers}
        self.inputs = [name for name in self.inputs if name not in constant]
        declared = {graph_input.name: graph_input for graph_input in model.graph.input}
        inputs = [declared.get(name) or _value_info(name, values[name]) for name in self.inputs]
        outputs = [helper.make_empty_tensor_value_info(name) for name in self.outputs]
        graph = helper.make_graph(self.nodes, "segment", inputs, outputs, initializers)
        segment_model = helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)
        self.session = self.open_session(segment_model)
        for name, tensor in self.bound.items():
            self.session.bind_output(name, tensor)
        self.session.allocate_outputs(self.allocated)

    def bind_output(self, name: str, tensor: torch.Tensor) -> None:
        self.bound[name] = tensor
        self.allocated = [output for output in self.outputs if output not in self.bound]
        if self.session is not None:
            self.session.bind_output(name, tensor)
            self.session.allocate_outputs(self.allocated)

    def run(self, values: dict) -> dict:
        if self.session is None:
            self.open(values)
        inputs = [values[name].contiguous() for name in self.inputs]  # a torch step may hand on a view (Expand)
        for name, tensor in zip(self.inputs, inputs):
            self.session.bind_input(name, tensor)
        produced = dict(zip(self.allocated, self.session.run()))
        produced.update(self.bound)
        return produced


def _value_info(name: str, tensor: torch.Tensor) -> onnx.ValueInfoProto:
    """An input of ``tensor``'s element type and rank, its sizes left open (one graph serves several shapes)."""
    return helper.make_tensor_value_info(name, session.onnx_elem_type(tensor.dtype), [None] * tensor.dim())


class SplitSession:
    """A graph run as ONNX Runtime segments with torch's convolutions, recurrent layers and CTC losses between them.

    Same interface as :class:`~orttrainer.session.TorchBoundSession`. ``open_session(model,
    all_threads)`` opens a segment's TorchBoundSession: on all threads where ONNX Runtime runs
    convolutions in it (those torch cannot take) or torch runs none, else on one (torch's spinning
    OpenMP threads would contend with the second, NOTES.md §18). With ``convolutions`` False only
    the LSTMs, GRUs, RNNs and CTC losses run on torch. With ``products`` a bfloat16 graph's matrix products run on
    torch's bfloat16 kernels (torch_products.py). Segments are opened at their first run, when the element types
    of what they are handed are known.
    """

    def __init__(self, model: onnx.ModelProto, open_session, convolutions: bool = True, products: bool = False):
        self._model, self._open_session, self._convolutions = model, open_session, convolutions
        if convolutions and runs_convolutions(model.graph.node):
            collapse_defined_gradients(model)
            attach_max_pool_inputs(model)
        if products:
            torch_products.rewrite(model)
        self.input_names = {graph_input.name for graph_input in model.graph.input}
        self.output_names = [output.name for output in model.graph.output]
        self._inputs, self._bound_outputs, self._allocated = {}, {}, []
        self._recordings = {}  # what a recurrent layer's or CTC loss's forward step leaves for its gradient step
        self._folded = torch_recurrent.fold_gate_reordering(model)  # {forward node name: roles in torch's layout}
        self._recurrent_pairs = torch_recurrent.pairs(model.graph.node)  # {forward node name: gradient node}
        self._ctc_recorded = torch_ctc.recorded(model.graph.node)
        self.on_torch = torch_nodes(model.graph.node, convolutions)
        self._plan()
        read_on_torch = {name for step in self._steps if not isinstance(step, _Segment) for name in step.inputs}
        # constants a torch step reads (a rewrite's fixed weights); a segment holds its own as initializers
        self._constants = {init.name: torch.from_numpy(numpy_helper.to_array(init).copy())
                           for init in model.graph.initializer if init.name in read_on_torch}  # fmt: skip

    def _plan(self) -> None:
        """Steps for the nodes in ``on_torch`` and the segments torch takes whole (``_torch_takes_whole``),
        and after each step the values no later step reads."""
        nodes = list(self._model.graph.node)
        while True:  # each taken segment's neighbours may now meet in one
            steps = schedule(nodes, lambda node: node.name in self.on_torch)
            taken = _torch_takes_whole(steps)
            if not taken:
                break
            self.on_torch |= taken
        self._steps, self._released = [], []
        needed = set(self.output_names)  # read by a later step or returned
        for step in reversed(steps):
            nodes = step if isinstance(step, list) else [step]
            written = _ordered_unique(name for node in nodes for name in node.output if name)
            read = _ordered_unique(name for node in nodes for name in _reads(node) if name not in written)
            if isinstance(step, list):
                self._steps.append(self._segment(step, read, [name for name in written if name in needed]))
            else:
                self._steps.append(self._torch_step(step))
            self._released.append({name for name in written + read if name not in needed and name not in self.input_names})
            needed |= set(read)
        self._steps.reverse()
        self._released.reverse()

    def _torch_step(self, node: onnx.NodeProto):
        if torch_products.is_product(node):
            return torch_products.step(node)
        if node.op_type in _NODE_STEPS:
            return _NODE_STEPS[node.op_type](node)
        if node.op_type in TORCH_OPS:
            return _Convolution(node)
        if nodes_for_torch.is_ctc_loss(node) or nodes_for_torch.is_ctc_gradient(node):
            return torch_ctc.step(node, self._ctc_recorded, self._recordings)
        kind = nodes_for_torch.kind_of(node)
        if kind is None:
            return torch_ops.step(node)
        if node.name in self._recurrent_pairs:  # an RNN's forward op is also its inference op
            return torch_recurrent.RecurrentForward(node, self._recordings, self._folded.get(node.name, ()))
        if node.op_type == kind.backward:
            return torch_recurrent.RecurrentBackward(node, self._recordings)
        return torch_recurrent.RecurrentInference(node)

    def _segment(self, nodes, inputs, outputs) -> _Segment:
        all_threads = not self._convolutions or any(node.op_type in TORCH_OPS for node in nodes)
        return _Segment(nodes, inputs, outputs, self._model, lambda model: self._open_session(model, all_threads))

    @property
    def segments(self) -> int:
        """How many ONNX Runtime sessions the graph runs as."""
        return sum(isinstance(step, _Segment) for step in self._steps)

    def bind_input(self, name: str, tensor: torch.Tensor) -> None:
        self._inputs[name] = tensor

    def bind_output(self, name: str, tensor: torch.Tensor) -> None:
        self._bound_outputs[name] = tensor
        for step in self._steps:
            if isinstance(step, _Segment) and name in step.outputs:
                step.bind_output(name, tensor)

    def allocate_outputs(self, names) -> None:
        self._allocated = list(names)

    def run(self):
        """Run every step once; return the outputs named in :meth:`allocate_outputs`."""
        values = {**self._constants, **self._inputs}
        results = {}
        for step, released in zip(self._steps, self._released):
            for name, tensor in step.run(values).items():
                target = self._bound_outputs.get(name)
                if target is not None and tensor is not target:
                    target.copy_(tensor)
                    tensor = target
                if name in self._allocated:
                    results[name] = tensor.contiguous()
                values[name] = tensor
            for name in released:
                values.pop(name, None)
        return [results[name] for name in self._allocated]


def _torch_takes_whole(steps) -> set:
    """Names of the nodes of the segments among ``steps`` that are all small ops torch runs (torch_ops.py): as
    torch steps they cost no boundary (benchmarks/NOTES.md §35)."""
    return {node.name for step in steps if isinstance(step, list) and all(map(torch_ops.runs_on_torch, step))
            for node in step}  # fmt: skip


def _ordered_unique(names) -> list:
    return list(dict.fromkeys(names))
