"""The nodes of a graph that only torch's kernels run: recurrent layers (LSTM, GRU, RNN) and CTC losses.

What the graph stages need to know of them: their op types and ATen placeholders (the gradients the builder is
given, defined_gradients.py; the CTC loss the symbolic writes, symbolics/losses.py), which of them torch can
compute, and the mending of an RNN gradient placeholder after the build. The runtime runs them inside a split
session (runtime/torch_recurrent.py, runtime/torch_ctc.py, runtime/torch_convolutions.py).
"""

from dataclasses import dataclass

import onnx
import torch

from .rewrites import node_attributes


@dataclass(frozen=True)
class RecurrentKind:
    inference: str  # the ONNX op (eval graph)
    forward: str  # the training graph's forward op
    backward: str  # its gradient op
    forward_inputs: tuple  # roles of the forward node's inputs, in order
    gradient_inputs: tuple  # roles of the gradient node's inputs
    gradient_outputs: tuple  # the forward inputs whose gradients the gradient node writes, in order
    results: int  # outputs torch computes (Y, Y_h[, Y_c]); the forward's later ones are for the gradient node only
    gates: list  # ONNX's gate chunks in torch's order
    call: object  # torch.lstm or torch.gru; None for RNN, whose call its activation chooses (``_torch_call``)
    activations: str  # the role of the forward's last output, which the gradient node reads: tells a pair apart


LSTM = RecurrentKind("LSTM", "LSTMTraining", "LSTMGrad", ("X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"),
             ("X", "W", "R", "sequence_lens", "initial_h", "initial_c", "all_hidden", "all_cell", "iofc", "grad_Y",
              "grad_Y_h", "grad_Y_c"),
             ("X", "W", "R", "B", "initial_h", "initial_c"), 3, [0, 2, 3, 1], torch.lstm, "iofc")  # fmt: skip
GRU = RecurrentKind("GRU", "GRUTraining", "GRUGrad", ("X", "W", "R", "B", "sequence_lens", "initial_h"),
            ("X", "W", "R", "B", "sequence_lens", "initial_h", "all_hidden", "zrh", "grad_Y", "grad_Y_h"),
            ("X", "W", "R", "B", "initial_h"), 2, [1, 0, 2], torch.gru, "zrh")  # fmt: skip
# the gradient placeholder's ``operator`` (an ATen node: a schema ONNX Runtime knows, with inputs and outputs of any type)
RNN_GRADIENT, ATEN_DOMAIN = "orttrainer::RNNGrad", "org.pytorch.aten"
RNN = RecurrentKind("RNN", "RNN", "ATen", ("X", "W", "R", "B", "sequence_lens", "initial_h"),
            ("X", "W", "R", "B", "sequence_lens", "initial_h", "Y_h", "grad_Y", "grad_Y_h"),
            ("X", "W", "R", "B", "initial_h"), 2, [0], None, "Y_h")  # fmt: skip
_KINDS = {op_type: kind for kind in (LSTM, GRU) for op_type in (kind.inference, kind.forward, kind.backward)} | {"RNN": RNN}
RNN_CALLS = {"tanh": torch.rnn_tanh, "relu": torch.rnn_relu}
_DIRECTIONS = ("forward", "reverse", "bidirectional")

def named_roles(names, roles) -> dict:
    """{role: tensor name} of a node's inputs or outputs, absent ones left out."""
    return {role: name for role, name in zip(roles, names) if name}


def recurrent_attributes(node: onnx.NodeProto) -> dict:
    """A recurrent node's attributes by name, ``direction`` forward when absent."""
    return {"direction": "forward", **node_attributes(node)}


def is_aten(node: onnx.NodeProto, operator: str) -> bool:
    """Whether ``node`` is an ATen node of ``operator``: a placeholder only torch runs (an RNN's or a CTC loss's
    gradient, torch_ctc.py's forward)."""
    return node.op_type == "ATen" and node.domain == ATEN_DOMAIN and node_attributes(node).get("operator") == operator


def kind_of(node: onnx.NodeProto):
    """The LSTM, GRU or RNN kind of a recurrent node or of its gradient (an RNN's: the ``RNN_GRADIENT``
    placeholder), else None."""
    if node.op_type == RNN.backward:
        return RNN if is_aten(node, RNN_GRADIENT) else None
    return _KINDS.get(node.op_type)


def _domain(kind: RecurrentKind, node: onnx.NodeProto) -> str:
    """The domain ``node`` of ``kind`` has: ONNX's for the inference op, the ATen op's for the RNN placeholder,
    onnxruntime-training's for LSTMTraining, LSTMGrad and their GRU twins."""
    if node.op_type == kind.inference:
        return ""
    return ATEN_DOMAIN if node.op_type == RNN.backward else "com.microsoft"


def rnn_activation(attributes: dict):
    """An RNN node's one activation in lower case ("tanh", "relu", ...), None if its directions differ."""
    found = {name.decode() if isinstance(name, bytes) else name for name in attributes.get("activations", [b"Tanh"])}
    return found.pop().lower() if len(found) == 1 else None


def direction(node: onnx.NodeProto) -> str:
    """forward, reverse or bidirectional."""
    return recurrent_attributes(node)["direction"]


def torch_can_run(node: onnx.NodeProto) -> bool:
    """An LSTM, GRU or RNN node (inference, training forward or gradient) torch computes: default
    activations (an RNN's tanh or relu, the same in both directions), no clipping, sequence first,
    every sequence the full length; an LSTM without coupled input-forget gate or peepholes, a GRU
    applying the reset gate after the hidden weights (``nn.GRU``'s form)."""
    kind = kind_of(node)
    if kind is None or node.domain != _domain(kind, node):
        return False
    attributes = recurrent_attributes(node)
    if kind is RNN and node.op_type == RNN.forward:
        if rnn_activation(attributes) not in RNN_CALLS:
            return False
        attributes.pop("activations", None)
    plain = not {"activations", "activation_alpha", "activation_beta", "clip"} & set(attributes)
    plain = plain and attributes.get("layout", 0) == 0
    roles = named_roles(node.input, kind.gradient_inputs if node.op_type == kind.backward else kind.forward_inputs)
    if kind is LSTM:
        gates = attributes.get("input_forget", 0) == 0
    else:
        gates = kind is RNN or attributes.get("linear_before_reset", 0) == 1
    return attributes["direction"] in _DIRECTIONS and plain and gates and not {"sequence_lens", "P"} & set(roles)


def complete_rnn_gradients(model: onnx.ModelProto) -> None:
    """Mend, in place, each RNN gradient placeholder as the builder left it from its definition
    (defined_gradients.py): the incoming gradients no node computes are left out (it reads both Y's and
    Y_h's, and a model may use one), and it writes the gradient of its initial state when a node reads it
    (the builder, counting the absent sequence_lens out, writes none: its name is '<initial_h>_grad')."""
    produced = {name for node in model.graph.node for name in node.output} | {i.name for i in model.graph.input}
    produced |= {initializer.name for initializer in model.graph.initializer}
    read = {name for node in model.graph.node for name in node.input} | {output.name for output in model.graph.output}
    for node in model.graph.node:
        if kind_of(node) is not RNN or node.op_type != RNN.backward:
            continue
        for index, name in enumerate(node.input):
            if name and name not in produced:
                node.input[index] = ""
        inputs = named_roles(node.input, RNN.gradient_inputs)
        for index, role in enumerate(RNN.gradient_outputs):
            gradient = f"{inputs[role]}_grad" if role in inputs else None
            if not node.output[index] and gradient in read and gradient not in produced:
                node.output[index] = gradient


CTC_LOSS = "ctc_loss"  # the forward ATen node's operator
CTC_GRADIENT = "orttrainer::CTCLossGrad"  # its gradient placeholder's


def is_ctc_loss(node: onnx.NodeProto) -> bool:
    """Whether ``node`` is a CTC loss (the symbolic's ATen node)."""
    return is_aten(node, CTC_LOSS)


def is_ctc_gradient(node: onnx.NodeProto) -> bool:
    """Whether ``node`` is a CTC loss's gradient placeholder."""
    return is_aten(node, CTC_GRADIENT)
