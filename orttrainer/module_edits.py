"""The user's module as the trainer's graphs were built from it, and what the user has changed of it since.

The trainer copies the module at its first step and trains the copy (build.TorchSource): a change to the user's module
after that never reaches the graphs. In a torch loop the same change takes effect at the next step, and some are how
a loop steers training: layers unfrozen, a BatchNorm put in eval(), a temperature or a drop rate set between epochs,
a head replaced, a hook added or the values of a dict it reads changed. ``module_as_built`` keeps at the build what
such changes touch, in flat lists (an entry is read in well under a microsecond; ``module.parameters()`` walks the
module tree), and ``changes`` names what differs at a later step, so that the trainer refuses the step instead of
training the module as it was.
Weights' values are not kept: the trainer's own copy of them trains, and ``sync_to_module`` writes them back.
"""

from dataclasses import dataclass

import torch

from .forward_effects import MODULE_INTERNALS, comparable, hook_variables, state_owners

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
    values: list  # (description, a module's __dict__ or a dict a hook holds, key, value): Python numbers, strings, None
    objects: list  # (description, container, key, object): tensor attributes and _CONTAINERS' entries, by identity
    sizes: list  # (description, container, length): an entry added to a container

    def changes(self, training: bool = True) -> list:
        """What differs now, one phrase each (empty: nothing); without ``training`` (an evaluation) the weights'
        requires_grad and the modules' modes do not count."""
        found = []
        if training:
            root_in_eval = not self.training[0][1].training
            found += [f"requires_grad of '{name}' went {was} -> {parameter.requires_grad}"
                      for name, parameter, was in self.requires_grad if parameter.requires_grad != was]
            found += [f"module '{name}' was put in {'eval' if was else 'train'}()"
                      for name, module, was in self.training if (root_in_eval or module.training) != was]
        found += [f"{what} went {was!r} -> {container.get(key, '(deleted)')!r}"  # the same object: unchanged (NaN too)
                  for what, container, key, was in self.values
                  if (now := container.get(key, _MISSING)) is not was and now != was]
        found += [f"{what} was {'deleted' if key not in container else 'replaced'}"
                  for what, container, key, was in self.objects if container.get(key, _MISSING) is not was]
        found += [f"{what} added" for what, container, length in self.sizes if len(container) > length]
        return found


def module_as_built(model: torch.nn.Module, loss_fn) -> ModuleAsBuilt:
    """``model`` (and the loss's modules or attributes: ``forward_effects.state_owners``) as it is now."""
    trains_all = not model.training
    requires_grad = [(name, parameter, parameter.requires_grad) for name, parameter in model.named_parameters()]
    training = [(name or "the model", module, trains_all or module.training) for name, module in model.named_modules()]
    values, objects, sizes = [], [], []
    for path, owner in state_owners(model, loss_fn):
        where = f"module '{path or 'the model'}'"
        attributes = vars(owner)
        for name, value in attributes.items():
            if name in MODULE_INTERNALS:
                continue
            if isinstance(value, torch.Tensor):
                objects.append((f"tensor attribute '{name}' of {where}", attributes, name, value))
            elif comparable(value):
                values.append((f"attribute '{name}' of {where}", attributes, name, value))
        if not isinstance(owner, torch.nn.Module):
            continue
        values += [(description, holder, key, value)  # a dict a forward hook holds, which a loop may change
                   for description, holder, key, value in hook_variables(owner, path or "the model")
                   if holder is not None]
        for container_name, kind in _CONTAINERS:
            container = attributes[container_name]
            objects += [(f"{kind} '{key}' of {where}" if isinstance(key, str) else f"a {kind} of {where}", container, key,
                         entry) for key, entry in container.items()]  # fmt: skip
            sizes.append((f"a {kind} of {where}", container, len(container)))
    return ModuleAsBuilt(requires_grad, training, values, objects, sizes)
