"""The Python decisions a trace took on the batch's sizes, kept so that a later batch of other sizes can be checked
against them without tracing again (torch's symbolic-shape guards, for the TorchScript tracer).

A traced forward that turns a size into a Python value (``if q_length > 1:``, ``int(seq_len / 2)``) freezes what
that value was at the traced batch. The graph is right at another batch of other sizes only where every such value
comes out the same. ``SizeGuards`` notes each one during the trace (``note``) with the value it took, and at the
end of the forward (``compile``) copies the part of the traced graph that computes them into a TorchScript
function of the trace's inputs. ``Guards.hold`` runs that function on meta tensors of a new batch's shapes (no data,
no kernels: milliseconds) and says whether every value is the one the trace took. A value it cannot compute so (an
op with no meta kernel, a size that depends on the data) makes the guards unknown, never taken for holding.
"""

import contextlib

import torch


class Guards:
    """The size decisions of one trace: ``hold(inputs)`` is True when a batch of ``inputs``' shapes and dtypes takes
    every one of them as the traced batch did, False when one differs or cannot be computed."""

    def __init__(self, function, arguments: list, taken: list):
        """``function`` computes the decisions' tensors from ``arguments`` (for each of its inputs, the index of a
        batch input, or a weight's meta tensor); ``taken``: each decision's (conversion, Python value)."""
        self._function, self._arguments, self._taken = function, arguments, taken

    def hold(self, inputs: list) -> bool:
        """Whether a batch of ``inputs``' shapes and dtypes takes every decision as the traced batch did."""
        if not self._taken:
            return True
        if self._function is None:
            return False
        meta = [torch.empty(inputs[argument].shape, dtype=inputs[argument].dtype, device="meta")
                if isinstance(argument, int) else argument for argument in self._arguments]  # fmt: skip
        try:
            with torch.jit.optimized_execution(False):  # the optimizing executor compares constants with aten::equal,
                values = self._function(*meta)  # which has no meta kernel
            return all(_python_value(value, conversion) == taken for value, (conversion, taken) in zip(values, self._taken))
        except Exception:  # noqa: BLE001 - an op without a meta kernel, a value left on meta: unknown, so not holding
            return False


NO_GUARDS = Guards(None, [], [])


class SizeGuards:
    """Notes, during one trace, each traced value computed from sizes alone that Python turned into a value."""

    def __init__(self):
        self._noted = []  # (traced torch._C.Value, conversion name, the Python value taken, user location)
        self.guarded = set()  # the user locations of the decisions ``compile`` made guards of

    def note(self, traced, conversion: str, taken, where: str) -> None:
        """The tensor traced as ``traced`` turned into the Python value ``taken`` by ``conversion`` (``__bool__``,
        ``item``, ...) at the user's line ``where``."""
        self._noted.append((traced, conversion, taken.tolist() if hasattr(taken, "tolist") else taken, where))

    def compile(self, graph, batch: list, weights: list) -> Guards:
        """The guards as a function of the inputs of ``graph`` (the trace under way: the ``batch``'s tensors, then
        ``weights``). They must give at the traced batch the values it took; where they cannot (a size that depends
        on the data, such as a boolean mask's count, has no meta kernel), the decisions stay frozen values
        (``guarded`` empty) and the guards never hold."""
        if not self._noted:
            return NO_GUARDS
        taken = [(conversion, value) for _, conversion, value, _ in self._noted]
        unknown = Guards(None, [], taken)
        try:
            function, used = _function_of(graph, [traced for traced, *_ in self._noted])
        except RuntimeError:  # a decision read something other than tensors
            return unknown
        count = len(batch)
        arguments = [index if index < count else weights[index - count].detach().to("meta") for index in used]
        guards = Guards(function, arguments, taken)
        with _not_traced():
            if not guards.hold(batch):
                return unknown
        self.guarded = {where for *_, where in self._noted}
        return guards


@contextlib.contextmanager
def _not_traced():
    """The trace paused: what runs in the block is not recorded into the graph."""
    state = torch._C._get_tracing_state()
    torch._C._set_tracing_state(None)
    try:
        yield
    finally:
        torch._C._set_tracing_state(state)


# ops whose result has the shape of their first input: the guards read sizes alone, so the function passes that input
# on instead of running them (on meta tensors their kernels are Python decompositions: half a guard check's time)
_SHAPE_OF_FIRST_INPUT = {"aten::layer_norm", "aten::gelu", "aten::relu", "aten::tanh", "aten::sigmoid", "aten::silu",
                         "aten::dropout", "aten::softmax", "aten::log_softmax", "aten::contiguous", "aten::clone",
                         "aten::detach"}  # fmt: skip


def _passes_on_first_input(node) -> bool:
    return node.kind() in _SHAPE_OF_FIRST_INPUT and len(list(node.outputs())) == 1


def _function_of(graph, values):
    """A TorchScript function computing ``values`` of ``graph`` from the graph inputs they depend on, and the indices
    of those inputs. Inputs are typed as plain tensors: the trace's types hold the traced batch's sizes."""
    needed, pending = set(), list(values)
    while pending:
        value = pending.pop()
        if value.unique() not in needed:
            needed.add(value.unique())
            node = value.node()
            pending.extend([node.inputsAt(0)] if _passes_on_first_input(node) else node.inputs())
    copy, mapping, used = torch._C.Graph(), {}, []
    meta = copy.insertConstant(torch.device("meta"))  # where the trace moved a tensor, the copy keeps it on meta
    for index, graph_input in enumerate(graph.inputs()):
        if graph_input.unique() in needed:
            if not graph_input.type().isSubtypeOf(torch._C.TensorType.get()):
                raise RuntimeError(f"the size decisions read input {graph_input.debugName()}, not a tensor")
            mapping[graph_input.unique()] = copy.addInput().setType(torch._C.TensorType.get())
            used.append(index)
    for node in _nodes_in_order(graph.block()):
        if _passes_on_first_input(node) and node.output().unique() in needed:
            mapping[node.output().unique()] = mapping[node.inputsAt(0).unique()]
        elif any(output.unique() in needed for output in node.outputs()):
            if list(node.blocks()):
                raise RuntimeError(f"the size decisions read the result of a {node.kind()}")
            if node.kind() == "prim::Constant" and node.output().type().kind() == "DeviceObjType":
                mapping[node.output().unique()] = meta
                continue
            clone = copy.insertNode(copy.createClone(node, lambda value: mapping[value.unique()]))
            for output, cloned in zip(node.outputs(), clone.outputs()):
                mapping[output.unique()] = cloned
                if cloned.type().isSubtypeOf(torch._C.TensorType.get()):
                    cloned.setType(torch._C.TensorType.get())
    outputs = [mapping[value.unique()] for value in values]
    together = copy.insertNode(copy.create("prim::TupleConstruct", outputs))  # a function returns one value
    together.output().setType(torch._C.TupleType([output.type() for output in outputs]))
    copy.registerOutput(together.output())
    return torch._C._create_function_from_graph("size_guards", copy), used


def _nodes_in_order(block):
    """The nodes of a trace's ``block``, those of the module calls it records as nested blocks
    (``prim::TracedModuleForward``, inlined after the trace) in their place."""
    for node in block.nodes():
        if node.kind() == "prim::TracedModuleForward":
            for inner in node.blocks():
                yield from _nodes_in_order(inner)
        else:
            yield node


def _python_value(value, conversion: str):
    """What Python made of the traced tensor ``value`` by ``conversion`` (``Tensor.__bool__``, ``item``, ...)."""
    if conversion in ("tolist", "numpy", "__array__"):  # numpy's array is noted as its list
        return value.tolist()
    if conversion == "__bool__":
        return bool(value)
    if conversion in ("__int__", "__index__"):
        return int(value)
    if conversion == "__float__":
        return float(value)
    return value.item()
