"""Every loss of torch.nn.functional through ORTTrainer: trained like a plain torch loop (the loss and every weight,
step by step, as close to a float64 loop as float32 torch is), or refused naming the op.

Losses another test already trains through ORTTrainer are listed with that test (``TRAINED_ELSEWHERE``) rather than
trained again; those orttrainer refuses are in ``REFUSED``. docs/losses.md says the same in words.
"""

import functools
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from parity import cpu_options, run_parity

from orttrainer import ExportError, ORTTrainer, optim

ROOT = Path(__file__).parent.parent
CLASSES, BATCH, LR = 6, 4, 0.3

# every loss function of torch.nn.functional (test_every_loss_is_listed checks that none is missing)
LOSSES = ("l1_loss", "mse_loss", "cross_entropy", "nll_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
          "kl_div", "huber_loss", "smooth_l1_loss", "soft_margin_loss", "multilabel_soft_margin_loss",
          "multilabel_margin_loss", "multi_margin_loss", "hinge_embedding_loss", "cosine_embedding_loss",
          "margin_ranking_loss", "triplet_margin_loss", "triplet_margin_with_distance_loss", "poisson_nll_loss",
          "gaussian_nll_loss", "ctc_loss")  # fmt: skip

_EXPORTED_LOSSES = "tests/test_rewrites.py::test_loss_exported_by_orttrainer_matches_torch"
TRAINED_ELSEWHERE = {
    "l1_loss": _EXPORTED_LOSSES, "smooth_l1_loss": _EXPORTED_LOSSES, "huber_loss": _EXPORTED_LOSSES,
    "binary_cross_entropy": _EXPORTED_LOSSES, "soft_margin_loss": _EXPORTED_LOSSES, "hinge_embedding_loss": _EXPORTED_LOSSES,
    "poisson_nll_loss": _EXPORTED_LOSSES, "cross_entropy": _EXPORTED_LOSSES,
    "mse_loss": "tests/test_parity_sgd.py::test_inputs_are_routed_to_forward_by_name",
    "binary_cross_entropy_with_logits": "tests/test_same_as_torch.py::test_confident_logits_train_as_torch_with_bce_with_logits",
    "ctc_loss": "tests/test_ctc.py::test_ctc_model_trains_like_torch",
}  # fmt: skip


def _real(generator):
    return torch.randn(BATCH, CLASSES, generator=generator)


def _signs(generator):
    return torch.randint(0, 2, (BATCH, CLASSES), generator=generator).float() * 2 - 1


def _classes(generator):
    return torch.randint(0, CLASSES, (BATCH,), generator=generator)


def _bits(generator):
    return torch.randint(0, 2, (BATCH, CLASSES), generator=generator).float()


def _distribution(generator):
    return torch.softmax(torch.randn(BATCH, CLASSES, generator=generator), 1)


def _counts(generator):
    return torch.randint(0, 5, (BATCH, CLASSES), generator=generator).float()


def _class_weights(like):
    return torch.linspace(0.5, 2.0, CLASSES, dtype=like.dtype)


def _cosine_distance(a, b):
    return 1.0 - F.cosine_similarity(a, b)


# name: (loss_fn(output [batch, classes], target), target maker); the name starts with the loss function's
CASES = {
    "nll_loss (class weights, ignore_index)": (
        lambda out, y: F.nll_loss(F.log_softmax(out, 1), y, weight=_class_weights(out), ignore_index=2), _classes),
    "nll_loss (over a further dimension, sum)": (
        lambda out, y: F.nll_loss(F.log_softmax(out.view(BATCH, 2, 3), 1), y.view(BATCH, 3) % 2, reduction="sum"),
        lambda generator: torch.randint(0, 2, (BATCH, 3), generator=generator)),
    "kl_div (batchmean)": (lambda out, t: F.kl_div(F.log_softmax(out, 1), t, reduction="batchmean"), _distribution),
    "kl_div (log_target, sum)": (lambda out, t: F.kl_div(F.log_softmax(out, 1), t.log(), reduction="sum", log_target=True),
                                 _distribution),
    "kl_div (none)": (lambda out, t: F.kl_div(F.log_softmax(out, 1), t, reduction="none")[:, 1:].sum(), _distribution),
    "multilabel_soft_margin_loss (class weights)": (
        lambda out, t: F.multilabel_soft_margin_loss(out, t, weight=_class_weights(out)), _bits),
    "cosine_embedding_loss": (lambda out, t: F.cosine_embedding_loss(out[:, :3], out[:, 3:], t[:, 0], margin=0.1), _signs),
    "margin_ranking_loss": (lambda out, t: F.margin_ranking_loss(out[:, 0], out[:, 1], t[:, 0], margin=0.2), _signs),
    "triplet_margin_loss": (lambda out, t: F.triplet_margin_loss(out, t, t.flip(0), margin=2.0), _real),
    "triplet_margin_loss (p 1, swap)": (lambda out, t: F.triplet_margin_loss(out, t, t.flip(0), margin=2.0, p=1, swap=True),
                                        _real),
    "triplet_margin_with_distance_loss": (lambda out, t: F.triplet_margin_with_distance_loss(out, t, t.flip(0), margin=2.0),
                                          _real),
    "triplet_margin_with_distance_loss (cosine distance, swap)": (
        lambda out, t: F.triplet_margin_with_distance_loss(out, t, t.flip(0), distance_function=_cosine_distance, swap=True),
        _real),
    "poisson_nll_loss (full)": (lambda out, t: F.poisson_nll_loss(out, t, full=True), _counts),
    "poisson_nll_loss (full, log_input False, sum)": (
        lambda out, t: F.poisson_nll_loss(F.softplus(out) + 0.1, t, log_input=False, full=True, reduction="sum"), _counts),
}  # fmt: skip


def _mlp():
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, CLASSES))


def _batches(make_target, count=3):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 5, generator=generator), make_target(generator)) for _ in range(count)]


@pytest.mark.parametrize("case", CASES)
def test_loss_trains_like_torch(case):
    loss_fn, make_target = CASES[case]
    torch.manual_seed(0)
    run_parity(_mlp(), _batches(make_target), optim.SGDConfig(lr=LR), functools.partial(torch.optim.SGD, lr=LR),
               loss_fn=loss_fn, float64=True)  # fmt: skip


# name: (loss_fn, target maker, the op the refusal names)
REFUSED = {
    "multi_margin_loss": (F.multi_margin_loss, _classes, "aten::multi_margin_loss"),
    "multilabel_margin_loss": (F.multilabel_margin_loss, lambda generator: _classes(generator)[:, None].expand(-1, CLASSES),
                               "aten::multilabel_margin_loss"),
}  # fmt: skip


@pytest.mark.parametrize("name", REFUSED)
def test_loss_the_exporter_cannot_translate_is_refused_naming_the_op(name):
    loss_fn, make_target, op = REFUSED[name]
    model = _mlp()
    before = {key: tensor.clone() for key, tensor in model.state_dict().items()}
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=LR), loss_fn=loss_fn, options=cpu_options())
    with pytest.raises(ExportError, match=rf"torch.onnx.export of Sequential failed: Exporting the operator '{op}' to "
                                          "ONNX opset version 17 is not supported"):  # fmt: skip
        trainer.train_step(*_batches(make_target, 1)[0])
    assert all(torch.equal(tensor, before[key]) for key, tensor in model.state_dict().items()), "the user's module changed"


@pytest.mark.parametrize("variance_floor", [0.1, 0.0], ids=["variances-above-eps", "variances-below-eps"])
def test_gaussian_nll_loss_is_refused_for_its_clamp_under_no_grad(variance_floor):
    """F.gaussian_nll_loss clamps its variances in place under torch.no_grad(): torch's gradient passes the clamp by,
    a graph's would go through it (0 where it clamps). Refused before anything changes, whatever the batch (a clamp
    that changes nothing on the first batch may on a later one), naming the loss and the user's line."""
    model = _mlp()
    before = {key: tensor.clone() for key, tensor in model.state_dict().items()}
    loss_fn = lambda out, t: F.gaussian_nll_loss(out[:, :3], t[:, :3], F.softplus(out[:, 3:]) + variance_floor)  # noqa: E731
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=LR), loss_fn=loss_fn, options=cpu_options())
    with pytest.raises(ExportError, match=r"F.gaussian_nll_loss's clamp of its variances writes in place under "
                                          r"torch.no_grad\(\) into a tensor that requires grad, at .*test_losses.py"):
        trainer.train_step(*_batches(_real, 1)[0])
    assert all(torch.equal(tensor, before[key]) for key, tensor in model.state_dict().items())


class _ClampedUnderNoGrad(nn.Module):
    """A forward that clamps an activation in place under no_grad, as F.gaussian_nll_loss clamps its variances."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(5, CLASSES)

    def forward(self, x):
        h = self.linear(x).clone()
        with torch.no_grad():
            h.clamp_(min=0.0)
        return h


def test_an_in_place_write_under_no_grad_into_a_tensor_needing_grad_is_refused_naming_the_line():
    trainer = ORTTrainer(_ClampedUnderNoGrad(), None, optim.SGDConfig(lr=LR), loss_fn=F.mse_loss, options=cpu_options())
    with pytest.raises(ExportError, match=r"Tensor.clamp_ writes in place under torch.no_grad\(\) .* at "
                                          r".*test_losses.py:\d+: h.clamp_\(min=0.0\)"):
        trainer.train_step(*_batches(_real, 1)[0])


def test_every_loss_is_listed():
    """Every loss function torch.nn.functional has is in LOSSES; each is trained here (a case named after it), trained
    by the test TRAINED_ELSEWHERE names (which exists), or REFUSED; docs/losses.md names each."""
    assert {name for name in dir(F) if "loss" in name} <= set(LOSSES), "a loss function torch added"
    trained_here = {case.split(" ")[0] for case in CASES}
    refused = set(REFUSED) | {"gaussian_nll_loss"}  # test_gaussian_nll_loss_is_refused_for_its_clamp_under_no_grad
    assert trained_here <= set(LOSSES) and refused <= set(LOSSES)
    missing = set(LOSSES) - trained_here - set(TRAINED_ELSEWHERE) - refused
    assert not missing, f"losses neither trained nor refused by a test: {sorted(missing)}"
    for test in set(TRAINED_ELSEWHERE.values()):
        path, name = test.split("::")
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.MULTILINE), f"{test} is gone"
    listed = (ROOT / "docs" / "losses.md").read_text()
    assert not [name for name in LOSSES if f"`{name}`" not in listed], "docs/losses.md leaves some out"
