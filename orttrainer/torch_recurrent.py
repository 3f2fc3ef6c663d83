"""A graph's LSTMs and GRUs on torch's kernels, inside a split session (torch_convolutions.py).

onnxruntime-training 1.19's CPU ``LSTMGrad`` and ``GRUGrad`` take several times torch's whole
step (benchmarks/NOTES.md §21), and its ``GRUTraining`` takes only one direction. The training
graph's ``LSTMTraining`` / ``GRUTraining`` node runs as torch's ``aten::lstm`` / ``aten::gru``,
the call ``nn.LSTM`` / ``nn.GRU`` makes, with autograd recording it; its gradient node takes the
gradients from that recording (``torch.autograd.grad``). Forward and backward are then torch's own,
and the values ONNX Runtime's kernels would pass between the two (cell states, gate activations)
are not made. The eval graph's ``LSTM`` / ``GRU`` nodes run as the same call without autograd, so
evaluation computes what the trained layer computes (ONNX Runtime's kernels use an approximate
sigmoid, docs/stack_facts.md).

ONNX orders the gates of an LSTM input, output, forget, cell (torch: i, f, g, o) and of a GRU
update, reset, hidden (torch: r, z, n), and lays outputs out as [sequence, direction, batch,
hidden] (torch: [sequence, batch, direction * hidden]). The forward step reorders the weights into
torch's layout and records the layer on those; the gradient step reorders their gradients back
into ONNX's. The outputs' layout conversion happens inside the recorded computation.
"""

from dataclasses import dataclass

import onnx
import torch

from .rewrites import node_attributes


@dataclass(frozen=True)
class _Kind:
    inference: str  # the ONNX op (eval graph)
    forward: str  # the training graph's forward op
    backward: str  # its gradient op
    forward_inputs: tuple  # roles of the forward node's inputs, in order
    gradient_inputs: tuple  # roles of the gradient node's inputs
    gradient_outputs: tuple  # the forward inputs whose gradients the gradient node writes, in order
    results: int  # outputs torch computes (Y, Y_h[, Y_c]); the forward's later ones are for the gradient node only
    gates: list  # ONNX's gate chunks in torch's order
    call: object  # torch.lstm or torch.gru
    activations: str  # the gate activations the forward's outputs after ``results`` hold: tells a pair apart


LSTM = _Kind("LSTM", "LSTMTraining", "LSTMGrad", ("X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"),
             ("X", "W", "R", "sequence_lens", "initial_h", "initial_c", "all_hidden", "all_cell", "iofc", "grad_Y",
              "grad_Y_h", "grad_Y_c"),
             ("X", "W", "R", "B", "initial_h", "initial_c"), 3, [0, 2, 3, 1], torch.lstm, "iofc")  # fmt: skip
GRU = _Kind("GRU", "GRUTraining", "GRUGrad", ("X", "W", "R", "B", "sequence_lens", "initial_h"),
            ("X", "W", "R", "B", "sequence_lens", "initial_h", "all_hidden", "zrh", "grad_Y", "grad_Y_h"),
            ("X", "W", "R", "B", "initial_h"), 2, [1, 0, 2], torch.gru, "zrh")  # fmt: skip
KINDS = {op_type: kind for kind in (LSTM, GRU) for op_type in (kind.inference, kind.forward, kind.backward)}
_DIRECTIONS = ("forward", "reverse", "bidirectional")
_WEIGHTS = ("W", "R", "B")  # the roles whose gradients the gradient step reorders from torch's layout


def _named(names, roles) -> dict:
    """{role: tensor name} of a node's inputs or outputs, absent ones left out."""
    return {role: name for role, name in zip(roles, names) if name}


def _attributes(node: onnx.NodeProto) -> dict:
    """A recurrent node's attributes by name, ``direction`` forward when absent."""
    return {"direction": "forward", **node_attributes(node)}


def direction(node: onnx.NodeProto) -> str:
    """forward, reverse or bidirectional."""
    return _attributes(node)["direction"]


def torch_can_run(node: onnx.NodeProto) -> bool:
    """An LSTM or GRU node (inference, training forward or gradient) torch computes: default
    activations, no clipping, sequence first, every sequence the full length; an LSTM without
    coupled input-forget gate or peepholes, a GRU applying the reset gate after the hidden
    weights (``nn.GRU``'s form)."""
    kind = KINDS.get(node.op_type)
    if kind is None or node.domain != ("com.microsoft" if node.op_type != kind.inference else ""):
        return False
    attributes = _attributes(node)
    plain = not {"activations", "activation_alpha", "activation_beta", "clip"} & set(attributes)
    plain = plain and attributes.get("layout", 0) == 0
    roles = _named(node.input, kind.gradient_inputs if node.op_type == kind.backward else kind.forward_inputs)
    gates = attributes.get("input_forget", 0) == 0 if kind is LSTM else attributes.get("linear_before_reset", 0) == 1
    return attributes["direction"] in _DIRECTIONS and plain and gates and not {"sequence_lens", "P"} & set(roles)


def pairs(nodes) -> dict:
    """{forward node name: gradient node} for the LSTMs and GRUs torch can run both ways; the
    gradient reads the forward's gate activations, which tells them apart, and writes
    gradients only of inputs the forward has."""
    forwards = {}
    for node in nodes:
        kind = KINDS.get(node.op_type)
        if kind is not None and node.op_type == kind.forward and len(node.output) > kind.results and node.output[-1]:
            forwards[node.output[-1]] = node
    found = {}
    for node in nodes:
        kind = KINDS.get(node.op_type)
        if kind is None or node.op_type != kind.backward:
            continue
        activations = _named(node.input, kind.gradient_inputs).get(kind.activations)
        forward = forwards.get(activations)
        if forward is None or forward.op_type != kind.forward:
            continue
        writes_known = set(_named(node.output, kind.gradient_outputs)) <= set(_named(forward.input, kind.forward_inputs))
        if torch_can_run(forward) and torch_can_run(node) and writes_known:
            found[forward.name] = node
    return found


def torch_nodes(nodes) -> set:
    """Names of the LSTM and GRU nodes torch runs: training pairs (``pairs``) and inference nodes."""
    names = {name for forward, backward in pairs(nodes).items() for name in (forward, backward.name)}
    return names | {node.name for node in nodes if node.op_type in (LSTM.inference, GRU.inference) and torch_can_run(node)}


def _reordered(tensor: torch.Tensor, order, out=None) -> torch.Tensor:
    """``tensor``'s gate chunks along dimension 0, chunk ``order[k]`` at position k."""
    chunks = tensor.chunk(len(order))
    return torch.cat([chunks[index] for index in order], out=out)


def torch_parameters(kind: _Kind, w, r, b, hidden: int) -> list:
    """ONNX's W, R[, B] as torch's flat weight list (per direction: w_ih, w_hh[, b_ih, b_hh]), gates in torch's order."""
    gates = len(kind.gates)
    parameters = []
    for index in range(w.shape[0]):
        parameters += [_reordered(w[index], kind.gates), _reordered(r[index], kind.gates)]
        if b is not None:
            biases = (b[index, : gates * hidden], b[index, gates * hidden :])
            parameters += [_reordered(bias, kind.gates) for bias in biases]
    return parameters


def onnx_parameter_gradients(kind: _Kind, gradients, with_bias: bool) -> dict:
    """The gradients of :func:`torch_parameters`' list in ONNX's layout: {"W": ..., "R": ...[, "B": ...]}."""
    onnx_order = [kind.gates.index(position) for position in range(len(kind.gates))]
    per_direction = 4 if with_bias else 2
    directions = [gradients[start : start + per_direction] for start in range(0, len(gradients), per_direction)]
    first = directions[0]
    result = {"W": first[0].new_empty(len(directions), *first[0].shape), "R": first[1].new_empty(len(directions), *first[1].shape)}
    if with_bias:
        result["B"] = first[2].new_empty(len(directions), 2 * first[2].shape[0])
    for index, (w, r, *biases) in enumerate(directions):
        _reordered(w, onnx_order, out=result["W"][index])
        _reordered(r, onnx_order, out=result["R"][index])
        for half, bias in zip(result["B"][index].chunk(2) if with_bias else (), biases):
            _reordered(bias, onnx_order, out=half)
    return result


def _run_layer(kind: _Kind, x, parameters, with_bias: bool, initial_states, direction: str, hidden: int):
    """ONNX's LSTM or GRU (layout 0) computed by torch on :func:`torch_parameters`: (Y, Y_h[, Y_c]) in ONNX's layout.

    ``initial_states``: (initial_h[, initial_c]), each None for zeros.
    """
    sequence, batch = x.shape[0], x.shape[1]
    directions = 2 if direction == "bidirectional" else 1
    zeros = x.new_zeros(directions, batch, hidden)
    states = tuple(zeros if state is None else state for state in initial_states)
    inputs = x.flip(0) if direction == "reverse" else x
    hx = states if kind is LSTM else states[0]
    output, *last = kind.call(inputs, hx, parameters, with_bias, 1, 0.0, True, directions == 2, False)
    if direction == "reverse":
        output = output.flip(0)
    return (output.view(sequence, batch, directions, hidden).transpose(1, 2).contiguous(), *last)


def recurrent(kind: _Kind, x, w, r, b, initial_states, direction: str, hidden: int):
    """ONNX's LSTM or GRU (layout 0) on ONNX's W, R[, B], computed by torch: (Y, Y_h[, Y_c]) in ONNX's layout."""
    return _run_layer(kind, x, torch_parameters(kind, w, r, b, hidden), b is not None, initial_states, direction, hidden)


class RecurrentInference:
    """An LSTM or GRU node (the eval graph's) as torch's call, without autograd."""

    def __init__(self, node: onnx.NodeProto):
        self.kind, self.node = KINDS[node.op_type], node
        attributes = _attributes(node)
        self.direction, self.hidden = attributes["direction"], attributes["hidden_size"]
        self.roles = _named(node.input, self.kind.forward_inputs)
        self.inputs = list(self.roles.values())
        self.outputs = [name for name in node.output if name]

    def _states(self, tensors: dict) -> list:
        """(initial_h[, initial_c]) of the inputs by role, None where absent."""
        return [tensors.get(state) for state in ("initial_h", "initial_c")[: self.kind.results - 1]]

    def run(self, values: dict) -> dict:
        tensors = {role: values[name] for role, name in self.roles.items()}
        with torch.no_grad():
            results = recurrent(self.kind, tensors["X"], tensors["W"], tensors["R"], tensors.get("B"), self._states(tensors),
                                self.direction, self.hidden)  # fmt: skip
        return {name: result for name, result in zip(self.node.output, results) if name}


class RecurrentForward(RecurrentInference):
    """An LSTMTraining or GRUTraining node as torch's call, recorded for its gradient step (``recordings``: shared).

    The recording's leaves are the weights in torch's layout (:func:`torch_parameters`, fresh tensors), not
    ONNX's: autograd through the reordering cost ~0.3 ms a step more than reordering the gradients once
    (benchmarks/NOTES.md §34).
    """

    def __init__(self, node: onnx.NodeProto, recordings: dict):
        super().__init__(node)
        self.recordings = recordings

    def run(self, values: dict) -> dict:
        tensors = {role: values[name] for role, name in self.roles.items()}
        with torch.no_grad():
            parameters = torch_parameters(self.kind, tensors["W"], tensors["R"], tensors.get("B"), self.hidden)
        with torch.enable_grad():
            leaves = {role: tensor.detach().requires_grad_() for role, tensor in tensors.items() if role not in _WEIGHTS}
            for parameter in parameters:
                parameter.requires_grad_()
            results = _run_layer(self.kind, leaves["X"], parameters, "B" in tensors, self._states(leaves), self.direction,
                                self.hidden)  # fmt: skip
        self.recordings[self.node.output[-1]] = (leaves, parameters, "B" in tensors, results)
        produced = dict(zip(self.node.output[: self.kind.results], (result.detach() for result in results)))
        placeholder = tensors["X"].new_empty(0)  # states and gate activations: read only by the gradient step
        produced.update({name: placeholder for name in self.node.output[self.kind.results :]})
        return {name: tensor for name, tensor in produced.items() if name}


class RecurrentBackward:
    """An LSTMGrad or GRUGrad node: the gradients of the recorded forward's inputs, by torch's autograd."""

    def __init__(self, node: onnx.NodeProto, recordings: dict):
        self.kind, self.node, self.recordings = KINDS[node.op_type], node, recordings
        self.roles = _named(node.input, self.kind.gradient_inputs)
        self.inputs = list(self.roles.values())
        self.outputs = [name for name in node.output if name]
        self.targets = _named(node.output, self.kind.gradient_outputs)  # {forward input role: gradient output name}

    def run(self, values: dict) -> dict:
        leaves, parameters, with_bias, results = self.recordings.pop(self.roles[self.kind.activations])
        upstream_roles = ("grad_Y", "grad_Y_h", "grad_Y_c")[: self.kind.results]
        upstream = [(result, values[self.roles[role]]) for result, role in zip(results, upstream_roles) if role in self.roles]
        # pairs(): the forward has every input whose gradient this node writes
        wanted = [(name, leaves[role]) for role, name in self.targets.items() if role not in _WEIGHTS]
        weights = {role: name for role, name in self.targets.items() if role in _WEIGHTS}
        sources = [leaf for _, leaf in wanted] + (parameters if weights else [])
        gradients = torch.autograd.grad([result for result, _ in upstream], sources, [gradient for _, gradient in upstream],
                                        allow_unused=True)  # fmt: skip
        produced = {name: torch.zeros_like(leaf) if gradient is None else gradient
                    for (name, leaf), gradient in zip(wanted, gradients)}  # fmt: skip
        if weights:
            reordered = onnx_parameter_gradients(self.kind, gradients[len(wanted) :], with_bias)
            produced.update({name: reordered[role] for role, name in weights.items()})
        return produced
