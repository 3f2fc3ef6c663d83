"""What a training forward writes besides its outputs trains as torch: buffers written in place (a step counter, an
exponential moving average as VQ-VAE-2's EMA codebook keeps), spectral_norm's power iteration, InstanceNorm's running
statistics; and torch.cumprod, value and gradient. Each against a plain torch loop and its float64 copy, every
state_dict key after every step."""

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from parity import (assert_state_within_float32_error, assert_within_float32_error, cpu_options, float64_batch,
                    float64_copy, run_parity)

from orttrainer import ORTTrainer, optim
from orttrainer.export.refusals import ExportError

LR = 0.1


def sgd(parameters):
    return torch.optim.SGD(parameters, lr=LR)


def pairs(count, *shapes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(*shape, generator=generator) for shape in shapes) for _ in range(count)]


def train_like_torch(model, batches, options=None):
    """run_parity against torch SGD and its float64 copy: (trainer, reference, reference64)."""
    return run_parity(model, batches, optim.SGDConfig(lr=LR), sgd, loss_fn=F.mse_loss, options=options, float64=True)


def assert_eval_like_torch(trainer, reference, reference64, batch):
    """eval_step's outputs are the module's in eval mode, and it writes no buffer (as torch's eval forward)."""
    before = {name: tensor.clone() for name, tensor in trainer.state_dict(pytorch_format=True).items()}
    reference.eval(), reference64.eval()
    with torch.no_grad():
        expected, expected64 = reference(batch[0]), reference64(batch[0].double())
    assert_within_float32_error(trainer.eval_step(*batch)[1], expected, expected64, "eval_step")
    for name, tensor in trainer.state_dict(pytorch_format=True).items():
        torch.testing.assert_close(tensor, before[name], rtol=0, atol=0, msg=lambda m: f"'{name}' after eval_step: {m}")


# ------------------------------------------------------------------ buffers written in place
class RunningState(nn.Module):
    """A step counter (``self.steps += 1``) and an exponential moving average of the features updated under no_grad
    (``ema.mul_(d).add_(h.mean(0), alpha=1 - d)``, VQ-VAE-2's EMA codebook), both in training only; the output reads
    the average after its update, so a graph that kept the first step's would differ from the second step on."""

    def __init__(self, decay=0.9):
        super().__init__()
        self.encode, self.decode, self.decay = nn.Linear(4, 8), nn.Linear(8, 4), decay
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x):
        h = torch.tanh(self.encode(x))
        if self.training:
            self.steps += 1
            with torch.no_grad():
                self.ema.mul_(self.decay).add_(h.mean(0), alpha=1 - self.decay)
        return self.decode(h - self.ema)


def test_a_counter_and_a_moving_average_written_in_forward_train_and_evaluate_as_torch():
    torch.manual_seed(0)
    model = RunningState()
    batches = pairs(4, (5, 4), (5, 4))
    trainer, reference, reference64 = train_like_torch(model, batches)
    state = trainer.state_dict(pytorch_format=True)
    assert int(state["steps"]) == 4
    assert int(model.steps) == 4 and torch.equal(model.ema, state["ema"])  # the user's module holds the trained buffers
    assert_eval_like_torch(trainer, reference, reference64, batches[0])


def _spectral_norm_model():
    from torch.nn.utils import parametrizations

    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), parametrizations.spectral_norm(nn.Linear(8, 4)))


@pytest.mark.parametrize("make", [RunningState, _spectral_norm_model], ids=["counter-and-average", "spectral-norm"])
def test_written_buffers_under_gradient_accumulation_train_as_torch(make):
    """gradient_accumulation_steps=2: torch's forward writes the buffers at every micro-batch, its optimizer moves the
    weights at every second. Against a torch loop over the same micro-batches (each loss / 2 accumulated), every
    state_dict key after every micro-step."""
    torch.manual_seed(0)
    model = make()
    reference, reference64 = copy.deepcopy(model), float64_copy(model)
    options = cpu_options({"batch": {"gradient_accumulation_steps": 2}})
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=LR), loss_fn=F.mse_loss, options=options)
    optimizers = [sgd(module.parameters()) for module in (reference, reference64)]
    for step, batch in enumerate(pairs(6, (5, 4), (5, 4)), 1):
        loss = trainer.train_step(*batch)[0]
        losses = []
        for module, optimizer, micro in zip((reference, reference64), optimizers, (batch, float64_batch(batch))):
            losses.append(F.mse_loss(module(micro[0]), micro[1]))
            (losses[-1] / 2).backward()
            if step % 2 == 0:
                optimizer.step()
                optimizer.zero_grad()
        assert_within_float32_error(loss, *losses, f"loss at micro-step {step}")
        assert_state_within_float32_error(trainer, reference, reference64, step)
    assert int(trainer.state_dict(pytorch_format=True).get("steps", 6)) == 6


@pytest.mark.parametrize("style", ["parametrization", "hook"])
def test_spectral_norm_trains_and_evaluates_as_torch(style):
    """Its power iteration writes u (and v) in training forward; eval mode reads them unchanged."""
    from torch.nn.utils import parametrizations, spectral_norm

    normalize = parametrizations.spectral_norm if style == "parametrization" else spectral_norm
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), normalize(nn.Linear(8, 4)))
    batches = pairs(4, (5, 4), (5, 4))
    trainer, reference, reference64 = train_like_torch(model, batches)
    assert_eval_like_torch(trainer, reference, reference64, batches[0])


@pytest.mark.parametrize("dims", [1, 2])
def test_instance_norm_with_running_statistics_trains_and_evaluates_as_torch(dims):
    """track_running_stats=True: each training forward moves running_mean and running_var (torch's instance_norm:
    each instance's momentum step, averaged over the batch); eval mode normalizes by them."""
    convolution, norm = (nn.Conv1d, nn.InstanceNorm1d) if dims == 1 else (nn.Conv2d, nn.InstanceNorm2d)
    torch.manual_seed(0)
    model = nn.Sequential(convolution(2, 3, 3), norm(3, affine=True, track_running_stats=True, momentum=0.3),
                          nn.Flatten())  # fmt: skip
    shape = (4, 2) + (6,) * dims
    out = 3 * 4**dims
    batches = pairs(4, shape, (4, out))
    trainer, reference, reference64 = train_like_torch(model, batches)
    assert_eval_like_torch(trainer, reference, reference64, batches[0])


# ------------------------------------------------------------------ writes the graph cannot carry, refused by name
class OwnStatistics(nn.Module):
    """F.batch_norm given the module's own buffers as running statistics: it writes them inside one op."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("var", torch.ones(4))

    def forward(self, x):
        return F.batch_norm(x, self.mean, self.var, training=self.training)


class WritesThroughAView(nn.Module):
    """An EMA written into a row of a bank of features, a view of the buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("bank", torch.zeros(3, 4))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.bank[0].mul_(0.9).add_(x.mean(0), alpha=0.1)
        return x + self.bank.sum(0)


class CountsInEvalModeToo(nn.Module):
    """A counter without ``if self.training``: torch's eval forward counts too, orttrainer's eval_step would not."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        return x


@pytest.mark.parametrize("layer, message", [
    (OwnStatistics, r"forward writes the buffers \['1\.mean', '1\.var'\] inside F\.batch_norm, given them as its "
                    r"running statistics in training, at .*test_forward_writes\.py:\d+: return F\.batch_norm\("),
    (WritesThroughAView, r"forward writes into a view of the buffer '1\.bank' at .*test_forward_writes\.py:\d+: "
                         r"self\.bank\[0\]\.mul_"),
    (CountsInEvalModeToo, r"Sequential's forward writes the buffers \['1\.calls'\] in place in eval mode too"),
], ids=["batch-norm-on-own-statistics", "write-through-a-view", "written-in-eval-mode-too"])  # fmt: skip
def test_a_write_the_graph_cannot_carry_is_refused_naming_the_buffer_and_line(layer, message):
    """Each refused at the first train_step, naming the buffer by its state_dict key (and the line where the trace
    sees it); the module's buffers are as they were."""
    model = nn.Sequential(nn.Linear(4, 4), layer())
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=LR), loss_fn=F.mse_loss, options=cpu_options())
    with pytest.raises(ExportError, match=message):
        trainer.train_step(torch.randn(3, 4), torch.randn(3, 4))
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, before[name], rtol=0, atol=0, msg=lambda m: f"'{name}': {m}")


# ------------------------------------------------------------------ torch.cumprod
class ScaledProducts(nn.Module):
    """torch.cumprod of the input times a weight of its shape: each element's gradient is the weight's."""

    def __init__(self, shape, dim):
        super().__init__()
        self.scale, self.dim = nn.Parameter(torch.ones(shape)), dim

    def forward(self, x):
        return torch.cumprod(x * self.scale, self.dim)


def _products_loss(output, target):
    return (output * target).sum()


ROWS = {  # each row's products along the last dimension, the tricky values for the gradient
    "one zero": [2.0, 0.0, 3.0, -1.5, 5.0],
    "two zeros": [0.5, 0.0, 3.0, 0.0, 2.0],
    "zero first": [0.0, 4.0, -2.0, 0.5, 3.0],
    "negative zero": [1.5, -0.0, 2.0, -3.0, 1.0],
    "tiny and huge": [1e-30, 1e30, -1e-20, 1e20, 7.0],
    "overflow": [1e20, 1e20, 1e-5, 2.0, 0.0],
    "infinity": [2.0, float("inf"), 0.5, -1.0, 3.0],
    "infinity and zero": [float("inf"), 0.0, 2.0, 1.0, 1.0],
    "nan": [1.0, float("nan"), 2.0, 0.0, 1.0],
    "infinity after a zero": [2.0, 0.0, float("inf"), 3.0, 1.0],
    "infinity between two zeros": [0.0, float("-inf"), 2.0, 0.0, 4.0],
    "nan before a zero": [float("nan"), 3.0, 0.0, 2.0, 1.0],
    "nan after two zeros": [0.0, 2.0, 0.0, float("nan"), 1.0],
}


@pytest.mark.parametrize("row", ROWS)
def test_cumprod_value_and_gradient_at_boundary_values(row):
    """One SGD step: the loss (the products), and the weight after it (each element's gradient), within float32
    torch's distance from float64 torch, NaN and infinities where torch's cumprod_backward has them (the gradient
    through the products would have NaN where it has an infinity or 0, after an infinity meets a zero)."""
    x = torch.tensor([ROWS[row], [1.0, 2.0, 3.0, 4.0, 5.0]])
    target = torch.linspace(-1.0, 1.0, 10).reshape(2, 5)
    train_like_products(ScaledProducts((2, 5), -1), [(x, target)])


def train_like_products(model, batches):
    return run_parity(model, batches, optim.SGDConfig(lr=LR), sgd, loss_fn=_products_loss, float64=True)


@pytest.mark.parametrize("shape, dim", [((2, 1, 3), 1), ((2, 3, 4), -2), ((2, 4), 1)],
                         ids=["size-1", "negative-dim", "several-steps"])  # fmt: skip
def test_cumprod_trains_as_torch_along_any_fixed_dimension(shape, dim):
    torch.manual_seed(0)
    batches = [(x.relu(), target) for x, target in pairs(3, shape, shape)]  # zeros among the values
    train_like_products(ScaledProducts(shape, dim), batches)


class ProductsAndSums(nn.Module):
    """Several scans of one tensor, which ONNX Runtime's optimizer merges in part: cumprods along two dimensions (one
    twice), and with ``with_cumsum`` a cumsum too."""

    def __init__(self, with_cumsum):
        super().__init__()
        self.scale, self.with_cumsum = nn.Parameter(torch.ones(3, 4)), with_cumsum

    def forward(self, x):
        y = x * self.scale
        if self.with_cumsum:
            return torch.cumprod(y, 2) + torch.cumsum(y, 2)
        return torch.cumprod(y, 1) + torch.cumprod(y, 2) + 2 * torch.cumprod(y, 2)


def test_cumprods_of_one_tensor_train_as_torch_at_boundary_values():
    x = torch.linspace(-2.0, 2.0, 24).reshape(2, 3, 4)
    x[0, 1, 2], x[1, 2, 0], x[1, 0, 1], x[0, 2, 3] = 0.0, 0.0, float("inf"), float("nan")
    train_like_products(ProductsAndSums(with_cumsum=False), [(x, torch.linspace(-1.0, 1.0, 24).reshape(2, 3, 4))])


def test_a_cumprod_and_a_cumsum_of_one_tensor_train_as_torch_with_zeros():
    """Their scans share nodes: the cumprod keeps the gradient through the products, torch's where no infinity or NaN
    meets the others (with one, the first-step check refuses the step)."""
    x = torch.linspace(-2.0, 2.0, 24).reshape(2, 3, 4)
    x[0, 1, 2], x[1, 2, 0] = 0.0, 0.0
    train_like_products(ProductsAndSums(with_cumsum=True), [(x, torch.linspace(-1.0, 1.0, 24).reshape(2, 3, 4))] * 2)


def test_cumprod_along_the_batch_dimension_is_refused_naming_the_module():
    """The scan is written for a fixed size; the batch's changes with the batch (an inferred model_desc)."""
    trainer = ORTTrainer(ScaledProducts((3, 4), 0), None, optim.SGDConfig(lr=LR), loss_fn=_products_loss,
                         options=cpu_options())  # fmt: skip
    with pytest.raises(ExportError, match=r"torch.cumprod in module .* along dimension 0, whose size changes with the batch"):
        trainer.train_step(torch.randn(3, 4), torch.randn(3, 4))
