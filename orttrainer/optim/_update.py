"""Optimizer updates applied in place to the trainer's weight tensors.

The session writes gradients into the trainer's ``.grad`` buffers; an update reads them
once, with the accumulation mean (``grad_scale`` = 1/N) and global-norm clipping folded
into a single scale factor, and updates weights with torch's multi-tensor (foreach) ops.
"""

import torch


def clip_coefficient(grads, max_norm: float, grad_scale: float) -> float:
    """The factor that brings the global L2 norm of ``grad_scale * grads`` down to ``max_norm``."""
    norms = torch._foreach_norm(grads, 2)
    total = torch.linalg.vector_norm(torch.stack(norms), 2).item() * grad_scale
    return max_norm / total if total > max_norm else 1.0


class _SGD:
    """``w <- w - lr * g``: no momentum, no state (legacy SGDOptimizer)."""

    def __init__(self, config, weights: dict, clip: bool):
        self.names = list(weights)
        self.weights = list(weights.values())

    def step(self, grads, lr: float, grad_scale: float = 1.0) -> None:
        torch._foreach_add_(self.weights, grads, alpha=-lr * grad_scale)

    def state_dict(self) -> dict:
        return {}


def make_optimizer(config, weights: dict, clip: bool):
    """The update for ``config`` over ``weights`` ({name: tensor}, in gradient order)."""
    optimizers = {"SGDOptimizer": _SGD}
    return optimizers[config.name](config, weights, clip)
