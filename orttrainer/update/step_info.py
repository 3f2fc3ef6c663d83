"""TrainStepInfo: the legacy per-step record the trainer hands LR schedulers and loss scalers."""

from ..argument_checks import check_argument, is_non_negative
from ..optim.config import _OptimizerConfig


class TrainStepInfo:
    """Per-step state passed to LR schedulers and loss scalers (legacy record)."""

    def __init__(self, optimizer_config, all_finite=True, fetches=None, optimization_step=0, step=0):
        fetches = [] if fetches is None else fetches
        check_argument(optimizer_config, _OptimizerConfig, "optimizer_config must be an optim config",
                        "Pass the trainer's optim_config, e.g. optim.SGDConfig(lr=0.1).")
        check_argument(all_finite, bool, "all_finite must be a bool", "Pass all_finite=True or False.")
        check_argument(fetches, list, "fetches must be a list of str", "Pass output names, e.g. fetches=['loss'].")
        for index, name in enumerate(fetches):
            check_argument(name, str, f"fetches[{index}] must be a str", "Pass output names, e.g. fetches=['loss'].")
        for key, value in (("optimization_step", optimization_step), ("step", step)):
            check_argument(value, int, f"{key} must be an int >= 0", f"Pass a count of steps, e.g. {key}=0.",
                            is_non_negative)
        self.optimizer_config = optimizer_config
        self.all_finite = all_finite
        self.fetches = fetches
        self.optimization_step = optimization_step
        self.step = step
