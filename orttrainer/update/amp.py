"""Loss scalers for mixed-precision training (legacy ``amp.loss_scaler`` semantics), and what the option group
``mixed_precision`` chooses: the dtype the graphs compute in, and whether its loss is scaled."""

import contextlib

import torch

from ..argument_checks import NUMBER, check_argument, is_positive


def compute_dtype(mixed_precision) -> torch.dtype:
    """The dtype the option group ``mixed_precision`` has the graphs compute in: float32 unless enabled."""
    return mixed_precision.dtype if mixed_precision.enabled else torch.float32


def scales_loss(mixed_precision) -> bool:
    """Whether the option group ``mixed_precision`` trains the legacy way: in float16, its loss scaled by the loss
    scaler (bfloat16 has float32's range and needs no scale, as under torch.autocast)."""
    return compute_dtype(mixed_precision) == torch.float16


def torch_autocast(mixed_precision, device: torch.device):
    """The context torch's side runs in to compute as the graphs do (export, the first-step check): torch.autocast
    with bfloat16 on ``device`` for bfloat16 mixed precision, nothing else otherwise."""
    if compute_dtype(mixed_precision) != torch.bfloat16:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def under_torch_autocast(mixed_precision, device: torch.device, function):
    """``function`` run inside ``torch_autocast(mixed_precision, device)`` at each call."""

    def run(*args, **kwargs):
        with torch_autocast(mixed_precision, device):
            return function(*args, **kwargs)

    return run


def refuse_other_autocast(mixed_precision, device: torch.device, call: str) -> None:
    """Refuse ``call`` (train_step, eval_step) inside an active torch.autocast on ``device``'s type whose dtype is
    not the one the graphs compute in: torch would compute in that dtype, the graphs would not. Under
    torch.autocast with bfloat16 and the bfloat16 option, the graphs compute as torch does."""
    if not torch.is_autocast_enabled(device.type):
        return
    active = torch.get_autocast_dtype(device.type)
    if mixed_precision.enabled and active == mixed_precision.dtype == torch.bfloat16:
        return
    raise ValueError(
        f"orttrainer: {call} inside torch.autocast('{device.type}', dtype={active}), where the graphs compute in "
        f"{compute_dtype(mixed_precision)} (options mixed_precision): torch.autocast does not reach ONNX Runtime. "
        "Call it outside torch.autocast; to train as torch.autocast with bfloat16 does, set "
        "ORTTrainerOptions({'mixed_precision': {'enabled': True, 'dtype': torch.bfloat16}})"
    )


class LossScaler:
    """Base class of loss scalers: holds the current scale and its initial value.

    Subclasses implement :meth:`update`, called by the trainer after every optimizer
    boundary step of a mixed-precision run, and return the new scale.
    """

    def __init__(self, loss_scale):
        self._check_scale(loss_scale)
        self._input_name = None
        self._loss_scale = float(loss_scale)
        self._initial_loss_scale = float(loss_scale)

    @staticmethod
    def _check_scale(loss_scale):
        check_argument(loss_scale, NUMBER, "'loss_scale' must be a positive number",
                        "Pass a number > 0, e.g. loss_scale=65536.0 (2**16).", is_positive)

    @property
    def input_name(self):
        return self._input_name

    @input_name.setter
    def input_name(self, input_name):
        check_argument(input_name, (str, type(None)), "'input_name' must be a string",
                        "Assign the name of the graph input that carries the loss scale (the trainer sets it).")
        self._input_name = input_name

    @property
    def loss_scale(self):
        return self._loss_scale

    @loss_scale.setter
    def loss_scale(self, loss_scale):
        self._check_scale(loss_scale)
        self._loss_scale = float(loss_scale)

    def reset(self):
        """Restore the initial loss scale."""
        self._loss_scale = self._initial_loss_scale

    def update(self, train_step_info):
        """Return the loss scale to use from now on, given the finished step."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """The scaler's position, so that a resumed run scales as the original (checkpoint key ``loss_scaler``)."""
        return {"loss_scale": self.loss_scale}

    def load_state_dict(self, state: dict) -> None:
        self.loss_scale = float(state["loss_scale"])


class DynamicLossScaler(LossScaler):
    """Halve the scale on overflow; double it after ``up_scale_window`` finite steps.

    With ``automatic_update=False`` the scale never changes (static loss scaling).
    """

    def __init__(
        self,
        automatic_update=True,
        loss_scale=float(1 << 16),
        up_scale_window=2000,
        min_loss_scale=1.0,
        max_loss_scale=float(1 << 24),
    ):
        super().__init__(loss_scale)
        check_argument(automatic_update, bool, "'automatic_update' must be a bool",
                        "Pass automatic_update=True (dynamic scaling) or False (a static loss scale).")
        check_argument(up_scale_window, int, "'up_scale_window' must be a positive int",
                        "Pass the number of finite steps before the scale doubles, e.g. up_scale_window=2000.", is_positive)
        check_argument(min_loss_scale, NUMBER, "'min_loss_scale' must be positive",
                        "Pass the smallest scale to fall back to, e.g. min_loss_scale=1.0.", is_positive)
        check_argument(max_loss_scale, NUMBER, f"'max_loss_scale' must be at least 'min_loss_scale' ({min_loss_scale})",
                        "Pass max_loss_scale >= min_loss_scale, e.g. max_loss_scale=16777216.0 (2**24).",
                        lambda value: value >= min_loss_scale)
        self.automatic_update = automatic_update
        self.up_scale_window = up_scale_window
        self.min_loss_scale = float(min_loss_scale)
        self.max_loss_scale = float(max_loss_scale)
        self._stable_steps_count = 0

    def reset(self):
        super().reset()
        self._stable_steps_count = 0

    def state_dict(self) -> dict:
        return {**super().state_dict(), "stable_steps": self._stable_steps_count}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if "stable_steps" in state:
            self._stable_steps_count = int(state["stable_steps"])

    def update(self, train_step_info):
        if not self.automatic_update:
            return self.loss_scale
        if train_step_info.all_finite:
            self._stable_steps_count += 1
            if self._stable_steps_count >= self.up_scale_window:
                self.loss_scale = min(self.max_loss_scale, self.loss_scale * 2)
                self._stable_steps_count = 0
        else:
            self.loss_scale = max(self.min_loss_scale, self.loss_scale / 2)
            self._stable_steps_count = 0
        return self.loss_scale
