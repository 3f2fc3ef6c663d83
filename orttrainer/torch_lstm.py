"""A training graph's LSTMs on torch's kernels, inside a split session (torch_convolutions.py).

onnxruntime-training 1.19's CPU ``LSTMGrad`` takes several times torch's whole step (benchmarks/NOTES.md
§21). The training graph's ``LSTMTraining`` node runs as torch's ``aten::lstm``, the call
``nn.LSTM`` makes, with autograd recording it; its ``LSTMGrad`` node takes the gradients from that
recording (``torch.autograd.grad``). Forward and backward are then torch's own, and the values the
ONNX Runtime kernels would have passed between the two (all cell states, gate activations) are not made.

ONNX keeps an LSTM's gates in the order input, output, forget, cell and its outputs as
[sequence, direction, batch, hidden]; torch keeps i, f, g(cell), o and [sequence, batch,
direction * hidden]. The conversions happen inside the recorded computation, so the gradients
come back in ONNX's layout.
"""

import onnx
import torch
from onnx import helper

FORWARD, BACKWARD = "LSTMTraining", "LSTMGrad"
_TORCH_GATE_ORDER = [0, 2, 3, 1]  # ONNX's (i, o, f, c) chunks in torch's order (i, f, g, o)
_FORWARD_INPUTS = ("X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P")
_GRADIENT_INPUTS = ("X", "W", "R", "sequence_lens", "initial_h", "initial_c", "all_hidden", "all_cell", "iofc",
                    "grad_Y", "grad_Y_h", "grad_Y_c")  # fmt: skip
_GRADIENT_OUTPUTS = ("X", "W", "R", "B", "initial_h", "initial_c")  # the forward inputs whose gradients it writes
_DIRECTIONS = ("forward", "reverse", "bidirectional")


def _named(names, roles) -> dict:
    """{role: tensor name} of a node's inputs or outputs, absent ones left out."""
    return {role: name for role, name in zip(roles, names) if name}


def torch_can_run(node: onnx.NodeProto) -> bool:
    """An LSTMTraining or LSTMGrad node torch's ``aten::lstm`` computes: default activations, no
    clipping, no coupled input-forget gate, no peepholes, every sequence the full length."""
    if node.op_type not in (FORWARD, BACKWARD) or node.domain != "com.microsoft":
        return False
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    direction = attributes.get("direction", b"forward")
    direction = direction.decode() if isinstance(direction, bytes) else direction
    plain = not {"activations", "activation_alpha", "activation_beta", "clip"} & set(attributes)
    roles = _named(node.input, _FORWARD_INPUTS if node.op_type == FORWARD else _GRADIENT_INPUTS)
    return direction in _DIRECTIONS and plain and attributes.get("input_forget", 0) == 0 and not {"sequence_lens", "P"} & set(roles)


def pairs(nodes) -> dict:
    """{LSTMTraining node name: LSTMGrad node} for the LSTMs torch can run both ways; the
    gradient reads the forward's gate activations (``iofc``), which tells them apart, and
    writes gradients only of inputs the forward has."""
    forwards = {node.output[4]: node for node in nodes if node.op_type == FORWARD and len(node.output) > 4 and node.output[4]}
    found = {}
    for node in nodes:
        if node.op_type == BACKWARD and len(node.input) > 8 and node.input[8] in forwards:
            forward = forwards[node.input[8]]
            has_inputs = set(_named(forward.input, _FORWARD_INPUTS))
            writes_known = set(_named(node.output, _GRADIENT_OUTPUTS)) <= has_inputs
            if torch_can_run(forward) and torch_can_run(node) and writes_known:
                found[forward.name] = node
    return found


def _attributes(node: onnx.NodeProto):
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    direction = attributes.get("direction", b"forward")
    return (direction.decode() if isinstance(direction, bytes) else direction), attributes["hidden_size"]


def _torch_order(weights: torch.Tensor) -> torch.Tensor:
    """ONNX's gate chunks (i, o, f, c) along dimension 0 in torch's order (i, f, g, o)."""
    chunks = weights.chunk(4)
    return torch.cat([chunks[index] for index in _TORCH_GATE_ORDER])


def lstm(x, w, r, b, initial_h, initial_c, direction: str, hidden: int):
    """ONNX's LSTM (layout 0) computed by torch's ``aten::lstm``: (Y, Y_h, Y_c) in ONNX's layout."""
    sequence, batch = x.shape[0], x.shape[1]
    directions = 2 if direction == "bidirectional" else 1
    params = []
    for index in range(directions):
        params += [_torch_order(w[index]), _torch_order(r[index])]
        if b is not None:
            params += [_torch_order(b[index, : 4 * hidden]), _torch_order(b[index, 4 * hidden :])]
    zeros = x.new_zeros(directions, batch, hidden)
    state = (zeros if initial_h is None else initial_h, zeros if initial_c is None else initial_c)
    inputs = x.flip(0) if direction == "reverse" else x
    output, last_h, last_c = torch.lstm(inputs, state, params, b is not None, 1, 0.0, True, directions == 2, False)
    if direction == "reverse":
        output = output.flip(0)
    return output.view(sequence, batch, directions, hidden).transpose(1, 2).contiguous(), last_h, last_c


class LstmForward:
    """An LSTMTraining node as torch's LSTM, recorded for its LSTMGrad step (``recordings``: shared)."""

    def __init__(self, node: onnx.NodeProto, recordings: dict):
        self.node, self.recordings = node, recordings
        self.direction, self.hidden = _attributes(node)
        self.roles = _named(node.input, _FORWARD_INPUTS)
        self.inputs = list(self.roles.values())
        self.outputs = [name for name in node.output if name]

    def run(self, values: dict) -> dict:
        with torch.enable_grad():
            leaves = {role: values[name].detach().requires_grad_() for role, name in self.roles.items()}
            results = lstm(leaves["X"], leaves["W"], leaves["R"], leaves.get("B"), leaves.get("initial_h"),
                           leaves.get("initial_c"), self.direction, self.hidden)  # fmt: skip
        self.recordings[self.node.output[4]] = (leaves, results)
        produced = dict(zip(self.node.output[:3], (result.detach() for result in results)))
        placeholder = values[self.roles["X"]].new_empty(0)  # all cell states and gate activations: read only by LSTMGrad
        produced.update({name: placeholder for name in self.node.output[3:]})
        return {name: tensor for name, tensor in produced.items() if name}


class LstmBackward:
    """An LSTMGrad node: the gradients of the recorded forward's inputs, by torch's autograd."""

    def __init__(self, node: onnx.NodeProto, recordings: dict):
        self.node, self.recordings = node, recordings
        self.roles = _named(node.input, _GRADIENT_INPUTS)
        self.inputs = list(self.roles.values())
        self.outputs = [name for name in node.output if name]
        self.targets = _named(node.output, _GRADIENT_OUTPUTS)  # {forward input role: gradient output name}

    def run(self, values: dict) -> dict:
        leaves, results = self.recordings.pop(self.roles["iofc"])
        upstream = [(result, values[self.roles[role]]) for result, role in zip(results, ("grad_Y", "grad_Y_h", "grad_Y_c"))
                    if role in self.roles]  # fmt: skip
        wanted = [(name, leaves[role]) for role, name in self.targets.items()]  # pairs(): the forward has each
        gradients = torch.autograd.grad([result for result, _ in upstream], [leaf for _, leaf in wanted],
                                        [gradient for _, gradient in upstream], allow_unused=True)  # fmt: skip
        return {name: torch.zeros_like(leaf) if gradient is None else gradient
                for (name, leaf), gradient in zip(wanted, gradients)}  # fmt: skip
