"""The built-in check's comparison: rounding at a kink is excused, a wrong gradient is not."""

import copy
import functools
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import CNN, MLP, Encoder, cnn_batch, lm_loss, mlp_batch, token_batch

from orttrainer import ORTTrainer, ORTTrainerOptions, TorchMismatchError, optim
from orttrainer.export import verify


class LinearReLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 1, bias=False)

    def forward(self, x):
        return torch.relu(self.fc(x))


def summed(output, label):
    return (output * label).sum()


def torch_side(x):
    """(run_torch, weights) of LinearReLU with weights [1, 1] on the one-row batch ``x``."""
    module = LinearReLU()
    weights = {"fc.weight": torch.ones(1, 2)}
    run_torch = functools.partial(verify.torch_step, module, summed, ["x"], [x, torch.ones(1, 1)],
                                  output_names=["loss", "output"], loss_name="loss", trained=["fc.weight"])
    return run_torch, weights


def result(loss, output, gradient):
    return verify.StepResult({"loss": loss, "output": output}, {"fc.weight": gradient})


def test_a_relu_flipped_by_rounding_at_its_kink_is_excused():
    """The pre-activation is 1.2e-7, within float32 rounding of 0: ONNX Runtime may round it below."""
    x = torch.tensor([[1.0, -1.0 + 1.2e-7]])
    run_torch, weights = torch_side(x)
    reference = run_torch(weights)
    assert reference.gradients["fc.weight"].abs().sum() > 1  # torch kept the ReLU open
    flipped = result(torch.tensor(0.0), torch.zeros(1, 1), torch.zeros(1, 2))
    assert verify.compare(flipped, reference, torch.float32, {}), "the plain comparison sees the flip"
    verify.check(flipped, run_torch, weights, torch.float32, {}, "error")  # rounding explains it: no error


@pytest.mark.parametrize("scale", [1.01, 0.0])
def test_a_wrong_gradient_away_from_any_kink_is_not_excused(scale):
    x = torch.tensor([[1.0, 0.5]])
    run_torch, weights = torch_side(x)
    reference = run_torch(weights)
    wrong = result(reference.outputs["loss"], reference.outputs["output"], reference.gradients["fc.weight"] * scale)
    with pytest.raises(TorchMismatchError, match=r"gradient of 'fc.weight': largest absolute difference"):
        verify.check(wrong, run_torch, weights, torch.float32, {}, "error")


def test_the_rounding_excuse_takes_only_the_tensors_that_differ():
    """The nudged steps keep only the tensors the first comparison found different (here a gradient), and the
    excuse is measured for those alone."""
    x = torch.tensor([[1.0, -1.0 + 1.2e-7]])
    run_torch, weights = torch_side(x)
    reference = run_torch(weights)
    differing = verify.StepResult({}, {"fc.weight": reference.gradients["fc.weight"]})
    assert list(verify.rounding_spread(run_torch, weights, differing, torch.float32)) == [("gradient of", "fc.weight")]


class Watched(nn.Module):
    """A linear layer that keeps a weak reference to its last output."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.output = None

    def forward(self, x):
        output = self.fc(x)
        self.output = weakref.ref(output)
        return output


def test_torchs_step_holds_none_of_its_outputs_through_its_backward():
    """The check compares torch's outputs after forward and keeps none that agree: backward runs without them (a
    language model's logits are as large as the rest of its step's memory)."""
    torch.manual_seed(0)
    module = Watched()
    weights = {name: tensor.detach() for name, tensor in module.state_dict().items()}
    batch = [torch.randn(6, 4), torch.randint(0, 3, (6,))]
    run_torch = functools.partial(verify.torch_step, module, F.cross_entropy, ["x"], batch, output_names=["loss", "output"],
                                  loss_name="loss", trained=list(weights))  # fmt: skip
    alive_in_backward = []

    class Watching(verify.Comparison):
        def gradient(self, name, gradient):
            alive_in_backward.append(module.output() is not None)
            super().gradient(name, gradient)

    comparison = Watching(run_torch(weights), torch.float32, {})
    run_torch(weights, sink=comparison)
    assert alive_in_backward == [False, False]
    assert comparison.differences() == [] and comparison.kept == verify.StepResult({}, {}, {})


@pytest.mark.parametrize("order", [["noise", "large", "wrong"], ["large", "wrong", "noise"]])
def test_a_gradient_compared_before_the_largest_is_judged_at_the_final_floor(order):
    """The floor of the gradients' tolerance is a share of the largest of them, known only once every gradient is
    in: one compared before (here rounding noise on a gradient zero in exact arithmetic) is kept until then and
    passes, in any order; one that differs is kept, for the rounding excuse."""
    ours = {"noise": torch.full((3,), 1e-4), "large": torch.full((3,), 100.0), "wrong": torch.ones(3)}
    torchs = {"noise": torch.zeros(3), "large": torch.full((3,), 100.0), "wrong": torch.full((3,), 2.0)}
    comparison = verify.Comparison(verify.StepResult({}, ours), torch.float32, {})
    comparison.forward_done({}, {})
    for name in order:
        comparison.gradient(name, torchs[name])
    assert [difference.name for difference in comparison.differences()] == ["wrong"]
    assert list(comparison.kept.gradients) == ["wrong"]
    assert verify.compare(verify.StepResult({}, ours), verify.StepResult({}, torchs), torch.float32, {})[0].name == "wrong"


def test_the_norm_of_a_difference_is_taken_a_chunk_at_a_time():
    """Several chunks, a float64 tensor (whose chunks are views of it) left as it was, shapes that differ."""
    generator = torch.Generator().manual_seed(0)
    mine = torch.randn(3 * verify._CHUNK + 5, dtype=torch.float64, generator=generator)
    theirs = mine + 1e-3 * torch.randn(mine.shape, dtype=torch.float64, generator=generator)
    before = mine.clone()
    assert verify._norm_of_difference(mine, theirs) == pytest.approx((mine - theirs).norm().item(), rel=1e-12)
    assert torch.equal(mine, before)
    assert verify._norm_of_difference(torch.zeros(2, 3), torch.zeros(3, 2)) == float("inf")


def gradient_one_percent_off(build):
    """ReluGrad as 1.01 * dy * (x > 0): a small, systematic error."""
    dy, x = build.node.input[:2]
    positive = build.op("Greater", [x, build.op("CastLike", [build.const(0.0), x])])
    scaled = build.op("Mul", [dy, build.op("CastLike", [build.const(1.01), dy])])
    build.op("Mul", [scaled, build.op("CastLike", [positive, dy])], build.node.output[0])


@pytest.mark.parametrize("evaluated_first", [None, 8, 5], ids=["train-first", "eval-same-shape-first", "eval-other-rows-first"])
def test_the_trainer_check_catches_a_gradient_one_percent_off(monkeypatch, evaluated_first):
    """Also when an eval_step on another batch built the graph: the check compared the training batch with torch's
    step on the eval batch, taken at the build, and its rounding excuse then excused the fault (same shape), or
    failed comparing tensors of different sizes (other rows)."""
    from orttrainer.graph import cpu_kernels

    monkeypatch.setitem(cpu_kernels.FAST_CPU_KERNELS, "ReluGrad", gradient_one_percent_off)
    torch.manual_seed(0)
    trainer = ORTTrainer(MLP(), None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy,
                         options=ORTTrainerOptions({"device": {"id": "cpu"}}))
    generator = torch.Generator().manual_seed(1)
    if evaluated_first:
        trainer.eval_step(*mlp_batch(batch=evaluated_first, generator=generator))
    with pytest.raises(TorchMismatchError, match=r"gradient of 'fc1.weight'"):
        trainer.train_step(*mlp_batch(generator=generator))


def test_the_trainer_check_catches_a_gradient_one_percent_off_after_the_weights_were_written(monkeypatch):
    """torch's step taken at the build (here by an eval_step) is on the weights of then: every run on written weights
    differs from it, and the rounding excuse measured against it would excuse anything. The check takes torch's step
    again on the weights as they are, also after a write no version counter sees (through ``.data``)."""
    from orttrainer.graph import cpu_kernels

    monkeypatch.setitem(cpu_kernels.FAST_CPU_KERNELS, "ReluGrad", gradient_one_percent_off)
    torch.manual_seed(0)
    model = MLP()
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy,
                         options=ORTTrainerOptions({"device": {"id": "cpu"}}))  # fmt: skip
    batch = mlp_batch(generator=torch.Generator().manual_seed(1))
    trainer.eval_step(*batch)
    for parameter in model.parameters():
        parameter.data.mul_(1.5)
    with pytest.raises(TorchMismatchError, match=r"gradient of 'fc1.weight'"):
        trainer.train_step(*batch)


def test_check_compares_with_the_weights_loaded_before_the_first_step():
    """Weights loaded after the build (before the first step) are the ones both sides must use: torch's step is
    taken once, at the check, on them, and the check passes."""
    torch.manual_seed(0)
    trainer = ORTTrainer(MLP(), None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy,
                         options=ORTTrainerOptions({"device": {"id": "cpu"}}))  # fmt: skip
    donor = ORTTrainer(MLP(), None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy,
                       options=ORTTrainerOptions({"device": {"id": "cpu"}}))  # fmt: skip
    donor.train_step(*mlp_batch())
    trainer.load_state_dict(donor.state_dict())
    runs = []
    original = verify.torch_step

    def counted(*args, **kwargs):
        runs.append(1)
        return original(*args, **kwargs)

    verify.torch_step = counted
    try:
        trainer.train_step(*mlp_batch())  # the check passes: no TorchMismatchError
    finally:
        verify.torch_step = original
    assert len(runs) == 1


# ------------------------------------------------------------------ the reduced (projected) check
def _projected_check(monkeypatch, caplog):
    """Every model counts as large: torch's gradients kept as verify.Projected."""
    from orttrainer import progress

    monkeypatch.setattr(verify, "FULL_CHECK_BYTES", 0)
    monkeypatch.setattr(progress, "_SAID", set())
    monkeypatch.setattr(progress.logger, "handlers", [caplog.handler])


@pytest.mark.parametrize("make, loss_fn, make_batch", [(CNN, F.cross_entropy, cnn_batch), (lambda: Encoder(dropout=0.1), lm_loss,
                                                                                           token_batch)],
                         ids=["cnn-batch-norm", "transformer-dropout"])  # fmt: skip
def test_the_projected_check_passes_real_models_and_says_so_once(monkeypatch, caplog, make, loss_fn, make_batch):
    _projected_check(monkeypatch, caplog)
    torch.manual_seed(0)
    for _ in range(2):  # a second trainer: said once per process
        trainer = ORTTrainer(make(), None, optim.SGDConfig(lr=0.1), loss_fn=loss_fn, options=ORTTrainerOptions({"device": {"id": "cpu"}}))
        trainer.train_step(*make_batch())
    said = [record.getMessage() for record in caplog.records if "random projections" in record.getMessage()]
    assert said == ["the first-step check compares each gradient by 8 random projections (weights over 0 MiB: a second "
                    "full set of gradients would not fit in the memory torch's loop takes); outputs and buffers element "
                    "by element"]


def test_the_projected_check_catches_a_gradient_one_percent_off(monkeypatch, caplog):
    from orttrainer.graph import cpu_kernels

    _projected_check(monkeypatch, caplog)
    monkeypatch.setitem(cpu_kernels.FAST_CPU_KERNELS, "ReluGrad", gradient_one_percent_off)
    torch.manual_seed(0)
    trainer = ORTTrainer(MLP(), None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy,
                         options=ORTTrainerOptions({"device": {"id": "cpu"}}))  # fmt: skip
    with pytest.raises(TorchMismatchError, match=r"gradient of 'fc1.weight' \(.*\): L2 distance about .* \(by 8 random "
                                                 r"projections\), 0.0\d+ of its norm"):
        trainer.train_step(*mlp_batch())


@pytest.mark.parametrize("case", ["rounding", "one-in-a-million-off", "nan-on-both", "nan-on-one", "inf-sign", "inf-on-both",
                                  "inf-on-torchs", "inf-on-ours", "empty", "size-1"])  # fmt: skip
def test_projected_comparison_at_boundary_values(case):
    """verify.Projected against the elementwise comparison: rounding-sized differences pass, one element off by far
    more than its tolerance fails, NaN and infinities must be where torch has them; empty and one-element tensors."""
    generator = torch.Generator().manual_seed(0)
    torch_gradient = torch.randn(1000, 300, generator=generator)
    ours = torch_gradient * (1 + 1e-6 * torch.randn(1000, 300, generator=generator))
    if case == "one-in-a-million-off":
        ours[17, 3] += 100 * torch_gradient.abs().max()
    elif case in ("nan-on-both", "nan-on-one"):
        torch_gradient[5, 5] = float("nan")
        ours[5, 5] = float("nan") if case == "nan-on-both" else 0.0
    elif case == "inf-sign":
        torch_gradient[1, 1], ours[1, 1] = float("inf"), float("-inf")
    elif case.startswith("inf-on"):  # a finite value against an infinity passes the sum of allowances only if unchecked
        torch_gradient[2, 2] = float("inf") if case != "inf-on-ours" else torch_gradient[2, 2]
        ours[2, 2] = float("inf") if case != "inf-on-torchs" else ours[2, 2]
    elif case == "empty":
        torch_gradient, ours = torch.zeros(0, 4), torch.zeros(0, 4)
    elif case == "size-1":
        torch_gradient, ours = torch.tensor([3.0]), torch.tensor([3.0 * (1 + 1e-7)])
    reference = verify.StepResult({}, {"w": verify.Projected.of(torch_gradient)})
    elementwise = verify.compare(verify.StepResult({}, {"w": ours}), verify.StepResult({}, {"w": torch_gradient}), torch.float32, {})
    projected = verify.compare(verify.StepResult({}, {"w": ours}), reference, torch.float32, {})
    assert bool(projected) == bool(elementwise) == (case in ("one-in-a-million-off", "nan-on-one", "inf-sign", "inf-on-torchs", "inf-on-ours"))


def test_projected_refuses_float64_values_it_cannot_bound():
    """±huge: float32 squares stay finite in float64; a float64 gradient past 1e154 would overflow the norm the bound
    is made of, so any difference would pass: refused, naming the way out."""
    huge = verify.Projected.of(torch.tensor([3e38, -3e38, 1.0]))
    assert huge.specials == (0, 0, 0) and huge.norm > 4e38
    with pytest.raises(RuntimeError, match=r"values past 1e154, which its reduced form cannot bound; set "
                                           r"debug.check_against_torch to 'off'"):
        verify.Projected.of(torch.tensor([1e200, 1.0], dtype=torch.float64))


@pytest.mark.parametrize("dropout, runs", [(0.0, 1), (0.2, 2)], ids=["no-dropout", "dropout"])
def test_a_graph_without_dropout_runs_once_at_its_checked_first_step(monkeypatch, dropout, runs):
    """The check runs the training graph with dropout off; a graph without dropout draws nothing, so that run is the
    step's own (its outputs returned, its BatchNorm statistics kept, as torch's loop has them: run_parity); a graph
    with dropout runs again with it on."""
    from orttrainer.runtime import build

    calls = []
    run_training = build.Runtime.run_training
    monkeypatch.setattr(build.Runtime, "run_training", lambda self: calls.append(1) or run_training(self))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 10))
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy)
    x, label = torch.randn(8, 20), torch.randint(0, 10, (8,))
    loss = trainer.train_step(x, label)[0]
    assert len(calls) == runs
    if not dropout:
        expected = F.cross_entropy(reference(x), label)
        torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
        for name in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
            torch.testing.assert_close(model.state_dict()[name], reference.state_dict()[name], atol=1e-6, rtol=1e-5)
