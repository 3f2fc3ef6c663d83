"""The user's module as the trainer's graphs were built from it, and what the user has changed of it since.

The trainer exports the module at its first step and trains its tensors in place: the sessions read the memory of
its parameters and buffers, so a write into them between steps (``load_state_dict``, weight clipping under
``no_grad``, ``torch.nn.init``, an optimizer of the user's) takes effect at the next step, as in a torch loop. What
the graphs hold as it was at the export does not follow a change: its structure, the modes of its modules, the
Python values its forward read, the tensors it holds as constants (tensor attributes, buffers outside its
state_dict), and the memory of each weight (a storage replaced by ``.data =``, ``.to()`` or ``.half()`` leaves the
sessions reading the old one). In a torch loop such a change takes effect at the next step, and some are how a loop
steers training: layers unfrozen, a BatchNorm put in eval(), a temperature or a drop rate set between epochs, a head
replaced, a hook added, a variable it closes over rebound or the values of a dict it reads changed.
``module_as_built`` keeps at the build what such changes touch, in flat lists (an entry is read in well under a
microsecond; ``module.parameters()`` walks the module tree), and ``changes`` names what differs at a later step, so
that the trainer refuses the step instead of training the module as it was.
"""

from dataclasses import dataclass

import torch

from .forward_effects import MODULE_INTERNALS, comparable, hook_variables, state_owners, values_read_by_name

# A module's containers whose entries the graphs were built from, compared by identity: (attribute, what an entry is).
_CONTAINERS = (("_modules", "submodule"), ("_parameters", "parameter"), ("_buffers", "buffer"),
               ("_forward_pre_hooks", "forward pre-hook"), ("_forward_hooks", "forward hook"),
               ("_backward_pre_hooks", "backward pre-hook"), ("_backward_hooks", "backward hook"))  # fmt: skip
_MISSING = object()
# why a module in eval() at the build counts as put in train() when the whole model is in eval() (as_trained.as_trained)
_BY_MODEL_EVAL = (" (the model is in eval(), which trains every module in train(), as the legacy ORTTrainer did: call "
                  "model.train() and eval() on this module again)")


@dataclass
class ModuleAsBuilt:
    """What the graphs were built from (``module_as_built``): lists of (description, where it is read, what it was)."""

    requires_grad: list  # (parameter name, parameter, requires_grad)
    training: list  # (module name, module, its mode as trained: a root in eval() trains in train() throughout)
    values: list  # (description, a module's __dict__, a hook's dict or variable, key, value): numbers, strings, None
    objects: list  # (description, container, key, object): tensor attributes and _CONTAINERS' entries, by identity
    sizes: list  # (description, container, length): an entry added to a container
    storages: list  # (description, tensor, storage address): every parameter, buffer and tensor attribute
    constants: list  # (description, tensor, version counter): the tensors the graphs hold as values

    def changes(self, training: bool = True) -> list:
        """What differs now, one phrase each (empty: nothing); without ``training`` (an evaluation) the weights'
        requires_grad and the modules' modes do not count."""
        found = []
        if training:
            root_in_eval = not self.training[0][1].training
            found += [f"requires_grad of '{name}' went {was} -> {parameter.requires_grad}"
                      for name, parameter, was in self.requires_grad if parameter.requires_grad != was]
            found += [f"module '{name}' was put in {'eval' if was else 'train'}()" + _BY_MODEL_EVAL * root_in_eval
                      for name, module, was in self.training if (root_in_eval or module.training) != was]
        found += changed_values(self.values)
        found += [f"{what} was {'deleted' if key not in container else 'replaced'}"
                  for what, container, key, was in self.objects if container.get(key, _MISSING) is not was]
        found += [f"{what} added" for what, container, length in self.sizes if len(container) > length]
        found += [f"the memory of {what} was replaced (.data =, .to(), .half()); write into it instead "
                  "(with torch.no_grad(): tensor.copy_(new))" for what, tensor, address in self.storages
                  if tensor.data_ptr() != address]  # fmt: skip
        return found + [f"the values of {what} were written (the graphs hold them as constants)"
                        for what, tensor, version in self.constants if tensor._version != version]


def changed_values(entries) -> list:
    """'<description> went <was> -> <now>' for each (description, dict, key, value) whose dict now holds another value
    at ``key`` (the same object counts as unchanged: a NaN too)."""
    return [f"{what} went {was!r} -> {container.get(key, '(deleted)')!r}"
            for what, container, key, was in entries if (now := container.get(key, _MISSING)) is not was and now != was]


def module_as_built(model: torch.nn.Module, loss_fn) -> ModuleAsBuilt:
    """``model`` (and the loss's modules or attributes: ``forward_effects.state_owners``) as it is now."""
    trains_all = not model.training
    requires_grad = [(name, parameter, parameter.requires_grad) for name, parameter in model.named_parameters()]
    training = [(name or "the model", module, trains_all or module.training) for name, module in model.named_modules()]
    in_state = {id(tensor) for tensor in model.state_dict(keep_vars=True).values()}  # the sessions read these in place
    values, objects, sizes, tensors = [], [], [], {}
    for path, owner in state_owners(model, loss_fn):
        where = f"module '{path or 'the model'}'"
        attributes = vars(owner)
        for name, value in attributes.items():
            if name in MODULE_INTERNALS:
                continue
            if isinstance(value, torch.Tensor):
                objects.append((f"tensor attribute '{name}' of {where}", attributes, name, value))
                tensors.setdefault(id(value), (f"tensor attribute '{name}' of {where}", value))
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
                    tensors.setdefault(id(tensor), (f"{kind} '{key}' of {where}", tensor))
    values += values_read_by_name(model, loss_fn)
    storages = [(what, tensor, tensor.data_ptr()) for what, tensor in tensors.values()]
    constants = [(what, tensor, tensor._version) for key, (what, tensor) in tensors.items() if key not in in_state]
    return ModuleAsBuilt(requires_grad, training, values, objects, sizes, storages, constants)


def refuse_setting_changes(options_given, settings_as_built, optim_config) -> None:
    """ValueError naming what changed since the trainer took it: the ORTTrainerOptions the user passed (the trainer
    keeps a copy), the options and optim_config the build took (all but the learning rate and the options read at
    every step), and optim_config's hyper-parameter attributes as created (the update reads its defaults and
    groups)."""
    given = changed_values(options_given)
    if given:
        raise ValueError(
            f"since the trainer was created, {'; '.join(given)} in the ORTTrainerOptions passed to it: the trainer "
            "keeps a copy of them, taken then, which these changes do not reach. Change trainer.options instead "
            "(before the first step; batch.gradient_accumulation_steps and lr_scheduler also between steps)"
        )
    changed = changed_values(settings_as_built)
    if changed:
        raise ValueError(
            f"since the trainer built its graphs and update (at its first step; an ONNX model's when it was created), "
            f"{'; '.join(changed)}: the trainer took these then, so the change would not apply. Set them before, or "
            "go on in a new trainer created with them, from this one's state "
            "(new_trainer.load_state_dict(trainer.state_dict()))"
        )
    set_since = optim_config.attributes_set_since_creation()
    if set_since:
        attribute = next(iter(set_since))
        raise ValueError(
            f"{'; '.join(set_since.values())}: the update takes the hyper-parameters of optim_config.defaults and "
            "params, filled in when the config is created, not its attributes. Create the config with the value, "
            f"e.g. {type(optim_config).__name__}({attribute}={getattr(optim_config, attribute)!r})"
        )


def refuse_module_changes(built_from: ModuleAsBuilt, training: bool) -> None:
    """ValueError naming what changed of the user's module since its first step: the graphs hold its structure, modes
    and the values its forward read then, and the sessions read the memory of its weights, so such a change would
    not reach the step, without a word. Values written into its weights do reach it. With ``training`` False
    (eval_step) the weights' requires_grad and the modules' modes do not count."""
    changed = built_from.changes(training)
    if changed:
        raise ValueError(
            f"since the trainer's first step, {'; '.join(changed)}: the trainer's graphs hold the module as it was "
            "then, with the values its forward read then, which these changes do not reach. Freeze weights, set "
            "modes and attributes before creating the trainer (requires_grad or options utils.frozen_weights; "
            "eval() on a submodule); pass a value that changes between steps as an argument of forward (a tensor, "
            "or a number: a graph per value); or create a new trainer"
        )
