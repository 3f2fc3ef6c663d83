"""model_desc: the names, shapes and dtypes of a model's inputs and outputs.

The legacy form is a dict ``{"inputs": [(name, shape)], "outputs": [(name, shape[, is_loss])]}``
where a string in a shape is a symbolic (dynamic) dimension. When the user gives no
model_desc, one is inferred from the first batch and ``forward``'s signature.
``match_inputs`` maps the arguments of a step to the graph's inputs, checked against it, and
sets apart the step's constants: keyword arguments that are Python values (``return_loss=True``),
which go to ``forward`` as they are and are part of the traced graph, not inputs of it.
"""

import functools
import inspect
import typing
from collections import namedtuple
from collections.abc import Mapping

import torch

from ..argument_checks import check_argument

InputDescription = namedtuple("InputDescription", ["name", "shape"])
InputDescriptionTyped = namedtuple("InputDescriptionTyped", ["name", "shape", "dtype"])
OutputDescription = namedtuple("OutputDescription", ["name", "shape", "is_loss"])
OutputDescriptionTyped = namedtuple("OutputDescriptionTyped", ["name", "shape", "is_loss", "dtype", "dtype_amp"])

LABEL_NAME = "label"
_BY_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
# a step's keyword argument of one of these types is a constant of forward's trace, not a graph input
_CONSTANT_TYPES = (bool, int, float, str, type(None))
_UNPACK = getattr(typing, "Unpack", None)  # Python 3.11+: **kwargs: Unpack[SomeTypedDict]


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
    check_argument(index, int, f"{kind} index must be a non-negative int",
                    f"Pass the position of the entry in model_desc.{kind}s (0..{count - 1}).",
                    lambda value: 0 <= value < count)
    check_argument(dtype, torch.dtype, f"{kind} dtype must be a torch.dtype",
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
        self.form = None  # inferred: model_outputs.OutputForm, what a step returns; the user's: the legacy list

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


def forward_parameters(model: torch.nn.Module) -> dict:
    """``inspect.signature(model.forward).parameters``, read once per forward function (every step
    matches its batch against them, and inspect takes ~40 us a call)."""
    forward = model.forward
    function = getattr(forward, "__func__", None)
    if function is None:  # not a method: a callable set on the instance
        return dict(inspect.signature(forward).parameters)
    return _parameters_after_self(function)


@functools.lru_cache(maxsize=64)
def _parameters_after_self(function) -> dict:
    return dict(list(inspect.signature(function).parameters.items())[1:])


def forward_keywords(model: torch.nn.Module) -> list:
    """The names ``model.forward`` takes by keyword: its named parameters, then the keys of the TypedDict its
    ``**kwargs`` is annotated with (transformers' ``**kwargs: Unpack[TransformersKwargs]``: output_hidden_states, ...)."""
    parameters = forward_parameters(model)
    named = [name for name, parameter in parameters.items() if parameter.kind in _BY_KEYWORD]
    wrapped = _WRAPPER_KEYWORDS if _pops_return_dict(getattr(model.forward, "__func__", model.forward)) else []
    takes_any = any(parameter.kind == inspect.Parameter.VAR_KEYWORD for parameter in parameters.values())
    loss = _LOSS_KEYWORDS if takes_any and hasattr(model, "loss_function") else []
    # each name once: transformers' TypedDict lists num_items_in_batch too
    return list(dict.fromkeys(named + _typed_keywords(parameters) + wrapped + loss))


_WRAPPER_KEYWORDS = ["return_dict"]  # what transformers' can_return_tuple takes off a forward's keywords
# what a transformers model's forward passes from its **kwargs to its loss_function (transformers.Trainer sends it)
_LOSS_KEYWORDS = ["num_items_in_batch"]


def _pops_return_dict(function) -> bool:
    """Whether ``function`` is a wrapper that takes ``return_dict`` off the keywords before calling the forward it
    wraps (transformers' ``can_return_tuple``: its signature is the wrapped forward's, which has no such parameter)."""
    code = getattr(function, "__code__", None)
    return (hasattr(function, "__wrapped__") and code is not None and "return_dict" in code.co_varnames
            and "pop" in code.co_names)  # fmt: skip


def _typed_keywords(parameters: dict) -> list:
    """The keys of the TypedDict in ``**kwargs: typing.Unpack[TypedDict]``; none for a ``**kwargs`` without one."""
    for parameter in parameters.values():
        unpacked = _UNPACK is not None and typing.get_origin(parameter.annotation) is _UNPACK
        if parameter.kind == inspect.Parameter.VAR_KEYWORD and unpacked:
            typed_dict = typing.get_args(parameter.annotation)[0]
            return list(typed_dict.__annotations__) if typing.is_typeddict(typed_dict) else []
    return []


def _is_constant(value) -> bool:
    """Whether a step's keyword argument goes to forward as a constant: a bool, int, float, str or None."""
    return type(value) in _CONSTANT_TYPES


def forward_input_names(model: torch.nn.Module, positional_count: int):
    """Names of ``model.forward``'s first ``positional_count`` parameters."""
    parameters = [
        parameter
        for parameter in forward_parameters(model).values()
        if parameter.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    if positional_count > len(parameters):
        raise ValueError(
            f"{type(model).__name__}.forward takes {len(parameters)} named positional inputs but the batch has "
            f"{positional_count}; pass a model_desc to name inputs that forward receives through *args"
        )
    return [parameter.name for parameter in parameters[:positional_count]]


def _symbolic_shape(name, tensor, batch_size, dynamic=()):
    """Shape with dim 0 symbolic ('batch' when it matches the first input's, else '<name>_dim0'), and the axes
    ``dynamic`` too ('<name>_dim<i>')."""
    shape = [f"{name}_dim{index}" if index in dynamic else dim for index, dim in enumerate(tensor.shape)]
    if shape:
        shape[0] = "batch" if tensor.shape[0] == batch_size else f"{name}_dim0"
    return shape


# the kinds of sizes besides the batch an inferred model_desc leaves free, the one given up first last
FREE_SIZES = ("lengths", "spatial")


def free_axes(tensor, kinds=FREE_SIZES) -> list:
    """The axes of an input after dim 0 that the sizes of these ``kinds`` leave free. 'lengths': every axis of an
    integer or bool input (token ids, masks, positions, labels: padded lengths). 'spatial': the axes after the
    channels of a float input of 4 or more dims (an image's height and width, a volume's depth too: detection and
    segmentation train at several sizes). A float input of 2 or 3 dims keeps its sizes: a feature vector's width
    and a sequence's hidden size are fixed by the weights that read them, and which of a 3-d input's axes is a
    length is not known."""
    floating = tensor.is_floating_point() or tensor.is_complex()
    if "lengths" in kinds and not floating:
        return list(range(1, tensor.dim()))
    if "spatial" in kinds and floating and tensor.dim() >= 4:
        return list(range(2, tensor.dim()))
    return []


def infer_model_desc(input_names, inputs, sample_outputs, form, free=FREE_SIZES) -> _ORTTrainerModelDesc:
    """The model_desc of named sample inputs and sample outputs, which ``form`` names
    (model_outputs.flatten: the scalar loss first, computed by the loss_fn or by the model itself).

    Dynamic: dim 0 of every input; the axes the kinds of sizes in ``free`` leave free (``free_axes``: padded
    lengths, image sizes); every axis of every output (a graph declares what it computes, not the sizes of the
    batch it was traced at)."""
    batch_size = inputs[0].shape[0] if inputs and inputs[0].dim() > 0 else None
    desc_inputs = inferred_inputs(input_names, inputs, free)
    desc_outputs = [(name, _symbolic_shape(name, tensor, batch_size, range(tensor.dim())), index == 0)
                    for index, (name, tensor) in enumerate(zip(form.names, sample_outputs))]  # fmt: skip
    desc = _ORTTrainerModelDesc({"inputs": desc_inputs, "outputs": desc_outputs})
    desc.form = form
    return desc


def inferred_inputs(input_names, inputs, free=FREE_SIZES) -> list:
    """The (name, shape) of each input an inferred model_desc declares (``infer_model_desc``)."""
    batch_size = inputs[0].shape[0] if inputs and inputs[0].dim() > 0 else None
    return [(name, _symbolic_shape(name, tensor, batch_size, free_axes(tensor, free)))
            for name, tensor in zip(input_names, inputs)]  # fmt: skip


def match_inputs(args, kwargs, model_desc=None, model=None, has_label=False):
    """The batch given to ``train_step``/``eval_step`` as (graph input names, tensors, constants), checked.

    A single list or tuple stands for the positional inputs, a single dict (any mapping, such as a
    Hugging Face data collator's batch) for the keyword inputs. With the user's model_desc:
    positional inputs, then keyword inputs in its order. Otherwise (none, or the one inferred from
    the first batch): inputs named by ``model.forward``'s parameters, in their order, with
    ``has_label`` (a loss_fn is set) the label, last positional or keyword 'label', last; every
    batch must have the first batch's names. Each input of the model_desc's rank, sizes and dtype.

    ``constants`` ({name: value}) are the keyword arguments that are bool, int, float, str or None
    (``_is_constant``; a tensor keyword is an input, anything else is refused): each must be a keyword of
    ``forward`` (``forward_keywords``), which gets it as it is. With the user's model_desc, only keywords
    it does not name are constants; an ONNX model (``model`` None) takes none.
    """
    args, kwargs = _positional_and_keywords(args, kwargs)
    if model is not None and (model_desc is None or model_desc.form is not None):
        names, tensors, constants = _named_by_forward(model, args, kwargs, has_label)
        if model_desc is not None:
            _check_same_names(model_desc.inputs, names)
    else:
        names, tensors, constants = _in_desc_order(model_desc.inputs, args, kwargs, model)
    for name, tensor in zip(names, tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"input '{name}' must be a torch.Tensor, got {type(tensor).__name__}: the graph's inputs are tensors, and "
                "only a keyword argument that is a bool, int, float, str or None (and not a model_desc input) goes to "
                "forward as a constant; pass the tensors of a list or dict as inputs of their own"
            )
    if model_desc is not None:  # an inferred one (form set) names sizes after the first batch, and ties none of them
        _check_against_entries(model_desc.inputs, tensors, same_names_same_size=model_desc.form is None)
    return names, tensors, constants


def _positional_and_keywords(args, kwargs):
    if len(args) == 1 and isinstance(args[0], (list, tuple)):
        return tuple(args[0]), kwargs
    if len(args) == 1 and isinstance(args[0], Mapping):
        if kwargs:
            raise ValueError(f"pass the batch as one dict or as keyword arguments, not both (got a dict and {list(kwargs)})")
        return (), dict(args[0])
    return args, kwargs


def _in_desc_order(entries, args, kwargs, model):
    names = [entry.name for entry in entries]
    constants = {key: value for key, value in kwargs.items() if key not in names and _is_constant(value)}
    unknown = [name for name in kwargs if name not in names and name not in constants]
    if unknown:
        raise ValueError(f"unknown keyword inputs {unknown}; model_desc inputs are {names}")
    if constants and model is None:
        raise ValueError(
            f"keyword inputs {list(constants)} are Python values, which go to a torch module's forward as constants; "
            f"an ONNX model takes only its model_desc inputs {names}, as tensors"
        )
    if constants:
        _refuse_unknown_keys(model, list(constants), forward_keywords(model))
    tensors = list(args) + [kwargs[name] for name in names if name in kwargs]
    if len(tensors) != len(names):
        raise ValueError(f"expected {len(names)} inputs {names}, got {len(tensors)}")
    return names, tensors, constants


def _named_by_forward(model, args, kwargs, has_label):
    kwargs = dict(kwargs)
    label, label_positional = [], False
    if has_label:
        if LABEL_NAME in kwargs:
            label = [kwargs.pop(LABEL_NAME)]
        elif args:
            args, label, label_positional = args[:-1], [args[-1]], True
        else:
            raise ValueError(f"a loss_fn is set, so the batch needs a label: the last positional input or '{LABEL_NAME}='")
    positional = forward_input_names(model, len(args))
    by_keyword = forward_keywords(model)
    _refuse_unknown_keys(model, list(kwargs), by_keyword)
    _refuse_missing_inputs(model, positional + list(kwargs), label_positional)
    twice = [key for key in kwargs if key in positional]
    if twice:
        raise ValueError(f"inputs {twice} are given both positionally and by keyword")
    given = [name for name in by_keyword if name in kwargs]  # forward's order: the same graph for any key order
    constants = {name: kwargs[name] for name in given if _is_constant(kwargs[name])}
    keywords = [name for name in given if name not in constants]
    names = positional + keywords + [LABEL_NAME] * len(label)
    return names, list(args) + [kwargs[name] for name in keywords] + label, constants


def _refuse_missing_inputs(model, given, label_positional: bool) -> None:
    """Every parameter of ``model.forward`` without a default must be ``given``, else ValueError naming them (torch's
    own TypeError comes out of the export, and named the input the user did pass when the label was missing)."""
    missing = [name for name, parameter in forward_parameters(model).items()
               if parameter.default is inspect.Parameter.empty and name not in given
               and parameter.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]  # fmt: skip
    if missing:
        raise ValueError(
            f"{type(model).__name__}.forward needs {missing}, which this batch does not give"
            + ("; with a loss_fn the last positional input is the label, so the batch's last tensor went to the loss: "
               "pass the inputs, then the label" if label_positional else "")
        )  # fmt: skip


def _refuse_unknown_keys(model, keys, by_keyword) -> None:
    """Every key must be one of ``by_keyword`` (``forward_keywords``), else ValueError naming them."""
    unknown = [key for key in keys if key not in by_keyword]
    if unknown:
        takes_any = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in forward_parameters(model).values())
        raise ValueError(
            f"batch keys {unknown} are not parameters of {type(model).__name__}.forward, which takes {by_keyword}"
            + (" (a key that only **kwargs would take is refused: a misspelt key would be silently ignored)"
               if takes_any else "")
        )  # fmt: skip


def _check_same_names(entries, names):
    """A batch must have the inputs of the first one, which the graph was built for."""
    first = [entry.name for entry in entries]
    if names != first:
        missing, new = [name for name in first if name not in names], [name for name in names if name not in first]
        raise ValueError(
            f"this batch has inputs {names}, the first batch had {first}"
            + (f" (missing: {missing})" if missing else "") + (f" (new: {new})" if new else "")
            + ": the graph was built for the first batch's inputs, so every batch must have the same ones (to evaluate a "
            "model that computes its loss from 'labels', pass them to eval_step too)"
        )  # fmt: skip


def _check_against_entries(entries, tensors, same_names_same_size=True):
    """Each tensor has its entry's rank, fixed sizes and dtype; with ``same_names_same_size``, a
    symbolic size is the same in every input that names it."""
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
            if same_names_same_size and isinstance(expected, str) and bound.setdefault(expected, actual) != actual:
                raise ValueError(
                    f"input '{entry.name}' dimension {index} ('{expected}') is {actual}, but another input "
                    f"has '{expected}' = {bound[expected]}"
                )
        dtype = getattr(entry, "dtype", None)
        if dtype is not None and tensor.dtype != dtype:
            raise TypeError(f"input '{entry.name}' must be {dtype}, got {tensor.dtype}; convert it (e.g. tensor.to({dtype}))")
