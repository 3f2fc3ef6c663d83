"""The ModelProto torch's exporter wrote, made the forward+loss graph the trainer builds on.

The loss module's tensors become constants of the graph, the weights lose the wrapper's ``model.`` prefix (their
names are the module's state_dict keys), and the marker nodes ``symbolics`` wrote are resolved: an embedding's
gradient rules as an ``EmbeddingLookup``, hardtanh's Clip and detach's Identity marked for the gradient rewrites.
"""

import json
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from . import symbolics
from .as_trained import WRAPPED
from ..graph import rewrites
from ..graph.eval_graph import IN_TRAINING
from ..graph.outputs_for_trainer import WRITTEN_PREFIX


@dataclass(frozen=True)
class EmbeddingLookup:
    """What torch's embedding does to the gradient of one lookup beyond a plain gather."""

    padding_idx: int  # -1: none; else this row gets no gradient from this lookup
    scale_grad_by_freq: bool  # each row's gradient divided by how often the batch looks it up


def loss_tensors_as_constants(model: onnx.ModelProto, wrapper) -> None:
    """The loss module's own tensors (``CrossEntropyLoss(weight=...)``'s class weights) as initializers holding their
    values: the trainer trains and binds the module's tensors only, and the loss's are constants of the graph (a
    change to them after the first step is refused, module_edits)."""
    loss_state = {name: tensor for name, tensor in wrapper.state_dict().items() if not name.startswith(WRAPPED)}
    constants = [graph_input for graph_input in model.graph.input if graph_input.name in loss_state]
    for graph_input in constants:
        model.graph.input.remove(graph_input)
        value = loss_state[graph_input.name].detach().cpu().numpy()
        model.graph.initializer.append(numpy_helper.from_array(value, graph_input.name))


def strip_wrapper_prefix(model: onnx.ModelProto) -> None:
    """Rename ``model.<key>`` initializers (and their uses) to the torch state_dict key."""
    renames = {tensor.name: tensor.name[len(WRAPPED) :] for tensor in list(model.graph.initializer) + list(model.graph.input)
               if tensor.name.startswith(WRAPPED)}  # fmt: skip
    for initializer in model.graph.initializer:
        initializer.name = renames.get(initializer.name, initializer.name)
    for node in model.graph.node:
        for index, name in enumerate(node.input):
            if name in renames:
                node.input[index] = renames[name]
    for graph_input in model.graph.input:
        graph_input.name = renames.get(graph_input.name, graph_input.name)


def resolve_markers(model: onnx.ModelProto) -> dict:
    """Resolve the marker nodes ``symbolics`` wrote; return {Gather node name: EmbeddingLookup}.

    An embedding's marker on the gather indices is removed, its rules returned. A hardtanh marker
    becomes the Clip it stands for, marked ``rewrites.ZERO_GRADIENT_AT_BOUNDS``; a detach
    marker an Identity marked ``rewrites.STOP_GRADIENT``; a cumprod marker the Cast that ends its scan
    (``_resolve_cumprod``); an in-training marker (buffer_writes.in_training) a
    Where on ``eval_graph.IN_TRAINING``, which the training and eval graphs resolve (``eval_graph.take_branches``).
    """
    markers = {node.output[0]: node for node in model.graph.node if node.domain == symbolics.DOMAIN}
    lookups = {}
    for node in model.graph.node:
        if node.op_type == "Gather" and node.input[1] in markers:
            marker = markers[node.input[1]]
            attributes = {attribute.name: attribute.i for attribute in marker.attribute}
            lookups[node.name] = EmbeddingLookup(attributes["padding_idx"], bool(attributes["scale_grad_by_freq"]))
            node.input[1] = marker.input[0]
    for marker in markers.values():
        if marker.op_type == "HardTanh":
            marker.op_type, marker.domain, marker.doc_string = "Clip", "", rewrites.ZERO_GRADIENT_AT_BOUNDS
        elif marker.op_type == "Detach":
            marker.op_type, marker.domain, marker.doc_string = "Identity", "", rewrites.STOP_GRADIENT
        elif marker.op_type == "InTraining":
            marker.op_type, marker.domain = "Where", ""
            marker.input.insert(0, IN_TRAINING)
        elif marker.op_type == "CumProd":
            _resolve_cumprod(marker)
    if any(marker.op_type == "Where" for marker in markers.values()):
        model.graph.initializer.append(numpy_helper.from_array(np.array(True), IN_TRAINING))
    kept = [node for node in model.graph.node if node.domain != symbolics.DOMAIN]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    domains = [entry for entry in model.opset_import if entry.domain != symbolics.DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(domains)
    return lookups


def _resolve_cumprod(marker: onnx.NodeProto) -> None:
    """torch.cumprod's marker on its float64 products (symbolics.reductions.cumprod) becomes the Cast of the products
    back to the input's type, marked ``rewrites.CUMPROD_PRODUCTS`` with what its gradient needs: the axis, rank and
    length."""
    attributes = rewrites.node_attributes(marker)
    facts = {key: attributes[key] for key in ("axis", "rank", "length")}
    marker.CopyFrom(helper.make_node("Cast", [marker.input[0]], list(marker.output), name=marker.name,
                                     doc_string=rewrites.CUMPROD_PRODUCTS + json.dumps(facts), to=attributes["to"]))


def name_written_buffers(model: onnx.ModelProto, written) -> None:
    """Name the graph's last outputs, the new values of the buffers ``written`` (the trace returns them after the
    model's outputs, trace._WeightsAsInputs), ``WRITTEN_PREFIX`` + the buffer's name, each through an Identity: the
    value may be another output's too."""
    outputs = model.graph.output[len(model.graph.output) - len(written) :]
    for buffer, output in zip(written, outputs):
        name = WRITTEN_PREFIX + buffer
        model.graph.node.append(helper.make_node("Identity", [output.name], [name], name=name))
        output.name = name
