"""Legacy optimizer rules (docs/legacy_api.md §4) written out per weight in float64, as test references."""

import math

import torch


def legacy_hyper_parameters(config):
    """name -> hyper-parameters: the first param group listing the weight, else the defaults."""

    def lookup(name):
        for group in config.params:
            if name in group["params"]:
                return group
        return config.defaults

    return lookup


class ReferenceOptimizer:
    """kind: 'sgd' | 'adam' | 'lamb'; ``hyper(name)`` gives a weight's hyper-parameters."""

    def __init__(self, kind, weights, hyper, clip):
        self.kind = kind
        self.weights = {name: tensor.detach().double().clone() for name, tensor in weights.items()}
        self.hyper = hyper
        self.clip = clip
        self.m = {name: torch.zeros_like(tensor) for name, tensor in self.weights.items()}
        self.v = {name: torch.zeros_like(tensor) for name, tensor in self.weights.items()}
        self.count = {name: 1 for name in self.weights}
        self.lamb_step = 1
        self.clipped_steps = 0

    def step(self, grads, lr, grad_scale=1.0):
        grads = {name: grads[name].double() * grad_scale for name in self.weights}
        if self.kind == "sgd":
            for name, w in self.weights.items():
                w -= lr * grads[name]
            return
        if self.clip:
            norm = math.sqrt(sum((g * g).sum().item() for g in grads.values()))
            for name in grads:
                limit = self.hyper(name)["max_norm_clip"]
                if norm > limit:
                    grads[name] = grads[name] * limit / norm
            self.clipped_steps += any(norm > self.hyper(name)["max_norm_clip"] for name in grads)
        for name, w in self.weights.items():
            h, g = self.hyper(name), grads[name]
            t = self.count[name] if self.kind == "adam" else self.lamb_step
            c1, c2 = (1 - h["alpha"] ** t, 1 - h["beta"] ** t) if h["do_bias_correction"] else (1.0, 1.0)
            self.m[name] = h["alpha"] * self.m[name] + (1 - h["alpha"]) * g
            self.v[name] = h["beta"] * self.v[name] + (1 - h["beta"]) * g * g
            m, v = self.m[name], self.v[name]
            if self.kind == "adam":
                if int(h["weight_decay_mode"]) == 0:
                    w -= lr * ((m / c1) / ((v / c2).sqrt() + h["epsilon"]) + h["lambda"] * w)
                else:
                    s = lr * math.sqrt(c2) / c1
                    w -= s * m / (v.sqrt() + h["epsilon"])
                    w -= lr * h["lambda"] * w
                self.count[name] += 1
            else:
                d = h["lambda"] * w + (m / c1) / ((v / c2).sqrt() + h["epsilon"])
                w_norm, d_norm = w.norm().item(), d.norm().item()
                ratio = 1.0 if w_norm == 0 or d_norm == 0 else min(max(w_norm / d_norm, h["ratio_min"]), h["ratio_max"])
                w -= lr * ratio * d
        if self.kind == "lamb":
            self.lamb_step += 1
