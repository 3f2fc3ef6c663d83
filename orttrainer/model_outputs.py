"""What the model returns <-> the graph's outputs: flattened to tensors for the export, packed back for the user.

A graph returns a flat list of tensors, the loss first. A model returns a tensor, a
tuple/list of tensors, a dict, or a Hugging Face ``ModelOutput`` (a dataclass that is a
dict). ``flatten`` turns any of these into the graph's tensors and an :class:`OutputForm`
that names them and packs a step's outputs back into the model's own form: the same
ModelOutput class (``.loss``, ``.logits`` ...) or dict; a tensor or tuple gives the legacy list.

The rules (README "Hugging Face models", docs/legacy_api.md §3): a field that is None is absent (as
ModelOutput leaves it out); a tuple of tensors (``hidden_states``, ``attentions``) becomes
one graph output per tensor, ``<field>.<index>``, and a tuple again; ``past_key_values``,
the cache that generation reads and a training step does not, is left out; any other value
is refused, naming the field.
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
    legacy list. ``fields`` are (key, tuple length or None for a tensor) in the model's order.
    """

    def __init__(self, mapping_type, fields):
        self.mapping_type, self.fields = mapping_type, fields

    @property
    def names(self) -> list:
        """The graph's output names: the loss first, then the other outputs in the model's order."""
        loss_first = sorted(self.fields, key=lambda field: field[0] != LOSS_NAME)  # a stable sort
        return [name for key, length in loss_first for name in _field_names(key, length)]

    def pack(self, outputs: list):
        """``outputs`` (one per name, in ``names`` order) in the model's form: its ModelOutput
        class or a dict; the legacy list (a single tensor bare) for a tensor or tuple."""
        if self.mapping_type is None:
            return as_list(outputs)
        by_name = dict(zip(self.names, outputs))
        fields = {
            key: by_name[key] if length is None else tuple(by_name[name] for name in _field_names(key, length))
            for key, length in self.fields
        }
        return self.mapping_type(**fields) if dataclasses.is_dataclass(self.mapping_type) else dict(fields)


def as_list(outputs: list):
    """The legacy return value of a step: the outputs as a list, a single one bare."""
    return outputs[0] if len(outputs) == 1 else list(outputs)


def _field_names(key, length) -> list:
    return [key] if length is None else [f"{key}.{index}" for index in range(length)]


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
    kept = {key: _checked_field(key, value, model_name) for key, value in outputs.items()
            if value is not None and key != GENERATION_CACHE}  # fmt: skip
    if loss is None and not isinstance(kept.get(LOSS_NAME), torch.Tensor):
        raise ValueError(
            f"{model_name} returned {type(outputs).__name__} without a '{LOSS_NAME}' (its outputs: {list(kept)}) and no "
            f"loss_fn was given: put the labels in the batch (e.g. labels=...) so that the model computes its loss, "
            "or pass loss_fn"
        )
    if loss is not None and LOSS_NAME in kept:
        raise ValueError(
            f"{model_name} computed its own '{LOSS_NAME}' and a loss_fn is given too: drop the labels from the batch, "
            "or pass loss_fn=None to train on the model's loss"
        )
    fields = [(key, len(value) if isinstance(value, tuple) else None) for key, value in kept.items()]
    if loss is not None:
        kept = {LOSS_NAME: loss, **kept}
        form = OutputForm(None, [(LOSS_NAME, None)] + fields)
    else:
        form = OutputForm(type(outputs) if dataclasses.is_dataclass(outputs) else dict, fields)
    by_name = dict(pair for key, value in kept.items() for pair in _named_tensors(key, value))
    return [by_name[name] for name in form.names], form


def _named_tensors(key, value) -> list:
    """(graph output name, tensor) of one field: ``key``, or ``key.<index>`` for each tensor of a tuple."""
    if isinstance(value, tuple):
        return [(f"{key}.{index}", tensor) for index, tensor in enumerate(value)]
    return [(key, value)]


def _checked_field(key, value, model_name):
    """A tensor, or a tuple of tensors as a tuple; anything else is refused."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and all(isinstance(item, torch.Tensor) for item in value):
        return tuple(value)
    if isinstance(value, Mapping):
        raise TypeError(
            f"{model_name}.forward returned '{key}' as a {type(value).__name__}, a ModelOutput inside the ModelOutput (CLIP's "
            "text_model_output); the graph can only return tensors and tuples of tensors: wrap the model in a module whose "
            "forward returns the fields you need"
        )
    raise TypeError(
        f"{model_name}.forward returned '{key}' as a {type(value).__name__}; the graph can only return tensors and "
        f"tuples of tensors (None and '{GENERATION_CACHE}' are left out). Turn off what produces it (e.g. "
        "config.use_cache=False, output_attentions=False), or return a tensor"
    )
