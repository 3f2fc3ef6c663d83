"""Optimizer updates applied in place to the trainer's weight tensors (docs/legacy_api.md §4).

The session writes gradients into the trainer's gradient buffers; an update reads them
with the accumulation mean (``grad_scale`` = 1/N) and global-norm clipping folded into
one factor per group, and changes weights with torch's multi-tensor (foreach) ops, or
torch's fused AdamW kernel where its formula is the legacy one.

Weights with the same hyper-parameters (from the config's param groups) form a group
and are updated by one set of multi-tensor calls.
"""

import math

import torch

from .config import AdamConfig


def global_norm(grads) -> torch.Tensor:
    """The L2 norm of all gradients together, as a 0-d tensor."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2)), 2)


def _groups(config, names):
    """[(hyper-parameters, [indices])] for weights sharing hyper-parameters, in first-seen order."""
    groups = {}
    for index, name in enumerate(names):
        hyper = config.hyper_parameters(name)
        groups.setdefault(tuple(sorted(hyper.items())), []).append(index)
    return [(dict(key), indices) for key, indices in groups.items()]


def _pick(items, indices):
    return [items[index] for index in indices]


class _SGD:
    """``w <- w - lr * g``: no momentum, no clipping, no state (legacy SGDOptimizer)."""

    def __init__(self, config, weights: dict, clip: bool):
        self.weights = list(weights.values())

    def step(self, grads, lr: float, grad_scale: float = 1.0, norm_grads=None) -> None:
        torch._foreach_add_(self.weights, grads, alpha=-lr * grad_scale)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class _MomentOptimizer:
    """Shared part of Adam and Lamb: two moments per weight, groups, global-norm clipping."""

    def __init__(self, config, weights: dict, clip: bool):
        self.names = list(weights)
        self.weights = list(weights.values())
        self.groups = _groups(config, self.names)
        self.clip = clip
        self.moment_1 = [torch.zeros_like(weight) for weight in self.weights]
        self.moment_2 = [torch.zeros_like(weight) for weight in self.weights]

    def _group_scales(self, norm_grads, grad_scale):
        """The factor each group's gradients are multiplied by: 1/N, then clipped to max_norm_clip.

        The norm is over ``norm_grads``: all gradients, also where this rank updates a part (ZeRO).
        """
        if not self.clip:
            return [grad_scale] * len(self.groups)
        norm = global_norm(norm_grads).item() * grad_scale
        scales = []
        for hyper, _ in self.groups:
            limit = hyper["max_norm_clip"]
            scales.append(grad_scale * (limit / norm if norm > limit else 1.0))
        return scales

    def _update_moments(self, grads, hyper, indices):
        moment_1, moment_2 = _pick(self.moment_1, indices), _pick(self.moment_2, indices)
        torch._foreach_lerp_(moment_1, grads, 1 - hyper["alpha"])
        torch._foreach_mul_(moment_2, hyper["beta"])
        torch._foreach_addcmul_(moment_2, grads, grads, value=1 - hyper["beta"])
        return moment_1, moment_2

    def _moment_state(self) -> dict:
        """{weight: {Moment_1, Moment_2}}, the live tensors (callers copy what they keep)."""
        return {
            name: {"Moment_1": self.moment_1[index], "Moment_2": self.moment_2[index]}
            for index, name in enumerate(self.names)
        }

    def _load_moments(self, state: dict) -> None:
        for index, name in enumerate(self.names):
            if name in state:
                self.moment_1[index].copy_(torch.as_tensor(state[name]["Moment_1"]))
                self.moment_2[index].copy_(torch.as_tensor(state[name]["Moment_2"]))

    def _bias_corrections(self, hyper, count):
        if not hyper["do_bias_correction"]:
            return 1.0, 1.0
        return 1 - hyper["alpha"] ** count, 1 - hyper["beta"] ** count


class _Adam(_MomentOptimizer):
    """Adam with decoupled weight decay; ``Update_Count`` per weight starts at 1.

    Mode BEFORE_WEIGHT_UPDATE: ``w <- w - lr * ((m/c1) / (sqrt(v/c2) + eps) + lambda * w)``
    (PyTorch AdamW; torch's fused kernel computes exactly this).
    Mode AFTER_WEIGHT_UPDATE: ``w' = w - lr*sqrt(c2)/c1 * m / (sqrt(v) + eps)``; ``w <- w' - lr*lambda*w'``.
    """

    def __init__(self, config, weights: dict, clip: bool):
        super().__init__(config, weights, clip)
        self.update_count = [1] * len(self.weights)

    def step(self, grads, lr: float, grad_scale: float = 1.0, norm_grads=None) -> None:
        scales = self._group_scales(grads if norm_grads is None else norm_grads, grad_scale)
        for (hyper, indices), scale in zip(self.groups, scales):
            for count, same_count in self._by_update_count(indices):
                self._step_group(_pick(grads, same_count), lr, scale, hyper, same_count, count)
                for index in same_count:
                    self.update_count[index] += 1

    def _by_update_count(self, indices):
        """Weights normally share their count; a loaded checkpoint may say otherwise."""
        counts = {}
        for index in indices:
            counts.setdefault(self.update_count[index], []).append(index)
        return counts.items()

    def _uses_fused_kernel(self, hyper):
        return hyper["do_bias_correction"] and hyper["weight_decay_mode"] == AdamConfig.DecayMode.BEFORE_WEIGHT_UPDATE

    def _step_group(self, grads, lr, scale, hyper, indices, count):
        weights = _pick(self.weights, indices)
        if self._uses_fused_kernel(hyper):
            steps = [torch.tensor(float(count), device=weights[0].device)] * len(indices)  # read, not written, by the kernel
            grad_scale = None if scale == 1.0 else torch.tensor(1.0 / scale, device=weights[0].device)
            torch._fused_adamw_(
                weights, grads, _pick(self.moment_1, indices), _pick(self.moment_2, indices), [], steps,
                lr=lr, beta1=hyper["alpha"], beta2=hyper["beta"], weight_decay=hyper["lambda"],
                eps=hyper["epsilon"], amsgrad=False, maximize=False, grad_scale=grad_scale,
            )  # fmt: skip
            return
        if scale != 1.0:
            torch._foreach_mul_(grads, scale)
        moment_1, moment_2 = self._update_moments(grads, hyper, indices)
        correction_1, correction_2 = self._bias_corrections(hyper, count)
        denominator = torch._foreach_sqrt(moment_2)
        decay = 1 - lr * hyper["lambda"]
        if hyper["weight_decay_mode"] == AdamConfig.DecayMode.BEFORE_WEIGHT_UPDATE:
            torch._foreach_div_(denominator, math.sqrt(correction_2))
            torch._foreach_add_(denominator, hyper["epsilon"])
            torch._foreach_mul_(weights, decay)
            torch._foreach_addcdiv_(weights, moment_1, denominator, value=-lr / correction_1)
        else:
            torch._foreach_add_(denominator, hyper["epsilon"])
            torch._foreach_addcdiv_(weights, moment_1, denominator, value=-lr * math.sqrt(correction_2) / correction_1)
            torch._foreach_mul_(weights, decay)

    def state_dict(self) -> dict:
        state = self._moment_state()
        for index, name in enumerate(self.names):
            state[name]["Update_Count"] = torch.tensor([self.update_count[index]], dtype=torch.int64)
        return state

    def load_state_dict(self, state: dict) -> None:
        self._load_moments(state)
        for index, name in enumerate(self.names):
            if name in state:
                self.update_count[index] = int(torch.as_tensor(state[name]["Update_Count"]).reshape(-1)[0])


class _Lamb(_MomentOptimizer):
    """Lamb: Adam's direction scaled per weight by the trust ratio ``||w|| / ||d||``.

    ``d = lambda * w + (m/c1) / (sqrt(v/c2) + eps)``; ratio clamped to
    [ratio_min, ratio_max] (1 when either norm is 0); ``w <- w - lr * ratio * d``.
    One ``Step`` counter is shared by all weights.
    """

    def __init__(self, config, weights: dict, clip: bool):
        super().__init__(config, weights, clip)
        self.step_count = 1

    def step(self, grads, lr: float, grad_scale: float = 1.0, norm_grads=None) -> None:
        scales = self._group_scales(grads if norm_grads is None else norm_grads, grad_scale)
        for (hyper, indices), scale in zip(self.groups, scales):
            self._step_group(_pick(grads, indices), lr, scale, hyper, indices)
        self.step_count += 1

    def _step_group(self, grads, lr, scale, hyper, indices):
        weights = _pick(self.weights, indices)
        if scale != 1.0:
            torch._foreach_mul_(grads, scale)
        moment_1, moment_2 = self._update_moments(grads, hyper, indices)
        correction_1, correction_2 = self._bias_corrections(hyper, self.step_count)
        direction = torch._foreach_div(moment_2, correction_2)
        torch._foreach_sqrt_(direction)
        torch._foreach_add_(direction, hyper["epsilon"])
        torch._foreach_reciprocal_(direction)
        torch._foreach_mul_(direction, moment_1)
        torch._foreach_div_(direction, correction_1)
        if hyper["lambda"] != 0:
            torch._foreach_add_(direction, weights, alpha=hyper["lambda"])
        weight_norms = torch.stack(torch._foreach_norm(weights, 2))
        direction_norms = torch.stack(torch._foreach_norm(direction, 2))
        ratios = (weight_norms / direction_norms).clamp(hyper["ratio_min"], hyper["ratio_max"])
        ratios = torch.where((weight_norms == 0) | (direction_norms == 0), torch.ones_like(ratios), ratios)
        torch._foreach_mul_(direction, [-lr * ratio for ratio in ratios.tolist()])
        torch._foreach_add_(weights, direction)

    def state_dict(self) -> dict:
        state = self._moment_state()
        state["shared_optimizer_state"] = {"Step": torch.tensor([self.step_count], dtype=torch.int64)}
        return state

    def load_state_dict(self, state: dict) -> None:
        self._load_moments(state)
        if "shared_optimizer_state" in state:
            self.step_count = int(torch.as_tensor(state["shared_optimizer_state"]["Step"]).reshape(-1)[0])


_OPTIMIZERS = {"SGDOptimizer": _SGD, "AdamOptimizer": _Adam, "LambOptimizer": _Lamb}


def make_optimizer(config, weights: dict, clip: bool):
    """The update for ``config`` over ``weights`` ({name: tensor}, in gradient order)."""
    return _OPTIMIZERS[config.name](config, weights, clip)
