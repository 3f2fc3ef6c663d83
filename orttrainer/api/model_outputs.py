"""What the model returns <-> the graph's outputs: flattened to tensors for the export, packed back for the user.

A graph returns a flat list of tensors, the loss first. A model returns a tensor, a
tuple/list of tensors, a dict, or a Hugging Face ``ModelOutput`` (a dataclass that is a
dict). ``flatten`` turns any of these into the graph's tensors and an :class:`OutputForm`
that names them and packs a step's outputs back into the model's own form: the same
ModelOutput class (``.loss``, ``.logits`` ...) or dict; a tensor or tuple gives the legacy list.

The rules (docs/hugging_face.md, docs/legacy_api.md §3): a field that is None is absent (as
ModelOutput leaves it out); a tuple of tensors (``hidden_states``, ``attentions``) becomes
one graph output per tensor, ``<field>.<index>``, and a tuple again; a ModelOutput or dict
inside the ModelOutput (CLIP's ``text_model_output``) becomes one graph output per tensor,
``<field>.<subfield>``, under the same rules, and its own class again; ``past_key_values``,
the cache that generation reads and a training step does not, is left out; any other value
is refused, naming the field by its dotted name.
"""

import dataclasses
from collections.abc import Mapping

import torch

LOSS_NAME = "loss"
GENERATION_CACHE = "past_key_values"  # left out of the graph (module docstring)


class OutputForm:
    """The graph output names of a model's return value, and how to pack them back.

    ``mapping_type`` is the ModelOutput class or ``dict`` the model returned, None for a
    tensor or tuple (or when a loss_fn computes the loss): then outputs come back as the
    legacy list. ``fields`` are (key, kind) in the model's order, ``kind`` saying what the field
    holds: None a tensor, an int a tuple of that many tensors, an OutputForm a nested
    ModelOutput or dict.
    """

    def __init__(self, mapping_type, fields):
        self.mapping_type, self.fields = mapping_type, fields

    @property
    def names(self) -> list:
        """The graph's output names: the loss first, then the other outputs in the model's order."""
        loss_first = sorted(self.fields, key=lambda field: field[0] != LOSS_NAME)  # a stable sort
        return [name for key, kind in loss_first for name in _field_names(key, kind)]

    def pack(self, outputs: list):
        """``outputs`` (one per name, in ``names`` order) in the model's form: its ModelOutput
        class or a dict; the legacy list (a single tensor bare) for a tensor or tuple."""
        if self.mapping_type is None:
            return as_list(outputs)
        return self._packed(dict(zip(self.names, outputs)), prefix="")

    def _packed(self, by_name: dict, prefix: str):
        """This form's mapping, its tensors taken from ``by_name`` under ``prefix`` + field name."""
        fields = {key: _packed_field(by_name, prefix + key, kind) for key, kind in self.fields}
        return self.mapping_type(**fields) if dataclasses.is_dataclass(self.mapping_type) else dict(fields)


def as_list(outputs: list):
    """The legacy return value of a step: the outputs as a list, a single one bare."""
    return outputs[0] if len(outputs) == 1 else list(outputs)


def _field_names(key, kind) -> list:
    """The graph output names of one field: ``key``, ``key.<index>`` of a tuple, ``key.<subfield>`` of a mapping."""
    if kind is None:
        return [key]
    if isinstance(kind, OutputForm):
        return [f"{key}.{name}" for subkey, subkind in kind.fields for name in _field_names(subkey, subkind)]
    return [f"{key}.{index}" for index in range(kind)]


def _packed_field(by_name: dict, name: str, kind):
    """The value of the field named ``name`` (dotted from the top), of ``kind`` (OutputForm.fields)."""
    if kind is None:
        return by_name[name]
    if isinstance(kind, OutputForm):
        return kind._packed(by_name, prefix=name + ".")
    return tuple(by_name[f"{name}.{index}"] for index in range(kind))


def flatten(outputs, model_name: str, loss=None):
    """(the graph's tensors, their OutputForm) of what ``model_name``'s forward returned; ``loss``
    is the loss_fn's, if one is given (it then comes first and outputs come back as a list)."""
    if isinstance(outputs, Mapping):
        return _flatten_mapping(outputs, model_name, loss)
    items = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    for index, value in enumerate(items):
        if value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{model_name}.forward returned a {type(value).__name__} as output [{index}]; the graph can only return "
                "tensors (None is left out). Return tensors, or a dict/ModelOutput (for a Hugging Face model: "
                "return_dict=True, and config.use_cache=False if this is the generation cache)"
            )
    tensors = ([loss] if loss is not None else []) + [value for value in items if value is not None]
    names = ["output"] if len(tensors) == 2 else [f"output{index}" for index in range(len(tensors) - 1)]
    return tensors, OutputForm(None, [(name, None) for name in [LOSS_NAME] + names])


def _flatten_mapping(outputs, model_name, loss):
    form, named = _mapping_form(outputs, model_name, prefix="")
    keys = [key for key, _ in form.fields]
    if loss is None and (LOSS_NAME, None) not in form.fields:
        raise ValueError(
            f"{model_name} returned {type(outputs).__name__} without a '{LOSS_NAME}' (its outputs: {keys}) and no "
            f"loss_fn was given: put the labels in the batch (e.g. labels=...) so that the model computes its loss, "
            "or pass loss_fn"
        )
    if loss is not None and LOSS_NAME in keys:
        raise ValueError(
            f"{model_name} computed its own '{LOSS_NAME}' and a loss_fn is given too: drop the labels from the batch, "
            "or pass loss_fn=None to train on the model's loss"
        )
    if loss is not None:
        form, named = OutputForm(None, [(LOSS_NAME, None)] + form.fields), [(LOSS_NAME, loss)] + named
    by_name = dict(named)
    return [by_name[name] for name in form.names], form


def _mapping_form(mapping, model_name, prefix):
    """(OutputForm, [(graph output name, tensor)]) of a ModelOutput or dict whose fields are named
    ``prefix`` + key: None fields and the generation cache left out, the others checked (``_field``)."""
    fields, named = [], []
    for key, value in mapping.items():
        if value is None or key == GENERATION_CACHE:
            continue
        kind, tensors = _field(prefix + key, value, model_name)
        fields.append((key, kind))
        named += tensors
    mapping_type = type(mapping) if dataclasses.is_dataclass(mapping) else dict
    return OutputForm(mapping_type, fields), named


def _field(name, value, model_name):
    """(kind, [(graph output name, tensor)]) of the field ``name``: a tensor, a tuple of tensors, or a
    ModelOutput/dict of these (its fields named ``name.<key>``); anything else is refused."""
    if isinstance(value, torch.Tensor):
        return None, [(name, value)]
    if isinstance(value, (tuple, list)) and value and all(isinstance(item, torch.Tensor) for item in value):
        return len(value), [(f"{name}.{index}", tensor) for index, tensor in enumerate(value)]
    if isinstance(value, Mapping):
        return _mapping_form(value, model_name, prefix=name + ".")
    raise TypeError(
        f"{model_name}.forward returned '{name}' as a {type(value).__name__}; the graph can only return tensors, "
        f"tuples of tensors and ModelOutputs or dicts of these (None and '{GENERATION_CACHE}' are left out). Turn off "
        "what produces it (e.g. config.use_cache=False, output_attentions=False), or return a tensor"
    )


def requested_outputs(model_desc, fetches: list) -> list:
    """The output names a step returns: the model_desc's, or the legacy ``fetches`` (TrainStepInfo) when set."""
    names = [entry.name for entry in model_desc.outputs]
    if not fetches:
        return names
    unknown = [name for name in fetches if name not in names]
    if unknown:
        raise RuntimeError(f"The specified fetches list contains invalid output names {unknown}; outputs are {names}")
    return list(fetches)


def selected_outputs(model_desc, outputs: list, requested: list, fetches: list):
    """The ``requested`` ones of a run's ``outputs`` (in model_desc order), as a step returns them."""
    by_name = dict(zip([entry.name for entry in model_desc.outputs], outputs))
    return packed_outputs(model_desc, [by_name[name] for name in requested], fetches)


def packed_outputs(model_desc, selected: list, fetches: list):
    """The outputs in the model's form (its ModelOutput or dict, when it returned one and no fetches are set), else
    the legacy list, a single tensor bare."""
    form = model_desc.form
    return form.pack(selected) if form is not None and not fetches else as_list(selected)

