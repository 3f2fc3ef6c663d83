"""Optimizer configurations and learning-rate schedulers."""

from .config import AdamConfig, LambConfig, SGDConfig, _OptimizerConfig
from .lr_scheduler import (
    ConstantWarmupLRScheduler,
    CosineWarmupLRScheduler,
    LinearWarmupLRScheduler,
    PolyWarmupLRScheduler,
    _LRScheduler,
)

__all__ = [
    "AdamConfig",
    "LambConfig",
    "SGDConfig",
    "_OptimizerConfig",
    "ConstantWarmupLRScheduler",
    "CosineWarmupLRScheduler",
    "LinearWarmupLRScheduler",
    "PolyWarmupLRScheduler",
    "_LRScheduler",
]
