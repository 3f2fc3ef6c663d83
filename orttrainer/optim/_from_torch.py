"""The legacy config that updates as a torch optimizer does, for a loop that passes one (``torch.optim.AdamW(...)``).

The legacy configs have one learning rate, Adam with decoupled weight decay (torch's AdamW; torch's Adam when the decay
is 0) and SGD without momentum, and by default they clip the gradients to a global norm of ``max_norm_clip`` = 1.0,
where a torch loop clips only if it calls ``clip_grad_norm_``. The trainer's error for a torch optimizer shows the
equivalent (``equivalent_config``) or says why there is none.
"""

import torch

from .config import AdamConfig, SGDConfig

def _adam_settings(group: dict) -> dict:
    beta_1, beta_2 = group["betas"]  # torch takes tensors for these too
    return {"alpha": float(beta_1), "beta": float(beta_2), "epsilon": float(group["eps"]),
            "lambda_coef": float(group["weight_decay"])}  # fmt: skip


def _unsupported(optimizer) -> str:
    """Why no legacy config updates as ``optimizer`` does ("" if one does)."""
    name, groups = type(optimizer).__name__, optimizer.param_groups
    if len({float(group["lr"]) for group in groups}) > 1:
        return "its groups have different learning rates, and the legacy configs have one"
    if any(group.get("maximize") for group in groups):
        return "it maximizes"
    if isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam)):
        if any(group.get("amsgrad") for group in groups):
            return "amsgrad is on, which the legacy Adam does not have"
        if type(optimizer) is torch.optim.Adam and any(group["weight_decay"] for group in groups):
            return ("torch's Adam adds its weight decay to the gradient (L2); AdamConfig's lambda_coef is decoupled, as "
                    "torch's AdamW's")  # fmt: skip
        return ""
    if type(optimizer) is torch.optim.SGD:
        for key in ("momentum", "weight_decay", "dampening"):
            if any(group.get(key) for group in groups):
                return f"its {key} is not 0, and the legacy SGD is w <- w - lr * g"
        return "" if not any(group.get("nesterov") for group in groups) else "it is Nesterov's, and the legacy SGD is plain"
    return f"no legacy config is {name}: there are AdamConfig (torch's AdamW), SGDConfig (plain SGD) and LambConfig"


def equivalent_config(optimizer: torch.optim.Optimizer, model) -> tuple:
    """(config, options dict, the code that makes them) that update ``model`` as ``optimizer`` does, or (None, None, why
    not). Groups are named by ``model``'s parameter names; its parameters in no group are frozen, as torch leaves them."""
    why_not = _unsupported(optimizer)
    if why_not:
        return None, None, f"No orttrainer config updates as this torch.optim.{type(optimizer).__name__} does: {why_not}."
    names = {id(parameter): name for name, parameter in model.named_parameters()} if isinstance(model, torch.nn.Module) else {}
    groups = optimizer.param_groups
    lr = float(groups[0]["lr"])
    in_optimizer = {id(parameter) for group in groups for parameter in group["params"]}
    frozen = [name for key, name in names.items() if key not in in_optimizer]
    options = {"utils": {"frozen_weights": frozen}} if frozen else {}
    if isinstance(optimizer, torch.optim.SGD):
        config, code = SGDConfig(lr=lr), f"optim.SGDConfig(lr={lr!r})"
    else:
        defaults = _adam_settings(groups[0])
        params = []
        for group in groups[1:]:
            differing = {key: value for key, value in _adam_settings(group).items() if value != defaults[key]}
            if differing:
                params.append({"params": [names.get(id(parameter), "?") for parameter in group["params"]], **differing})
        created = AdamConfig()._mirrored  # AdamConfig's own defaults, left out of the code shown
        arguments = {key: value for key, value in defaults.items() if value != created[key]}
        config = AdamConfig(params=params, lr=lr, **arguments)
        options.setdefault("utils", {})["grad_norm_clip"] = False
        shown = ", ".join([*(["params=" + repr(params)] if params else []), f"lr={lr!r}",
                           *(f"{key}={value!r}" for key, value in arguments.items())])  # fmt: skip
        code = f"optim.AdamConfig({shown})"
    code += f" with options=ORTTrainerOptions({options!r})" if options else ""
    if isinstance(config, AdamConfig):
        code += (" (the legacy configs clip gradients to a global norm of max_norm_clip=1.0 unless utils.grad_norm_clip "
                 "is False; if the loop calls clip_grad_norm_(parameters, c), keep clipping and pass max_norm_clip=c)")
    return config, options, f"The same update is {code}."
