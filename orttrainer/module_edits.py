"""The user's module as the trainer's graphs were built from it, and what the user has changed of it since.

The trainer copies the module at its first step and trains the copy (build.TorchSource): a change to the user's module
after that never reaches the graphs. In a torch loop the same change takes effect at the next step, and some are how
a loop steers training: layers unfrozen, a BatchNorm put in eval(), a temperature or a drop rate set between epochs,
a head replaced, a hook added, a variable it closes over rebound or the values of a dict it reads changed. ``module_as_built`` keeps at the build what
such changes touch, in flat lists (an entry is read in well under a microsecond; ``module.parameters()`` walks the
module tree), and ``changes`` names what differs at a later step, so that the trainer refuses the step instead of
training the module as it was.
Weights' values are not kept: the trainer's own copy of them trains, and ``sync_to_module`` writes them back. What is
kept of each weight and buffer is its version counter, which every in-place write bumps (``load_state_dict``, an
optimizer of the user's, ``torch.nn.init``), and its storage's address (``.data =``, ``.to()``): a write there does not
reach the trainer's copy either, unless it wrote the trainer's own values (the legacy way to sync,
``model.load_state_dict(trainer.state_dict(pytorch_format=True))``). A write through ``.data`` bumps a counter of its
own and is not seen.
"""

from dataclasses import dataclass

import torch

from .forward_effects import MODULE_INTERNALS, comparable, hook_variables, state_owners, values_read_by_name

# A module's containers whose entries the graphs were built from, compared by identity: (attribute, what an entry is).
_CONTAINERS = (("_modules", "submodule"), ("_parameters", "parameter"), ("_buffers", "buffer"),
               ("_forward_pre_hooks", "forward pre-hook"), ("_forward_hooks", "forward hook"),
               ("_backward_pre_hooks", "backward pre-hook"), ("_backward_hooks", "backward hook"))  # fmt: skip
_MISSING = object()


@dataclass
class ModuleAsBuilt:
    """What the graphs were built from (``module_as_built``): lists of (description, where it is read, what it was)."""

    requires_grad: list  # (parameter name, parameter, requires_grad)
    training: list  # (module name, module, its mode as trained: a root in eval() trains in train() throughout)
    values: list  # (description, a module's __dict__, a hook's dict or variable, key, value): numbers, strings, None
    objects: list  # (description, container, key, object): tensor attributes and _CONTAINERS' entries, by identity
    sizes: list  # (description, container, length): an entry added to a container
    contents: list  # (description, state_dict name, tensor, (version counter, storage address), owner's path)

    def changes(self, trained_values, training: bool = True) -> list:
        """What differs now, one phrase each (empty: nothing); without ``training`` (an evaluation) the weights'
        requires_grad and the modules' modes do not count. ``trained_values()``: the trainer's {state_dict name:
        tensor}, read only if a weight or buffer was written (see ``written``)."""
        found = []
        if training:
            root_in_eval = not self.training[0][1].training
            found += [f"requires_grad of '{name}' went {was} -> {parameter.requires_grad}"
                      for name, parameter, was in self.requires_grad if parameter.requires_grad != was]
            found += [f"module '{name}' was put in {'eval' if was else 'train'}()"
                      for name, module, was in self.training if (root_in_eval or module.training) != was]
        found += changed_values(self.values)
        found += [f"{what} was {'deleted' if key not in container else 'replaced'}"
                  for what, container, key, was in self.objects if container.get(key, _MISSING) is not was]
        found += [f"{what} added" for what, container, length in self.sizes if len(container) > length]
        return found + self.written(trained_values)

    def written(self, trained_values) -> list:
        """The weights and buffers written since the build (or the last ``values_synced``) with values other than the
        trainer's (``trained_values()``, {state_dict name: tensor}); if all were written with the trainer's own, they
        count as synced. Every buffer of a module with a buffer written is compared: a BatchNorm's forward bumps the
        version of ``num_batches_tracked`` only, not of the running statistics it writes too."""
        changed = [_written_state(tensor) != was for _, _, tensor, was, _ in self.contents]
        if not any(changed):
            return []
        touched = {owner for (what, _, _, _, owner), change in zip(self.contents, changed)
                   if change and what.startswith("buffer")}  # fmt: skip
        trained = trained_values()
        written = [what for (what, name, tensor, _, owner), change in zip(self.contents, changed)
                   if (change or (owner in touched and what.startswith("buffer")))
                   and not (name in trained and _same_values(tensor, trained[name]))]  # fmt: skip
        if not written:
            self.values_synced()
        if len(written) > 3:  # load_state_dict: all of them
            return [f"the values of {len(written)} weights and buffers were written ({', '.join(written[:2])}, ...)"]
        return [f"the values of {what} were written" for what in written]

    def values_synced(self) -> None:
        """The values as they are now count as the trainer's: ``sync_to_module`` has just written them."""
        self.contents = [(what, name, tensor, _written_state(tensor), owner)
                         for what, name, tensor, _, owner in self.contents]  # fmt: skip


def changed_values(entries) -> list:
    """'<description> went <was> -> <now>' for each (description, dict, key, value) whose dict now holds another value
    at ``key`` (the same object counts as unchanged: a NaN too)."""
    return [f"{what} went {was!r} -> {container.get(key, '(deleted)')!r}"
            for what, container, key, was in entries if (now := container.get(key, _MISSING)) is not was and now != was]


def _written_state(tensor: torch.Tensor) -> tuple:
    return tensor._version, tensor.data_ptr()


def _same_values(tensor: torch.Tensor, trained: torch.Tensor) -> bool:
    if tensor.shape != trained.shape or tensor.dtype != trained.dtype:
        return False
    trained = trained.to(tensor.device)
    return bool(((tensor == trained) | (tensor.isnan() & trained.isnan()) if tensor.is_floating_point()
                 else tensor == trained).all())  # fmt: skip


def module_as_built(model: torch.nn.Module, loss_fn) -> ModuleAsBuilt:
    """``model`` (and the loss's modules or attributes: ``forward_effects.state_owners``) as it is now."""
    trains_all = not model.training
    requires_grad = [(name, parameter, parameter.requires_grad) for name, parameter in model.named_parameters()]
    training = [(name or "the model", module, trains_all or module.training) for name, module in model.named_modules()]
    values, objects, sizes, contents = [], [], [], {}
    for path, owner in state_owners(model, loss_fn):
        where = f"module '{path or 'the model'}'"
        attributes = vars(owner)
        for name, value in attributes.items():
            if name in MODULE_INTERNALS:
                continue
            if isinstance(value, torch.Tensor):
                objects.append((f"tensor attribute '{name}' of {where}", attributes, name, value))
                contents.setdefault(id(value), (f"tensor attribute '{name}' of {where}", None, value, _written_state(value),
                                                path))  # fmt: skip
            elif comparable(value):
                values.append((f"attribute '{name}' of {where}", attributes, name, value))
        if not isinstance(owner, torch.nn.Module):
            continue
        values += hook_variables(owner, path or "the model")  # a variable or dict a forward hook reads
        for container_name, kind in _CONTAINERS:
            container = attributes[container_name]
            objects += [(f"{kind} '{key}' of {where}" if isinstance(key, str) else f"a {kind} of {where}", container, key,
                         entry) for key, entry in container.items()]  # fmt: skip
            sizes.append((f"a {kind} of {where}", container, len(container)))
        for kind, container in (("parameter", owner._parameters), ("buffer", owner._buffers)):
            for key, tensor in container.items():
                if tensor is not None:  # a tied weight once, under its first name
                    contents.setdefault(id(tensor), (f"{kind} '{key}' of {where}", f"{path}.{key}".lstrip("."), tensor,
                                                     _written_state(tensor), path))  # fmt: skip
    values += values_read_by_name(model, loss_fn)
    return ModuleAsBuilt(requires_grad, training, values, objects, sizes, list(contents.values()))
