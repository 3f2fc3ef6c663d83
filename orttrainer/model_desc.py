"""model_desc: the names, shapes and dtypes of a model's inputs and outputs.

The legacy form is a dict ``{"inputs": [(name, shape)], "outputs": [(name, shape[, is_loss])]}``
where a string in a shape is a symbolic (dynamic) dimension. When the user gives no
model_desc, one is inferred from the first batch and ``forward``'s signature.
``match_inputs`` maps the arguments of a step to the graph's inputs, checked against it.
"""

import inspect
from collections import namedtuple

import torch

from ._arguments import _check_argument

InputDescription = namedtuple("InputDescription", ["name", "shape"])
InputDescriptionTyped = namedtuple("InputDescriptionTyped", ["name", "shape", "dtype"])
OutputDescription = namedtuple("OutputDescription", ["name", "shape", "is_loss"])
OutputDescriptionTyped = namedtuple("OutputDescriptionTyped", ["name", "shape", "is_loss", "dtype", "dtype_amp"])

LABEL_NAME = "label"
LOSS_NAME = "loss"


def _shape_errors(shape):
    if not isinstance(shape, list):
        return ["the second element of the tuple (aka shape) must be a list"]
    for dim in shape:
        is_int = isinstance(dim, int) and not isinstance(dim, bool)
        if not (is_int or (isinstance(dim, str) and dim)):
            return ["each shape must be either a string or integer"]
    return []


def _entry_errors(entry, sizes):
    if not isinstance(entry, tuple) or len(entry) not in sizes:
        return ["must be a tuple with size " + " or ".join(str(size) for size in sizes)]
    errors = []
    if not isinstance(entry[0], str):
        errors.append("the first element of the tuple (aka name) must be a string")
    errors += _shape_errors(entry[1])
    if len(entry) == 3 and not isinstance(entry[2], bool):
        errors.append("the third element of the tuple (aka is_loss) must be a boolean")
    return errors


def validate_model_desc(model_desc):
    """Raise ValueError naming every malformed entry of a legacy model_desc dict."""
    errors = []
    for key in model_desc:
        if key not in ("inputs", "outputs"):
            errors.append(f"{key}: unknown field")
    for key, sizes in (("inputs", (2,)), ("outputs", (2, 3))):
        entries = model_desc.get(key)
        if entries is None:
            errors.append(f"{key}: required field")
            continue
        if not isinstance(entries, list) or not entries:
            errors.append(f"{key}: must be a non-empty list of tuples")
            continue
        losses = 0
        for index, entry in enumerate(entries):
            errors += [f"{key}[{index}]: {problem}" for problem in _entry_errors(entry, sizes)]
            if key == "outputs" and isinstance(entry, tuple) and len(entry) == 3 and entry[2] is True:
                losses += 1
                if losses > 1:
                    errors.append(f"outputs[{index}]: only one is_loss can be set to True")
    if errors:
        raise ValueError("Invalid model_desc: " + "; ".join(errors))


def _check_index_and_dtype(kind, index, dtype, count):
    """``index`` must be a non-negative int and ``dtype`` a torch.dtype (``kind``: 'input' or 'output')."""
    _check_argument(index, int, f"{kind} index must be a non-negative int",
                    f"Pass the position of the entry in model_desc.{kind}s (0..{count - 1}).",
                    lambda value: 0 <= value < count)
    _check_argument(dtype, torch.dtype, f"{kind} dtype must be a torch.dtype",
                    "Pass a torch dtype such as torch.float32, not a numpy dtype or a string.")


class _ORTTrainerModelDesc:
    """The validated model_desc: ``inputs`` and ``outputs`` as (typed) namedtuples."""

    _InputDescription = InputDescription
    _InputDescriptionTyped = InputDescriptionTyped
    _OutputDescription = OutputDescription
    _OutputDescriptionTyped = OutputDescriptionTyped

    def __init__(self, model_desc):
        validate_model_desc(model_desc)
        self.inputs = [InputDescription(name, list(shape)) for name, shape in model_desc["inputs"]]
        self.outputs = [
            OutputDescription(entry[0], list(entry[1]), entry[2] if len(entry) == 3 else False)
            for entry in model_desc["outputs"]
        ]

    @property
    def loss_output(self):
        """The output flagged ``is_loss``; exactly one is required to train."""
        losses = [output for output in self.outputs if output.is_loss]
        if len(losses) != 1:
            raise ValueError(f"model_desc must flag exactly one output with is_loss=True ({len(losses)} were specified)")
        return losses[0]

    def add_type_to_input_description(self, index, dtype):
        _check_index_and_dtype("input", index, dtype, len(self.inputs))
        name, shape = self.inputs[index][:2]
        self.inputs[index] = InputDescriptionTyped(name, shape, dtype)

    def add_type_to_output_description(self, index, dtype, dtype_amp=None):
        _check_index_and_dtype("output", index, dtype, len(self.outputs))
        name, shape, is_loss = self.outputs[index][:3]
        self.outputs[index] = OutputDescriptionTyped(name, shape, is_loss, dtype, dtype_amp)

    def __repr__(self):
        inputs = "\n".join(f"  {entry}" for entry in self.inputs)
        outputs = "\n".join(f"  {entry}" for entry in self.outputs)
        return f"model_desc:\ninputs:\n{inputs}\noutputs:\n{outputs}"


def forward_input_names(model: torch.nn.Module, positional_count: int):
    """Names of ``model.forward``'s first ``positional_count`` parameters."""
    parameters = [
        parameter
        for parameter in inspect.signature(model.forward).parameters.values()
        if parameter.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    if positional_count > len(parameters):
        raise ValueError(
            f"{type(model).__name__}.forward takes {len(parameters)} named positional inputs but the batch has "
            f"{positional_count}; pass a model_desc to name inputs that forward receives through *args"
        )
    return [parameter.name for parameter in parameters[:positional_count]]


def _symbolic_shape(name, tensor, batch_size):
    """Shape with dim 0 symbolic: 'batch' when it matches the first input's, else '<name>_dim0'."""
    shape = list(tensor.shape)
    if shape:
        shape[0] = "batch" if shape[0] == batch_size else f"{name}_dim0"
    return shape


def _flatten_outputs(outputs):
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, (tuple, list)) and all(isinstance(item, torch.Tensor) for item in outputs):
        return list(outputs)
    raise TypeError(
        f"the model must return a tensor or a tuple/list of tensors to be exported, got {type(outputs).__name__}"
    )


def infer_model_desc(input_names, inputs, sample_outputs):
    """Build a legacy model_desc dict from named sample inputs and sample outputs.

    ``sample_outputs`` are what the exported graph returns: the scalar loss first
    (computed by the loss_fn or by the model itself), then the model's other outputs.
    """
    batch_size = inputs[0].shape[0] if inputs and inputs[0].dim() > 0 else None
    desc_inputs = [(name, _symbolic_shape(name, tensor, batch_size)) for name, tensor in zip(input_names, inputs)]
    outputs = _flatten_outputs(sample_outputs)
    names = ["output"] if len(outputs) == 2 else [f"output{index}" for index in range(len(outputs) - 1)]
    desc_outputs = [
        (name, _symbolic_shape(name, tensor, batch_size), index == 0)
        for index, (name, tensor) in enumerate(zip([LOSS_NAME] + names, outputs))
    ]
    return {"inputs": desc_inputs, "outputs": desc_outputs}


def match_inputs(args, kwargs, model_desc=None, model=None, has_label=False):
    """The batch given to ``train_step``/``eval_step`` as (graph input names, tensors), checked.

    A single list or tuple stands for the positional inputs. With a model_desc: positional
    inputs, then keyword inputs in its order, each of its rank, sizes and dtype. Without:
    positional inputs named by ``model.forward``'s signature, keywords by their own name, and
    with ``has_label`` (a loss_fn is set) the label, last positional or keyword 'label', last.
    """
    if len(args) == 1 and isinstance(args[0], (list, tuple)):
        args = tuple(args[0])
    if model_desc is not None:
        names, tensors = _in_desc_order(model_desc.inputs, args, kwargs)
    else:
        names, tensors = _named_by_forward(model, args, kwargs, has_label)
    for name, tensor in zip(names, tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"input '{name}' must be a torch.Tensor, got {type(tensor).__name__}")
    if model_desc is not None:
        _check_against_entries(model_desc.inputs, tensors)
    return names, tensors


def _in_desc_order(entries, args, kwargs):
    names = [entry.name for entry in entries]
    unknown = [name for name in kwargs if name not in names]
    if unknown:
        raise ValueError(f"unknown keyword inputs {unknown}; model_desc inputs are {names}")
    tensors = list(args) + [kwargs[name] for name in names if name in kwargs]
    if len(tensors) != len(names):
        raise ValueError(f"expected {len(names)} inputs {names}, got {len(tensors)}")
    return names, tensors


def _named_by_forward(model, args, kwargs, has_label):
    kwargs = dict(kwargs)
    label = []
    if has_label:
        if LABEL_NAME in kwargs:
            label = [kwargs.pop(LABEL_NAME)]
        elif args:
            args, label = args[:-1], [args[-1]]
        else:
            raise ValueError(f"a loss_fn is set, so the batch needs a label: the last positional input or '{LABEL_NAME}='")
    names = forward_input_names(model, len(args)) + list(kwargs) + [LABEL_NAME] * len(label)
    return names, list(args) + list(kwargs.values()) + label


def _check_against_entries(entries, tensors):
    """Each tensor has its entry's rank, fixed sizes and dtype; a symbolic size is the same in every input."""
    bound = {}
    for entry, tensor in zip(entries, tensors):
        if len(entry.shape) != tensor.dim():
            raise ValueError(
                f"input '{entry.name}' must have {len(entry.shape)} dimensions {entry.shape}, got shape {list(tensor.shape)}"
            )
        for index, (expected, actual) in enumerate(zip(entry.shape, tensor.shape)):
            if isinstance(expected, int) and expected != actual:
                raise ValueError(
                    f"input '{entry.name}' dimension {index} must be {expected} (model_desc shape {entry.shape}), "
                    f"got shape {list(tensor.shape)}"
                )
            if isinstance(expected, str) and bound.setdefault(expected, actual) != actual:
                raise ValueError(
                    f"input '{entry.name}' dimension {index} ('{expected}') is {actual}, but another input "
                    f"has '{expected}' = {bound[expected]}"
                )
        dtype = getattr(entry, "dtype", None)
        if dtype is not None and tensor.dtype != dtype:
            raise TypeError(f"input '{entry.name}' must be {dtype}, got {tensor.dtype}; convert it (e.g. tensor.to({dtype}))")
