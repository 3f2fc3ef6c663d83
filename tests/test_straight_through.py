"""Straight-through estimators: a detach whose input and output both reach the loss, through a weight used elsewhere
too, trains as torch trains it. A VQ-VAE's codebook is read by the distances whose argmin picks its rows q, by the
lookup of q, and by its loss: the codebook term on q, the commitment term on q.detach().

orttrainer computes an embedding's gradient from the gradient of the rows it looked up
(outputs_for_trainer.split_embedding_lookups), so those rows are a gradient source of their own: a detach of a value
computed from them is cut as one computed from a weight is (training_graph.stop_gradients), or the commitment term's
gradient reaches the codebook through q.detach() (1 + beta times torch's gradient).
"""

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import zoo
from parity import assert_within_float32_error, float64_batch, run_parity

from orttrainer import optim

LR = 0.1
CODES, WIDTH = 16, 8


def _sgd_parity(model, batches, loss_fn):
    """run_parity with SGD and the first-step check on (the default), against float64 torch; then eval_step on the
    first batch equals the trained torch module in eval mode."""
    trainer, reference, reference64 = run_parity(model, batches, optim.SGDConfig(lr=LR),
                                                 functools.partial(torch.optim.SGD, lr=LR), loss_fn=loss_fn,
                                                 float64=True)  # fmt: skip
    *inputs, target = batches[0]
    reference.eval()
    reference64.eval()
    with torch.no_grad():
        expected, expected64 = reference(*inputs), reference64(*float64_batch(inputs))
    loss, *outputs = trainer.eval_step(*batches[0])
    assert_within_float32_error(loss, loss_fn(expected, target), loss_fn(expected64, target.double()), "eval_step loss")
    for index, (output, wanted, wanted64) in enumerate(zip(outputs, expected, expected64)):
        assert_within_float32_error(output, wanted, wanted64, f"eval_step output {index}")


# ------------------------------------------------------------------ VQ-VAE (tests/zoo.py)
def _image_batches(count=4, seed=1):
    """(images, the same images as the target), 3 images of 3x8x8 each."""
    generator = torch.Generator().manual_seed(seed)
    return [zoo.autoencoder_batch(3, generator=generator) for _ in range(count)]


# the fast tier: the nn.Embedding called, distances expanded; the general case below covers every lookup quickly
_VQ_VAES = [pytest.param(lookup, distance, marks=[] if (lookup, distance) == ("module", "expanded") else pytest.mark.slow)
            for lookup in ("module", "functional", "indexing") for distance in ("expanded", "cdist")]  # fmt: skip


@pytest.mark.parametrize("lookup, distance", _VQ_VAES)
def test_vq_vae_trains_as_torch(lookup, distance):
    torch.manual_seed(0)
    _sgd_parity(zoo.VQVAE(lookup, distance), _image_batches(), zoo.reconstruction_plus_own_loss)


# ------------------------------------------------------------------ the general case
class _DetachedAndDirect(nn.Module):
    """y read from a weight (``read``: a product ``w * x``, an nn.Embedding called, ``F.embedding``, the weight
    indexed) and h from an encoder of x; ``construction(y, h, x)`` gives (output, the loss it adds), using y both
    through a detach and directly."""

    def __init__(self, read, construction):
        super().__init__()
        self.encoder = nn.Linear(WIDTH, WIDTH)
        self.weight = nn.Parameter(torch.randn(WIDTH)) if read == "product" else nn.Embedding(CODES, WIDTH)
        self.read, self.construction = read, construction

    def _y(self, x, indices):
        if self.read == "product":
            return self.weight * x
        if self.read == "module":
            return self.weight(indices)
        if self.read == "functional":
            return F.embedding(indices, self.weight.weight)
        return self.weight.weight[indices]

    def forward(self, x, indices):
        return self.construction(self._y(x, indices), self.encoder(x), x)


_CONSTRUCTIONS = {
    # the detached copy reaches the loss with no gradient, the direct use with its own
    "detached-copy-and-direct": lambda y, h, x: (h, ((y.detach() - h) ** 2).mean() + (y * 2).mean()),
    # x + (f(x) - x).detach() of an input and of a computed value, f(x) reaching the loss directly too
    "straight-through-of-the-input": lambda y, h, x: (x + (y - x).detach(), (y * 2).mean()),
    "straight-through-of-a-computed-value": lambda y, h, x: (h + (y - h).detach(), (y * h.detach()).mean()),
    "codebook-and-commitment": lambda y, h, x: (h + (y - h).detach(),
                                                F.mse_loss(y, h.detach()) + 0.25 * F.mse_loss(h, y.detach())),
    "times-itself-detached": lambda y, h, x: (h * y.detach(), (y * y.detach()).mean()),
}


def _row_batches(count=3, seed=1):
    """(x, indices into the codebook, target)."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, WIDTH, generator=generator), torch.randint(0, CODES, (6,), generator=generator),
             torch.randn(6, WIDTH, generator=generator)) for _ in range(count)]  # fmt: skip


@pytest.mark.parametrize("construction", _CONSTRUCTIONS)
@pytest.mark.parametrize("read", ["product", "module", "functional", "indexing"])
def test_a_weight_used_through_a_detach_and_directly_trains_as_torch(read, construction):
    torch.manual_seed(0)
    _sgd_parity(_DetachedAndDirect(read, _CONSTRUCTIONS[construction]), _row_batches(),
                zoo.reconstruction_plus_own_loss)
