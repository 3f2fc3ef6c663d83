"""The CTC loss (``F.ctc_loss``) on torch's kernel, inside a split session (torch_convolutions.py).

ONNX has no CTC op, and torch's exporter refuses ``aten::ctc_loss``. orttrainer's symbolic
(symbolics/losses.py) writes it as one ``ATen`` node (``org.pytorch.aten``, ``operator`` "ctc_loss", a
schema ONNX Runtime knows, with inputs and outputs of any type) whose inputs are ``torch.ctc_loss``'s
arguments in order: log_probs, targets, input_lengths, target_lengths, then blank, reduction (torch's
enum: 0 none, 1 mean, 2 sum) and zero_infinity as constant scalars (the ATen schema accepts no other
attributes than ``operator`` and ``overload_name``). Its gradient, given to the builder as a placeholder
(``CTC_GRADIENT``, defined_gradients.py), reads the loss and the loss's incoming gradient and writes
log_probs' gradient.

ONNX Runtime runs neither node. In a split session the training graph's forward node runs
``torch.ctc_loss`` with autograd recording it, and the placeholder takes log_probs' gradient from that
recording (``torch.autograd.grad``): torch's kernel both ways, reduction and ``zero_infinity`` included,
so for the log_probs they are handed the loss and its gradient are torch's to the bit. The eval graph's
node runs the same call without autograd. So a CTC loss trains only where the graph is split for torch (on the CPU, without mixed
precision); elsewhere training_graph.py refuses it.
"""

import onnx
import torch

from ..graph.nodes_for_torch import is_ctc_gradient, is_ctc_loss
from .torch_recurrent import recorded_gradients


def recorded(nodes) -> set:
    """Names of the CTC forward nodes whose loss a gradient placeholder reads (it pairs them): those run recorded."""
    read = {node.input[0] for node in nodes if is_ctc_gradient(node)}
    return {node.name for node in nodes if is_ctc_loss(node) and node.output[0] in read}


def torch_nodes(nodes) -> set:
    """Names of the CTC nodes, forward and gradient: torch runs every one (ONNX Runtime runs none)."""
    return {node.name for node in nodes if is_ctc_loss(node) or is_ctc_gradient(node)}


class CTCLossInference:
    """A CTC forward node as ``torch.ctc_loss``, without autograd (the eval graph's, or one no gradient reads)."""

    def __init__(self, node: onnx.NodeProto):
        self.node = node
        self.inputs = list(node.input)
        self.outputs = list(node.output)

    def _loss(self, log_probs: torch.Tensor, values: dict) -> torch.Tensor:
        targets, input_lengths, target_lengths, blank, reduction, zero_infinity = (values[name] for name in self.inputs[1:])
        return torch.ctc_loss(log_probs, targets, input_lengths, target_lengths, int(blank), int(reduction), bool(zero_infinity))

    def run(self, values: dict) -> dict:
        with torch.no_grad():
            return {self.outputs[0]: self._loss(values[self.inputs[0]], values)}


class CTCLossForward(CTCLossInference):
    """A training graph's CTC forward node as ``torch.ctc_loss`` recorded for its gradient step (``recordings``:
    shared, keyed by the loss's name)."""

    def __init__(self, node: onnx.NodeProto, recordings: dict):
        super().__init__(node)
        self.recordings = recordings

    def run(self, values: dict) -> dict:
        with torch.enable_grad():
            log_probs = values[self.inputs[0]].detach().requires_grad_()
            loss = self._loss(log_probs, values)
        self.recordings[self.outputs[0]] = (log_probs, loss)
        return {self.outputs[0]: loss.detach()}


class CTCLossBackward:
    """A CTC gradient placeholder (the loss, its incoming gradient -> log_probs' gradient), by torch's autograd."""

    def __init__(self, node: onnx.NodeProto, recordings: dict):
        self.node, self.recordings = node, recordings
        self.inputs = list(node.input)
        self.outputs = list(node.output)

    def run(self, values: dict) -> dict:
        log_probs, loss = self.recordings.pop(self.inputs[0])
        (gradient,) = recorded_gradients([(loss, values[self.inputs[1]])], [log_probs])
        return {self.outputs[0]: gradient}


def step(node: onnx.NodeProto, recorded_names: set, recordings: dict):
    """The torch step of a CTC node (``torch_nodes``); ``recorded_names``: ``recorded``'s answer for its graph."""
    if is_ctc_gradient(node):
        return CTCLossBackward(node, recordings)
    if node.name in recorded_names:
        return CTCLossForward(node, recordings)
    return CTCLossInference(node)
