"""torch module + loss function -> the forward+loss ONNX graph.

The exported graph takes the model_desc inputs (the label last when a loss_fn is
given) and returns the loss first, then the model's outputs. Its weight initializers
are named exactly like the keys of the module's ``state_dict()``.
"""

import io
import warnings

import onnx
import torch
from torch.onnx import TrainingMode

from . import symbolics

_WRAPPED = "model."  # prefix the wrapper adds to every weight name


class ExportError(RuntimeError):
    """torch.onnx.export failed; the torch error is chained as ``__cause__``."""


class _ModelWithLoss(torch.nn.Module):
    """Routes inputs to ``forward`` by name and appends the loss to the outputs."""

    def __init__(self, model, loss_fn, forward_names):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.forward_names = forward_names

    def forward(self, *inputs):
        outputs = self.model(**dict(zip(self.forward_names, inputs)))
        if self.loss_fn is None:
            return outputs
        outputs = tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
        return (self.loss_fn(outputs[0] if len(outputs) == 1 else outputs, inputs[-1]),) + outputs


def sample_outputs(model, loss_fn, forward_names, inputs):
    """Run model (+ loss) once in eval mode without autograd, leaving the module as it was."""
    wrapper = _ModelWithLoss(model, loss_fn, forward_names)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return wrapper(*inputs)
    finally:
        model.train(was_training)


def _dynamic_axes(entries):
    return {name: {index: dim for index, dim in enumerate(shape) if isinstance(dim, str)} for name, shape in entries}


def _strip_wrapper_prefix(model: onnx.ModelProto) -> None:
    """Rename ``model.<key>`` initializers (and their uses) to the torch state_dict key."""
    renames = {init.name: init.name[len(_WRAPPED) :] for init in model.graph.initializer if init.name.startswith(_WRAPPED)}
    for initializer in model.graph.initializer:
        initializer.name = renames.get(initializer.name, initializer.name)
    for node in model.graph.node:
        for index, name in enumerate(node.input):
            if name in renames:
                node.input[index] = renames[name]
    for graph_input in model.graph.input:
        graph_input.name = renames.get(graph_input.name, graph_input.name)


def export_to_onnx(model, loss_fn, forward_names, inputs, desc_inputs, desc_outputs, opset: int) -> onnx.ModelProto:
    """Export ``model`` (+ ``loss_fn``) in training mode, names and dynamic axes from model_desc.

    ``desc_inputs``/``desc_outputs`` are (name, shape) pairs; string dims become dynamic.
    The global torch RNG is left as it was (tracing runs dropout once).
    """
    symbolics.register()
    wrapper = _ModelWithLoss(model, loss_fn, forward_names)
    buffer = io.BytesIO()
    devices = [inputs[0].device.index or 0] if inputs and inputs[0].is_cuda else []
    try:
        with torch.random.fork_rng(devices=devices), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                wrapper,
                tuple(inputs),
                buffer,
                dynamo=False,
                training=TrainingMode.TRAINING,
                do_constant_folding=False,
                opset_version=opset,
                input_names=[name for name, _ in desc_inputs],
                output_names=[name for name, _ in desc_outputs],
                dynamic_axes=_dynamic_axes(list(desc_inputs) + list(desc_outputs)),
            )
    except Exception as error:
        raise ExportError(f"torch.onnx.export of {type(model).__name__} failed: {error}") from error
    exported = onnx.load_from_string(buffer.getvalue())
    _strip_wrapper_prefix(exported)
    return exported
