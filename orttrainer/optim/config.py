"""Optimizer configurations (legacy ``optim.config`` semantics).

A config names the optimizer, its default hyper-parameters and optional parameter
groups. Its ``params`` holds the groups completed with every default (``lambda_coef`` stored
as ``lambda``), as the legacy ORTTrainer's did, but as copies: the legacy code completed the
caller's dicts in place. There is one learning rate for all weights.
"""

import copy
from enum import IntEnum
from math import inf

from ..argument_checks import NUMBER, argument_error, check_argument, is_non_negative

_OPTIMIZER_NAMES = ("AdamOptimizer", "LambOptimizer", "SGDOptimizer")
_DEFAULTS_KEY = {"lambda_coef": "lambda"}  # an argument (and attribute) that defaults and groups store under another key
_ATTRIBUTE = {key: argument for argument, key in _DEFAULTS_KEY.items()}
_GROUPS_EXAMPLE = "params=[{'params': ['fc.weight', 'fc.bias'], 'alpha': 0.8}]"


def _check_group_keys(group, index, name, allowed):
    """Every key of a parameter group but 'params' must be one of the hyper-parameter names ``allowed``."""
    for key in group:
        if key == "lr" and "lr" not in allowed:
            raise ValueError(
                f"'lr' is not supported inside params (params[{index}] has lr={group['lr']!r}): one learning "
                f"rate drives every weight. Remove 'lr' from params[{index}] and pass lr to the config instead."
            )
        if key != "params" and key not in allowed and str(key).replace("_coef", "") not in allowed:
            shown = ", ".join(_ATTRIBUTE.get(hyper, hyper) for hyper in allowed)
            raise ValueError(
                f"params[{index}] has '{key}', which is not a hyper-parameter of {name}; a group may set {shown}. "
                f"Remove '{key}' from params[{index}] or correct its spelling."
            )


class _OptimizerConfig:
    """Base class of optimizer configs: validates and completes ``params`` groups."""

    _GROUPS_MAY_SET_LR = True  # False: one learning rate drives every weight
    _mirrored = {}  # {attribute: value}: the hyper-parameters as attributes, as created (they mirror defaults)

    def __init__(self, name, params, defaults):
        check_argument(name, str, f"'name' must be one of {', '.join(_OPTIMIZER_NAMES)}",
                        "Use SGDConfig, AdamConfig or LambConfig instead of _OptimizerConfig.",
                        lambda value: value in _OPTIMIZER_NAMES)
        check_argument(defaults, dict, "'defaults' must be a dict with an 'lr' entry",
                        "Pass the default hyper-parameters, e.g. defaults={'lr': 0.001}.", lambda value: "lr" in value)
        check_argument(defaults["lr"], NUMBER, "'lr' must be a non-negative number",
                        "Pass a learning rate >= 0, e.g. lr=0.001.", is_non_negative)
        check_argument(params, list, "'params' must be a list of dicts", f"Pass params=[] or {_GROUPS_EXAMPLE}.")
        completed = []  # the user's groups are never changed
        for index, group in enumerate(params):
            check_argument(group, dict, f"params[{index}] must be a dict with 'params' and at least one hyper-parameter",
                            f"Write each group like {_GROUPS_EXAMPLE}.", lambda value: len(value) > 1 and "params" in value)
            check_argument(group["params"], list, f"params[{index}]['params'] must be a list of weight names",
                            f"Write each group like {_GROUPS_EXAMPLE}.", lambda value: all(isinstance(item, str) for item in value))
            _check_group_keys(group, index, name, [key for key in defaults if key != "lr" or self._GROUPS_MAY_SET_LR])
            group = {_DEFAULTS_KEY.get(key, key): value for key, value in group.items()}
            completed.append({**defaults, **group})
        self.name = name
        self.lr = float(defaults["lr"])
        self.defaults = defaults
        self.params = completed

    def __repr__(self):
        groups = f"params={self.params!r}, " if self.params else ""
        settings = ", ".join(f"{_ATTRIBUTE.get(key, key)}={value!r}" for key, value in self.defaults.items())
        return f"{type(self).__name__}({groups}{settings})"

    def settings_read_once(self) -> list:
        """[(key path, dict, key, value)] of what the trainer's update takes when it is built: the attributes, the
        defaults and every group's entries, all but ``lr`` (read at every step); lists copied, to compare later."""
        attributes = vars(self)
        return [*[(f"optim_config.{key}", attributes, key, value) for key, value in attributes.items()
                  if key not in ("name", "lr", "defaults", "params") and not key.startswith("_")],
                *[(f"optim_config.defaults[{key!r}]", self.defaults, key, value) for key, value in self.defaults.items()
                  if key != "lr"],
                *[(f"optim_config.params[{index}][{key!r}]", group, key, copy.copy(value))
                  for index, group in enumerate(self.params) for key, value in group.items()]]  # fmt: skip

    def attributes_set_since_creation(self) -> dict:
        """{attribute: 'optim_config.<attribute> was set to <value> (created with <value>)'} of each hyper-parameter
        attribute set after the config was created: the update reads defaults and params, which they only mirror."""
        return {key: f"optim_config.{key} was set to {now!r} (created with {value!r})"
                for key, value in self._mirrored.items() if (now := getattr(self, key)) is not value and now != value}

    def naming_tied_weights(self, aliases: dict):
        """A copy whose groups also name each tied weight by the name the trainer keeps it under (``aliases``:
        {alias: first name}, the module's state_dict order), so that a group naming either name applies."""
        tied = copy.copy(self)
        tied.params = [{**group, "params": group["params"] + [aliases[name] for name in group["params"] if name in aliases]}
                       for group in self.params]  # fmt: skip
        return tied

    def hyper_parameters(self, weight_name):
        """The hyper-parameters for one weight: its first group's, else the defaults."""
        for group in self.params:
            if weight_name in group["params"]:
                return {key: value for key, value in group.items() if key not in ("params", "lr")}
        return {key: value for key, value in self.defaults.items() if key != "lr"}


class SGDConfig(_OptimizerConfig):
    """Plain SGD, ``w <- w - lr * g`` (no momentum, no parameter groups)."""

    def __init__(self, params=[], lr=0.001):  # noqa: B006 - legacy signature
        super().__init__("SGDOptimizer", params, {"lr": lr})
        if params:
            raise argument_error(ValueError, "'params' must be an empty list for SGD optimizer", params,
                                  "SGD has one set of hyper-parameters: pass params=[] and set lr only.")


def _check_moment_settings(config_name, settings: dict):
    """The hyper-parameter checks Adam and Lamb share; ``config_name`` is the class the user called."""
    for key in ("alpha", "beta", "lambda_coef", "epsilon"):  # lr: checked by _OptimizerConfig
        check_argument(settings[key], NUMBER, f"'{key}' must be a non-negative number",
                        f"Pass {key} >= 0 to {config_name}.", is_non_negative)
    check_argument(settings["max_norm_clip"], NUMBER, "'max_norm_clip' must be a non-zero number",
                    f"Pass the gradient-norm bound to {config_name}, e.g. max_norm_clip=1.0; "
                    "to turn clipping off use the option utils.grad_norm_clip=False.", lambda value: value != 0)
    check_argument(settings["do_bias_correction"], bool, "'do_bias_correction' must be a bool",
                    f"Pass do_bias_correction=True or False to {config_name}.")


class _MomentConfig(_OptimizerConfig):
    """Shared part of Adam and Lamb: the moment hyper-parameters, their checks and attributes.

    ``settings`` holds every hyper-parameter by its attribute name (``lambda_coef``); the
    defaults dict stores it as ``lambda``, like the legacy configs.
    """

    _GROUPS_MAY_SET_LR = False

    def __init__(self, name, params, settings: dict):
        _check_moment_settings(type(self).__name__, settings)
        defaults = {_DEFAULTS_KEY.get(key, key): value for key, value in settings.items()}
        super().__init__(name, params, defaults)
        self._mirrored = {key: value for key, value in settings.items() if key != "lr"}
        for key, value in self._mirrored.items():
            setattr(self, key, value)


class AdamConfig(_MomentConfig):
    """Adam with decoupled weight decay, applied before (PyTorch AdamW) or after the update."""

    class DecayMode(IntEnum):
        BEFORE_WEIGHT_UPDATE = 0
        AFTER_WEIGHT_UPDATE = 1

    def __init__(
        self,
        params=[],  # noqa: B006 - legacy signature
        lr=0.001,
        alpha=0.9,
        beta=0.999,
        lambda_coef=0.0,
        epsilon=1e-8,
        max_norm_clip=1.0,
        do_bias_correction=True,
        weight_decay_mode=DecayMode.BEFORE_WEIGHT_UPDATE,
    ):
        check_argument(weight_decay_mode, AdamConfig.DecayMode, "'weight_decay_mode' must be an AdamConfig.DecayMode",
                        "Pass AdamConfig.DecayMode.BEFORE_WEIGHT_UPDATE (PyTorch AdamW) or "
                        "AdamConfig.DecayMode.AFTER_WEIGHT_UPDATE (HuggingFace AdamW).")
        settings = dict(lr=lr, alpha=alpha, beta=beta, lambda_coef=lambda_coef, epsilon=epsilon,
                        max_norm_clip=max_norm_clip, do_bias_correction=do_bias_correction,
                        weight_decay_mode=weight_decay_mode)  # fmt: skip
        super().__init__("AdamOptimizer", params, settings)


class LambConfig(_MomentConfig):
    """Lamb: Adam moments with a per-weight trust ratio ``||w|| / ||update||``."""

    def __init__(
        self,
        params=[],  # noqa: B006 - legacy signature
        lr=0.001,
        alpha=0.9,
        beta=0.999,
        lambda_coef=0.0,
        ratio_min=-inf,
        ratio_max=inf,
        epsilon=1e-6,
        max_norm_clip=1.0,
        do_bias_correction=False,
    ):
        for key, value in (("ratio_min", ratio_min), ("ratio_max", ratio_max)):
            check_argument(value, float, f"'{key}' must be a float", f"Pass {key} as a float, e.g. {key}=1.0 rather than 1.")
        settings = dict(lr=lr, alpha=alpha, beta=beta, lambda_coef=lambda_coef, ratio_min=ratio_min,
                        ratio_max=ratio_max, epsilon=epsilon, max_norm_clip=max_norm_clip,
                        do_bias_correction=do_bias_correction)  # fmt: skip
        super().__init__("LambOptimizer", params, settings)
