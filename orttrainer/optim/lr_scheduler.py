"""Learning-rate schedules with warmup (legacy ``optim.lr_scheduler`` semantics).

Every schedule reads ``train_step_info.optimization_step`` (the number of completed
optimizer updates, so the first step sees 0) and the base lr of the optimizer config,
and returns ``[base_lr * factor]``.
"""

import math

from ..argument_checks import check_argument, is_non_negative, is_positive


class _LRScheduler:
    """Base class: subclasses implement :meth:`get_lr`."""

    def __init__(self):
        self._last_lr = []

    def get_lr(self, train_step_info):
        """Return a one-element list with the learning rate for this step."""
        raise NotImplementedError

    def get_last_lr(self):
        return self._last_lr

    def _step(self, train_step_info):
        self._last_lr = self.get_lr(train_step_info)
        return self._last_lr


class _WarmupLRScheduler(_LRScheduler):
    """Shared part of the four schedules: argument checks and the warmup ramp."""

    def __init__(self, total_steps, warmup):
        super().__init__()
        check_argument(total_steps, int, "'total_steps' must be a strict positive number",
                        f"Pass the number of optimizer updates to {type(self).__name__}, e.g. total_steps=1000.",
                        is_positive)
        check_argument(warmup, float, "'warmup' must be a float between [0, 1)",
                        "Pass the warmup as a fraction of total_steps, e.g. warmup=0.1 for the first 10% of updates.",
                        lambda value: 0 <= value < 1)
        self.total_steps = total_steps
        self.warmup = warmup

    def _factor(self, step, warmup_steps, base_lr):
        raise NotImplementedError

    def get_lr(self, train_step_info):
        base_lr = train_step_info.optimizer_config.lr
        step = train_step_info.optimization_step
        warmup_steps = self.warmup * self.total_steps
        if step < warmup_steps:
            factor = step / max(1, warmup_steps)
        else:
            factor = self._factor(step, warmup_steps, base_lr)
        return [base_lr * factor]


class ConstantWarmupLRScheduler(_WarmupLRScheduler):
    """Linear warmup to the base lr, then constant."""

    def __init__(self, total_steps, warmup=0.002):
        super().__init__(total_steps, warmup)

    def _factor(self, step, warmup_steps, base_lr):
        return 1.0


class CosineWarmupLRScheduler(_WarmupLRScheduler):
    """Linear warmup, then a cosine decay over ``cycles`` half-periods."""

    def __init__(self, total_steps, cycles=0.5, warmup=0.002):
        super().__init__(total_steps, warmup)
        check_argument(cycles, float, "'cycles' must be a positive float",
                        "Pass the number of cosine half-periods after warmup, e.g. cycles=0.5 to decay to zero once.",
                        is_positive)
        self.cycles = cycles

    def _factor(self, step, warmup_steps, base_lr):
        progress = (step - warmup_steps) / max(1, self.total_steps - warmup_steps)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * self.cycles * 2.0 * progress)))


class LinearWarmupLRScheduler(_WarmupLRScheduler):
    """Linear warmup, then a linear decay to zero at ``total_steps``."""

    def __init__(self, total_steps, warmup=0.002):
        super().__init__(total_steps, warmup)

    def _factor(self, step, warmup_steps, base_lr):
        return max(0.0, (self.total_steps - step) / max(1, self.total_steps - warmup_steps))


class PolyWarmupLRScheduler(_WarmupLRScheduler):
    """Linear warmup, then a polynomial decay from the base lr to ``lr_end``."""

    def __init__(self, total_steps, lr_end=1e-7, power=1.0, warmup=0.002):
        super().__init__(total_steps, warmup)
        check_argument(lr_end, float, "'lr_end' must be a float >= 0",
                        "Pass the final learning rate as a float, e.g. lr_end=1e-7.", is_non_negative)
        check_argument(power, float, "'power' must be a float >= 0",
                        "Pass the decay exponent as a float, e.g. power=1.0 for a linear decay.", is_non_negative)
        self.lr_end = lr_end
        self.power = power

    def get_lr(self, train_step_info):
        base_lr = train_step_info.optimizer_config.lr
        if base_lr <= self.lr_end:
            raise ValueError(
                f"lr_end ({self.lr_end}) must be smaller than the base lr ({base_lr}): PolyWarmupLRScheduler decays "
                "the optimizer config's lr down to lr_end. Pass a smaller lr_end or a larger lr to the optimizer config."
            )
        return super().get_lr(train_step_info)

    def _factor(self, step, warmup_steps, base_lr):
        if step > self.total_steps:
            return self.lr_end / base_lr
        remaining = 1 - (step - warmup_steps) / (self.total_steps - warmup_steps)
        return ((base_lr - self.lr_end) * remaining**self.power + self.lr_end) / base_lr
