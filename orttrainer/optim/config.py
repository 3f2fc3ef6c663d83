"""Optimizer configurations (legacy ``optim.config`` semantics).

A config names the optimizer, its default hyper-parameters and optional parameter
groups. Groups are completed in place with every default (``lambda_coef`` is stored as
``lambda``), exactly as the legacy ORTTrainer did; there is one learning rate for all
weights.
"""

from enum import IntEnum
from math import inf

_OPTIMIZER_NAMES = ("AdamOptimizer", "LambOptimizer", "SGDOptimizer")


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _OptimizerConfig:
    """Base class of optimizer configs: validates and completes ``params`` groups."""

    def __init__(self, name, params, defaults):
        assert isinstance(name, str) and name in _OPTIMIZER_NAMES, (
            f"'name' must be one of {', '.join(_OPTIMIZER_NAMES)}, got {name!r}"
        )
        assert isinstance(defaults, dict) and "lr" in defaults, "'defaults' must be a dict with an 'lr' entry"
        assert _is_number(defaults["lr"]) and defaults["lr"] >= 0, "'lr' must be a non-negative number"
        assert isinstance(params, list), "'params' must be a list of dicts"
        for index, group in enumerate(params):
            assert isinstance(group, dict) and len(group) > 1 and "params" in group, (
                f"params[{index}] must be a dict with 'params' and at least one hyper-parameter"
            )
            for key in group:
                if key == "params":
                    continue
                assert key in defaults or key.replace("_coef", "") in defaults, (
                    f"params[{index}] has '{key}', which is not a hyper-parameter of {name}"
                )
            if "lambda_coef" in group:
                group["lambda"] = group.pop("lambda_coef")
            for key, value in defaults.items():
                group.setdefault(key, value)
        self.name = name
        self.lr = float(defaults["lr"])
        self.defaults = defaults
        self.params = params

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
        assert len(params) == 0, "'params' must be an empty list for SGD optimizer"


def _check_moment_settings(lr, alpha, beta, lambda_coef, epsilon, max_norm_clip, do_bias_correction):
    for name, value in (("lr", lr), ("alpha", alpha), ("beta", beta), ("lambda_coef", lambda_coef), ("epsilon", epsilon)):
        assert _is_number(value) and value >= 0, f"'{name}' must be a non-negative number, got {value!r}"
    assert _is_number(max_norm_clip) and max_norm_clip != 0, "'max_norm_clip' must be a non-zero number"
    assert isinstance(do_bias_correction, bool), "'do_bias_correction' must be a bool"


class _MomentConfig(_OptimizerConfig):
    """Shared part of Adam and Lamb: the moment hyper-parameters, their checks and attributes.

    ``settings`` holds every hyper-parameter by its attribute name (``lambda_coef``); the
    defaults dict stores it as ``lambda``, like the legacy configs.
    """

    def __init__(self, name, params, settings: dict):
        _check_moment_settings(*(settings[key] for key in
                                 ("lr", "alpha", "beta", "lambda_coef", "epsilon", "max_norm_clip", "do_bias_correction")))  # fmt: skip
        for index, group in enumerate(params):
            assert "lr" not in group, f"'lr' is not supported inside params (params[{index}])"
        defaults = {("lambda" if key == "lambda_coef" else key): value for key, value in settings.items()}
        super().__init__(name, params, defaults)
        for key, value in settings.items():
            if key != "lr":
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
        assert isinstance(weight_decay_mode, AdamConfig.DecayMode), "'weight_decay_mode' must be an AdamConfig.DecayMode"
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
        assert isinstance(ratio_min, float), "'ratio_min' must be a float"
        assert isinstance(ratio_max, float), "'ratio_max' must be a float"
        settings = dict(lr=lr, alpha=alpha, beta=beta, lambda_coef=lambda_coef, ratio_min=ratio_min,
                        ratio_max=ratio_max, epsilon=epsilon, max_norm_clip=max_norm_clip,
                        do_bias_correction=do_bias_correction)  # fmt: skip
        super().__init__("LambOptimizer", params, settings)
