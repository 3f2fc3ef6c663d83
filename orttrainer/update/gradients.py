"""The trainer's gradient buffers: where each run writes gradients, and their sum over a window.

Gradients live in one flat tensor per dtype (``flat``), seen per weight as views (``sums``),
so that ranks all-reduce them in one call per dtype. The first run of an accumulation window
writes straight into the sums; the other runs of the window write into a scratch set that is
then added. Embedding lookups get their weight gradients from torch (outputs_for_trainer.EmbeddingGradient):
the run returns the looked-up rows' gradients and their indices, which are scatter-added into
the buffers the run wrote. A trainer with several graphs (one per batch shape signature,
graph_cache.py) has one Gradients: ``attach`` points it at the training session of the graph
that runs next, so that every graph writes into the same buffers.
"""

import math

import torch


class Gradients:
    """Gradient buffers of the trainable weights, bound as outputs of a Runtime's training session."""

    def __init__(self, runtime):
        self.flat, self.sums = _flat_buffers({name: runtime.weights[name] for name in runtime.trainable})
        self.all = list(self.sums.values())  # views into the flat buffers: fixed for the trainer's life
        self.owned = [self.sums[name] for name in runtime.owned]  # what this rank's optimizer updates
        self._scratch = self._scratch_list = None  # made at the first run inside a window
        self.attach(runtime)

    def attach(self, runtime) -> None:
        """Have the runs of ``runtime`` (a graph over the same trainable weights) write into these buffers."""
        self._session = runtime.train_session
        self._outputs = runtime.gradient_outputs  # weight name -> gradient output of the graph
        self._embeddings = runtime.embeddings
        self.bound = None  # the buffers the session writes into
        self.bind(self.sums)

    def bind(self, buffers: dict) -> None:
        """Have the next runs write gradients into ``buffers`` ({weight name: tensor})."""
        if buffers is self.bound:
            return
        for name, tensor in buffers.items():
            if name in self._outputs:  # embeddings only looked up get theirs from add_embedding_gradients
                self._session.bind_output(self._outputs[name], tensor)
        self.bound = buffers

    def buffers_for(self, starts_window: bool) -> dict:
        """Where a run writes gradients: the sums at a window's start, a scratch set inside it."""
        if starts_window:
            return self.sums
        if self._scratch is None:
            self._scratch = {name: torch.empty_like(grad) for name, grad in self.sums.items()}
            self._scratch_list = list(self._scratch.values())
        return self._scratch

    def add_scratch(self) -> None:
        """Add what a run inside a window wrote to the sums."""
        torch._foreach_add_(self.all, self._scratch_list)

    def add_embedding_gradients(self, embedding_outputs) -> None:
        """Scatter-add each lookup's row gradients into its weight's gradient, as torch's embedding backward does."""
        cleared = set()
        for embedding, rows, indices in zip(self._embeddings, embedding_outputs[::2], embedding_outputs[1::2]):
            target = self.bound[embedding.weight]
            if embedding.weight not in self._outputs and embedding.weight not in cleared:
                target.zero_()
                cleared.add(embedding.weight)
            indices = indices.reshape(-1)
            rows = rows.reshape(indices.numel(), *target.shape[1:]).to(target.dtype)
            per_row = (-1,) + (1,) * (rows.dim() - 1)
            if embedding.scale_grad_by_freq:  # torch: each row's gradient divided by its count in this lookup
                rows = rows / torch.bincount(indices, minlength=target.shape[0])[indices].view(per_row).to(rows.dtype)
            if embedding.padding_idx >= 0:  # torch: the padding row gets nothing from this lookup
                rows = rows.masked_fill((indices == embedding.padding_idx).view(per_row), 0.0)
            target.index_add_(0, indices, rows)

    def reduce_over_ranks(self, data_parallel) -> None:
        """Sum the gradients of all ranks (one all-reduce per flat buffer)."""
        data_parallel.reduce_gradients(self.flat)

    def unscale(self, loss_scale: torch.Tensor) -> bool:
        """Divide every gradient by the loss scale; return whether all are finite."""
        found_non_finite = torch.zeros(1, device=loss_scale.device)
        torch._amp_foreach_non_finite_check_and_unscale_(self.all, found_non_finite, torch.reciprocal(loss_scale.reshape(1)))
        return not bool(found_non_finite.item())

    def accumulation_state(self, inside_window: bool) -> dict:
        """Checkpoint key ``gradient_accumulation``: the gradients summed so far, when inside a window."""
        if not inside_window:
            return {}
        return {"gradient_accumulation": {name: grad.detach().cpu().numpy().copy() for name, grad in self.sums.items()}}


def _flat_buffers(like: dict):
    """Zeroed buffers shaped like ``like``'s tensors, as views of one flat tensor per dtype
    (so that gradients can be all-reduced in one call); returns (flats, {name: view})."""
    by_dtype = {}
    for name, tensor in like.items():
        by_dtype.setdefault(tensor.dtype, []).append(name)
    flats, views = [], {}
    for dtype, names in by_dtype.items():
        flat = torch.zeros(sum(like[name].numel() for name in names), dtype=dtype, device=next(iter(like.values())).device)
        offset = 0
        for name in names:
            size = like[name].numel()
            views[name] = flat[offset : offset + size].view(like[name].shape)
            offset += size
        flats.append(flat)
    return flats, {name: views[name] for name in like}


def window_size(steps: int, before, step: int) -> int:
    """``batch.gradient_accumulation_steps`` (``steps``; ``before`` at the last step), which may change only where a
    window of the old size ends and one of the new size starts (windows are the steps' multiples of it): elsewhere
    the partial sum of the open window would be divided by the new count, or the gradients of the last update
    counted again."""
    if before is not None and steps != before and (step % before or step % steps):
        both = math.lcm(before, steps)
        raise ValueError(
            f"options batch.gradient_accumulation_steps changed from {before} to {steps} at train_step {step + 1}: "
            "windows are the steps' multiples of it, so it may change only after a step that is a multiple of both "
            f"(the next: step {-(-step // both) * both}); change it there, or create a new trainer"
        )
    return steps

