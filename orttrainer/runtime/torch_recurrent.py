"""A graph's LSTMs, GRUs and RNNs on torch's kernels, inside a split session (torch_convolutions.py).

onnxruntime-training 1.19's CPU ``LSTMGrad`` and ``GRUGrad`` take several times torch's whole
step (benchmarks/NOTES.md §21), and its ``GRUTraining`` takes only one direction. The training
graph's ``LSTMTraining`` / ``GRUTraining`` node runs as torch's ``aten::lstm`` / ``aten::gru``,
the call ``nn.LSTM`` / ``nn.GRU`` makes, with autograd recording it; its gradient node takes the
gradients from that recording (``torch.autograd.grad``). Forward and backward are then torch's own,
and the values ONNX Runtime's kernels would pass between the two (cell states, gate activations)
are not made. The eval graph's ``LSTM`` / ``GRU`` nodes run as the same call without autograd, so
evaluation computes what the trained layer computes (ONNX Runtime's kernels use an approximate
sigmoid, docs/stack_facts.md).

onnxruntime-training has no gradient at all for ``RNN`` (``nn.RNN``). Its gradient is given to the
builder as one placeholder node (``RNN_GRADIENT``, defined_gradients.py) that ONNX Runtime never runs:
the training graph's ``RNN`` runs as ``aten::rnn_tanh`` / ``aten::rnn_relu``, recorded, and the
placeholder as torch's autograd, as for the other two. So an RNN trains only where the graph is split
for torch (on the CPU in float32); elsewhere training_graph.make_differentiable refuses it.

ONNX orders the gates of an LSTM input, output, forget, cell (torch: i, f, g, o) and of a GRU
update, reset, hidden (torch: r, z, n), and lays outputs out as [sequence, direction, batch,
hidden] (torch: [sequence, batch, direction * hidden]). The forward step reorders the weights into
torch's layout and records the layer on those; the gradient step reorders their gradients back
into ONNX's. The exporter's own reordering of a one-direction layer's W and R (and its gradient's)
is taken out of the graph first (``fold_gate_reordering``), so those reach the steps as torch's
weights. The outputs' layout conversion happens inside the recorded computation.
"""

import onnx
import torch
from onnx import numpy_helper

from ..graph.nodes_for_torch import (
    GRU, LSTM, RNN, RNN_CALLS, RecurrentKind, kind_of, named_roles, recurrent_attributes, rnn_activation,
    torch_can_run,
)
from ..graph.rewrites import node_attributes


_WEIGHTS = ("W", "R", "B")  # the roles whose gradients the gradient step reorders from torch's layout
_FOLDED = ("W", "R")  # the roles whose exporter reordering fold_gate_reordering takes out


def _torch_call(node: onnx.NodeProto):
    """torch's function computing ``node``'s layer: torch.lstm, torch.gru, torch.rnn_tanh or torch.rnn_relu."""
    kind = kind_of(node)
    return kind.call or RNN_CALLS[rnn_activation(recurrent_attributes(node))]


def pairs(nodes) -> dict:
    """{forward node name: gradient node} for the LSTMs, GRUs and RNNs torch can run both ways; the
    gradient reads the forward's last output (an LSTM's or GRU's gate activations, an RNN's Y_h),
    which tells them apart, and writes gradients only of inputs the forward has."""
    forwards = {}
    for node in nodes:
        kind = kind_of(node)
        if kind is not None and node.op_type == kind.forward and node.output and node.output[-1]:
            forwards[node.output[-1]] = node
    found = {}
    for node in nodes:
        kind = kind_of(node)
        if kind is None or node.op_type != kind.backward:
            continue
        activations = named_roles(node.input, kind.gradient_inputs).get(kind.activations)
        forward = forwards.get(activations)
        if forward is None or forward.op_type != kind.forward:
            continue
        writes_known = set(named_roles(node.output, kind.gradient_outputs)) <= set(named_roles(forward.input, kind.forward_inputs))
        if torch_can_run(forward) and torch_can_run(node) and writes_known:
            found[forward.name] = node
    return found


def torch_nodes(nodes) -> set:
    """Names of the LSTM, GRU and RNN nodes torch runs: training pairs (``pairs``) and inference nodes."""
    names = {name for forward, backward in pairs(nodes).items() for name in (forward, backward.name)}
    return names | {node.name for node in nodes if node.op_type in (LSTM.inference, GRU.inference, RNN.inference)
                    and torch_can_run(node)}  # fmt: skip


def fold_gate_reordering(model: onnx.ModelProto) -> dict:
    """Take out, in place, the exporter's gate reordering of each one-direction training pair's W and R
    (``Split`` of torch's weight, ``Concat``/``ConcatTraining`` in ONNX's gate order, ``Unsqueeze``) and its
    gradient (``Squeeze``, ``SplitTraining``, ``Concat`` back into torch's order): both pair nodes then read
    torch's weight itself and the gradient node writes its gradient, so the torch steps do not reorder what
    the graph reordered (benchmarks/NOTES.md §35). Returns {forward node name: the roles folded}.

    A chain whose values anything else reads, or whose order is not exactly the gate reordering, is kept.
    """
    nodes = list(model.graph.node)
    found = pairs(nodes)
    if not found:
        return {}
    forwards = {node.name: node for node in nodes if node.name in found}
    producers = {name: node for node in nodes for name in node.output if name}
    readers = {}
    for node in nodes:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    constants = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    folded, dropped = {}, set()
    for forward_name, backward in found.items():
        forward = forwards[forward_name]
        if recurrent_attributes(forward)["direction"] == "bidirectional":
            continue
        kind, hidden = kind_of(forward), recurrent_attributes(forward)["hidden_size"]
        for role in _FOLDED:
            chain = _weight_chain(forward, backward, role, kind, hidden, producers, readers, constants)
            if chain is None:
                continue
            weight, gradient_output, chain_nodes = chain
            reordered = forward.input[kind.forward_inputs.index(role)]
            for node in (forward, backward):
                for index, name in enumerate(node.input):
                    if name == reordered:
                        node.input[index] = weight
            backward.output[kind.gradient_outputs.index(role)] = gradient_output
            dropped |= {id(node) for node in chain_nodes}
            folded.setdefault(forward_name, set()).add(role)
    kept = [node for node in nodes if id(node) not in dropped]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    return folded


def _weight_chain(forward, backward, role, kind, hidden, producers, readers, constants):
    """(torch's weight, its gradient's name, the chain's nodes) of ``role``'s reordering, or None."""
    reordering = _forward_reordering(forward.input[kind.forward_inputs.index(role)], kind, hidden, producers, constants)
    if reordering is None:
        return None
    unsqueeze, concat, split = reordering
    back = _gradient_reordering(backward.output[kind.gradient_outputs.index(role)], concat, split, readers)
    if back is None:
        return None
    chain = [unsqueeze, concat, split, *back]
    inside = {id(node) for node in chain} | {id(forward), id(backward)}
    values = [*unsqueeze.output, *concat.output, *split.output]
    if any(id(reader) not in inside for value in values if value for reader in readers.get(value, [])):
        return None  # the reordered weight, its parts or their lengths are read elsewhere
    return split.input[0], back[-1].output[0], chain


def _forward_reordering(name, kind, hidden, producers, constants):
    """(Unsqueeze, Concat, Split) writing ``name`` as torch's weight's rows in ONNX's gate order, or None."""
    unsqueeze = producers.get(name)
    if unsqueeze is None or unsqueeze.op_type != "Unsqueeze" or _axes(unsqueeze, constants) != [0]:
        return None
    concat = producers.get(unsqueeze.input[0])
    if concat is None or concat.op_type not in ("Concat", "ConcatTraining") or node_attributes(concat).get("axis") != 0:
        return None
    split = producers.get(concat.input[0])
    if split is None or split.op_type != "Split" or node_attributes(split).get("axis", 0) != 0:
        return None
    sizes = constants.get(split.input[1]) if len(split.input) > 1 else node_attributes(split).get("split")
    if sizes is None or set(concat.input) != set(split.output):
        return None
    starts = [sum(int(size) for size in sizes[:index]) for index in range(len(sizes))]
    rows_of = {part: range(start, start + int(size)) for part, start, size in zip(split.output, starts, sizes)}
    rows = [row for part in concat.input for row in rows_of[part]]
    torch_gate_of = [kind.gates.index(position) for position in range(len(kind.gates))]  # ONNX chunk -> torch gate
    if rows != [gate * hidden + row for gate in torch_gate_of for row in range(hidden)]:
        return None
    return unsqueeze, concat, split


def _gradient_reordering(gradient, concat, split, readers):
    """(Squeeze, Split, Concat): the builder's gradient of the forward reordering, from ONNX's layout back to
    torch's (its names are the builder's: '<value>_grad'), or None."""
    squeeze = _only_reader(gradient, readers)
    if squeeze is None or squeeze.op_type != "Squeeze":
        return None
    splitting = _only_reader(squeeze.output[0], readers)
    if splitting is None or splitting.op_type not in ("Split", "SplitTraining"):
        return None
    if list(splitting.output) != [f"{part}_grad" for part in concat.input]:
        return None
    joining = _only_reader(splitting.output[0], readers)
    if joining is None or joining.op_type != "Concat" or list(joining.input) != [f"{part}_grad" for part in split.output]:
        return None
    if any(_only_reader(part, readers) is not joining for part in splitting.output):
        return None
    return squeeze, splitting, joining


def _axes(node, constants):
    axes = constants.get(node.input[1]) if len(node.input) > 1 else node_attributes(node).get("axes")
    return None if axes is None else [int(axis) for axis in axes]


def _only_reader(name, readers):
    found = readers.get(name, [])
    return found[0] if len(found) == 1 else None


def _reordered(tensor: torch.Tensor, order, out=None) -> torch.Tensor:
    """``tensor``'s gate chunks along dimension 0, chunk ``order[k]`` at position k."""
    chunks = tensor.chunk(len(order))
    return torch.cat([chunks[index] for index in order], out=out)


def torch_parameters(kind: RecurrentKind, w, r, b, hidden: int, folded=()) -> list:
    """ONNX's W, R[, B] as torch's flat weight list (per direction: w_ih, w_hh[, b_ih, b_hh]), gates in torch's order.

    The ``folded`` roles (``fold_gate_reordering``, one direction) are torch's weights already: handed on as they are.
    """
    gates = len(kind.gates)
    parameters = []
    for index in range(1 if folded else w.shape[0]):
        parameters += [weight.detach() if role in folded else _reordered(weight[index], kind.gates)
                       for role, weight in (("W", w), ("R", r))]  # fmt: skip
        if b is not None:
            biases = (b[index, : gates * hidden], b[index, gates * hidden :])
            parameters += [_reordered(bias, kind.gates) for bias in biases]
    return parameters


def onnx_parameter_gradients(kind: RecurrentKind, gradients, with_bias: bool, folded=()) -> dict:
    """The gradients of :func:`torch_parameters`' list in ONNX's layout: {"W": ..., "R": ...[, "B": ...]}; those of the
    ``folded`` roles in torch's, as torch computed them."""
    onnx_order = [kind.gates.index(position) for position in range(len(kind.gates))]
    per_direction = 4 if with_bias else 2
    directions = [gradients[start : start + per_direction] for start in range(0, len(gradients), per_direction)]
    first = directions[0]
    result = {role: first[index] if role in folded else first[index].new_empty(len(directions), *first[index].shape)
              for index, role in enumerate(("W", "R"))}  # fmt: skip
    if with_bias:
        result["B"] = first[2].new_empty(len(directions), 2 * first[2].shape[0])
    for index, (w, r, *biases) in enumerate(directions):
        for role, gradient in (("W", w), ("R", r)):
            if role not in folded:
                _reordered(gradient, onnx_order, out=result[role][index])
        for half, bias in zip(result["B"][index].chunk(2) if with_bias else (), biases):
            _reordered(bias, onnx_order, out=half)
    return result


def _run_layer(kind: RecurrentKind, call, x, parameters, with_bias: bool, initial_states, direction: str, hidden: int):
    """ONNX's LSTM, GRU or RNN (layout 0) computed by torch's ``call`` on :func:`torch_parameters`: (Y, Y_h[, Y_c]) in
    ONNX's layout.

    ``initial_states``: (initial_h[, initial_c]), each None for zeros.
    """
    sequence, batch = x.shape[0], x.shape[1]
    directions = 2 if direction == "bidirectional" else 1
    zeros = x.new_zeros(directions, batch, hidden)
    states = tuple(zeros if state is None else state for state in initial_states)
    inputs = x.flip(0) if direction == "reverse" else x
    hx = states if kind is LSTM else states[0]
    output, *last = call(inputs, hx, parameters, with_bias, 1, 0.0, True, directions == 2, False)
    if direction == "reverse":
        output = output.flip(0)
    return (output.view(sequence, batch, directions, hidden).transpose(1, 2).contiguous(), *last)


def recurrent(kind: RecurrentKind, x, w, r, b, initial_states, direction: str, hidden: int, call=None):
    """ONNX's LSTM, GRU or RNN (layout 0) on ONNX's W, R[, B], computed by torch: (Y, Y_h[, Y_c]) in ONNX's layout.
    ``call``: the torch function, for an RNN (torch.rnn_tanh or torch.rnn_relu)."""
    parameters = torch_parameters(kind, w, r, b, hidden)
    return _run_layer(kind, call or kind.call, x, parameters, b is not None, initial_states, direction, hidden)


class RecurrentInference:
    """An LSTM, GRU or RNN node (the eval graph's) as torch's call, without autograd."""

    def __init__(self, node: onnx.NodeProto):
        self.kind, self.node, self.call = kind_of(node), node, _torch_call(node)
        attributes = recurrent_attributes(node)
        self.direction, self.hidden = attributes["direction"], attributes["hidden_size"]
        self.roles = named_roles(node.input, self.kind.forward_inputs)
        self.inputs = list(self.roles.values())
        self.outputs = [name for name in node.output if name]

    def _states(self, tensors: dict) -> list:
        """(initial_h[, initial_c]) of the inputs by role, None where absent."""
        return [tensors.get(state) for state in ("initial_h", "initial_c")[: self.kind.results - 1]]

    def run(self, values: dict) -> dict:
        tensors = {role: values[name] for role, name in self.roles.items()}
        with torch.no_grad():
            results = recurrent(self.kind, tensors["X"], tensors["W"], tensors["R"], tensors.get("B"), self._states(tensors),
                                self.direction, self.hidden, self.call)  # fmt: skip
        return {name: result for name, result in zip(self.node.output, results) if name}


class RecurrentForward(RecurrentInference):
    """An LSTMTraining, GRUTraining or training RNN node as torch's call, recorded for its gradient step
    (``recordings``: shared).

    The recording's leaves are the weights in torch's layout (:func:`torch_parameters`, fresh tensors), not
    ONNX's: autograd through the reordering cost ~0.3 ms a step more than reordering the gradients once
    (benchmarks/NOTES.md §34).
    """

    def __init__(self, node: onnx.NodeProto, recordings: dict, folded=()):
        super().__init__(node)
        self.recordings, self.folded = recordings, folded

    def run(self, values: dict) -> dict:
        tensors = {role: values[name] for role, name in self.roles.items()}
        with torch.no_grad():
            parameters = torch_parameters(self.kind, tensors["W"], tensors["R"], tensors.get("B"), self.hidden, self.folded)
        with torch.enable_grad():
            leaves = {role: tensor.detach().requires_grad_() for role, tensor in tensors.items() if role not in _WEIGHTS}
            for parameter in parameters:
                parameter.requires_grad_()
            results = _run_layer(self.kind, self.call, leaves["X"], parameters, "B" in tensors, self._states(leaves),
                                 self.direction, self.hidden)  # fmt: skip
        self.recordings[self.node.output[-1]] = (leaves, parameters, "B" in tensors, self.folded, results)
        produced = dict(zip(self.node.output[: self.kind.results], (result.detach() for result in results)))
        placeholder = tensors["X"].new_empty(0)  # states and gate activations: read only by the gradient step
        produced.update({name: placeholder for name in self.node.output[self.kind.results :]})
        return {name: tensor for name, tensor in produced.items() if name}


class RecurrentBackward:
    """An LSTMGrad, GRUGrad or RNN gradient node: the gradients of the recorded forward's inputs, by torch's autograd."""

    def __init__(self, node: onnx.NodeProto, recordings: dict):
        self.kind, self.node, self.recordings = kind_of(node), node, recordings
        self.roles = named_roles(node.input, self.kind.gradient_inputs)
        self.inputs = list(self.roles.values())
        self.outputs = [name for name in node.output if name]
        self.targets = named_roles(node.output, self.kind.gradient_outputs)  # {forward input role: gradient output name}

    def run(self, values: dict) -> dict:
        leaves, parameters, with_bias, folded, results = self.recordings.pop(self.roles[self.kind.activations])
        upstream_roles = ("grad_Y", "grad_Y_h", "grad_Y_c")[: self.kind.results]
        upstream = [(result, values[self.roles[role]]) for result, role in zip(results, upstream_roles) if role in self.roles]
        # pairs(): the forward has every input whose gradient this node writes
        wanted = [(name, leaves[role]) for role, name in self.targets.items() if role not in _WEIGHTS]
        weights = {role: name for role, name in self.targets.items() if role in _WEIGHTS}
        gradients = recorded_gradients(upstream, [leaf for _, leaf in wanted] + (parameters if weights else []))
        produced = {name: gradient for (name, _), gradient in zip(wanted, gradients)}
        if weights:
            reordered = onnx_parameter_gradients(self.kind, gradients[len(wanted) :], with_bias, folded)
            produced.update({name: reordered[role] for role, name in weights.items()})
        return produced


def recorded_gradients(upstream, sources) -> list:
    """The gradients of ``sources`` (leaves of a recording) from ``upstream``, (recorded result, its incoming gradient)
    pairs, by torch's autograd; zeros for a source no result depends on."""
    gradients = torch.autograd.grad([result for result, _ in upstream], sources, [gradient for _, gradient in upstream],
                                    allow_unused=True)  # fmt: skip
    return [torch.zeros_like(source) if gradient is None else gradient for source, gradient in zip(sources, gradients)]
