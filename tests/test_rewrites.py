"""Ops onnxruntime-training cannot differentiate, rewritten: values and gradients equal torch's.

Each case trains one SGD step (lr 1, so the weight change is the gradient) through a
layer before the op, and checks that the op's node was really replaced.
"""

import copy
import functools

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from parity import cpu_options, run_parity

from orttrainer import GradientBuildError, ORTTrainer, optim
from orttrainer.graph import rewrites


class Around(nn.Module):
    """Linear (or Conv) -> fn -> flatten: ``fn`` sits between trainable weights and the loss."""

    def __init__(self, fn, images=False, width=8, extra=None):
        super().__init__()
        self.inp = nn.Conv2d(2, 4, 3, padding=1) if images else nn.Linear(width, width)
        self.fn = fn
        self.extra = extra  # a module whose parameters fn uses (e.g. PReLU)

    def forward(self, x):
        return self.fn(self.inp(x)).flatten(1)


def vectors(generator):
    return torch.randn(6, 8, generator=generator) * 2


def images(generator):
    return torch.randn(3, 2, 8, 8, generator=generator)


def one_step(model, x, loss_fn, target, tmp_path):
    """Return (forward op names, training-graph node names) after checking loss and gradients."""
    reference = copy.deepcopy(model)
    initial = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    path = tmp_path / "train.onnx"
    options = cpu_options({"debug": {"graph_save_paths": {"model_with_training_graph_path": str(path)}}})
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=1.0), loss_fn=loss_fn, options=options)
    loss = trainer.train_step(x, target)[0]
    expected = loss_fn(reference(x), target)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), atol=1e-5, rtol=1e-5)
    state = trainer.state_dict(pytorch_format=True)
    for name, parameter in reference.named_parameters():
        torch.testing.assert_close(initial[name] - state[name], parameter.grad, atol=1e-5, rtol=1e-4,
                                   msg=lambda m: f"gradient of {name}: {m}")
    forward = {node.name: node.op_type for node in trainer._onnx_model.graph.node}
    return forward, {node.name for node in onnx.load(str(path)).graph.node}


def _einsum(equation, *shapes, rows=None):
    """fn(h) feeding h (reshaped) and fixed tensors into torch.einsum; its result reshaped to ``rows`` if given."""
    fixed = [torch.randn(shape, generator=torch.Generator().manual_seed(9)) for shape in shapes[1:]]

    def fn(h):
        result = torch.einsum(equation, h.reshape(shapes[0]), *fixed)
        return result if rows is None else result.reshape(rows)

    return fn


def _parts(h, size, indices):
    """Constant-index lookups h[:, i] along an axis of ``size``, combined nonlinearly."""
    grouped = h.reshape(6, size, 8 // size)
    picked = [grouped[:, index] * (index + 1) for index in indices]
    return picked[0] * picked[-1] + picked[0]


def _lookup_beside_softplus(h):
    """A lookup along axis 0 next to another rewritten op (Softplus) reading the same tensor."""
    grouped = h.reshape(2, 6, 4)
    return grouped[0] * F.softplus(grouped).sum(0)


CASES = {
    "Softplus": (lambda: Around(nn.Softplus()), vectors),
    "Softplus (beta 2)": (lambda: Around(nn.Softplus(beta=2.0)), vectors),
    "Elu": (lambda: Around(nn.ELU(0.7)), vectors),
    "Celu": (lambda: Around(nn.CELU(0.5)), vectors),
    "Selu": (lambda: Around(nn.SELU()), vectors),
    "HardSigmoid": (lambda: Around(nn.Hardsigmoid()), vectors),
    "HardSwish": (lambda: Around(nn.Hardswish()), vectors),
    "Mish (Softplus inside)": (lambda: Around(nn.Mish()), vectors),
    "PRelu": (lambda: Around(nn.PReLU(4), images=True), images),
    "InstanceNormalization (GroupNorm)": (lambda: Around(nn.GroupNorm(2, 4), images=True), images),
    "InstanceNormalization (InstanceNorm2d)": (lambda: Around(nn.InstanceNorm2d(4, affine=True), images=True), images),
    "AveragePool": (lambda: Around(nn.AvgPool2d(2), images=True), images),
    "AveragePool (padding, count_include_pad=False)": (
        lambda: Around(nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False), images=True), images),
    "AveragePool (ceil_mode, padding)": (lambda: Around(nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True), images=True),
                                         images),  # fmt: skip
    "AveragePool (ceil_mode, count_include_pad=False)": (
        lambda: Around(nn.AvgPool2d(3, stride=2, ceil_mode=True, count_include_pad=False), images=True), images),
    "AveragePool (1d)": (lambda: Around(lambda h: F.avg_pool1d(h.reshape(6, 2, 4), 2)), vectors),
    "DepthToSpace (PixelShuffle)": (lambda: Around(nn.PixelShuffle(2), images=True), images),
    "Resize (nearest)": (lambda: Around(nn.Upsample(scale_factor=2), images=True), images),
    "Resize (nearest to a size)": (lambda: Around(lambda h: F.interpolate(h, size=(16, 24)), images=True), images),
    "Resize (bilinear)": (lambda: Around(nn.Upsample(scale_factor=2, mode="bilinear"), images=True), images),
    "Resize (bicubic)": (lambda: Around(nn.Upsample(scale_factor=2, mode="bicubic"), images=True), images),
    "Resize (bicubic, align_corners, to a size)": (
        lambda: Around(lambda h: F.interpolate(h, size=(5, 11), mode="bicubic", align_corners=True), images=True), images),
    "Resize (bilinear, align_corners)": (
        lambda: Around(nn.Upsample(scale_factor=1.5, mode="bilinear", align_corners=True), images=True), images),
    "Resize (bilinear to a size: down and up)": (
        lambda: Around(lambda h: F.interpolate(h, size=(5, 11), mode="bilinear"), images=True), images),
    "Resize (trilinear)": (lambda: Around(lambda h: F.interpolate(h.reshape(3, 1, 4, 8, 8), scale_factor=(1.5, 2, 0.5),
                                                                  mode="trilinear"), images=True), images),  # fmt: skip
    "Resize (linear, 1-d)": (lambda: Around(lambda h: F.interpolate(h.reshape(6, 2, 4), scale_factor=2.5, mode="linear")),
                             vectors),  # fmt: skip
    "Slice (torch.flip)": (lambda: Around(lambda h: torch.flip(h, dims=[1, 3]) * h, images=True), images),
    "Pad (reflect)": (lambda: Around(lambda h: F.pad(h, (1, 2, 2, 1), mode="reflect"), images=True), images),
    "Pad (replicate)": (lambda: Around(lambda h: F.pad(h, (3, 0, 1, 2), mode="replicate"), images=True), images),
    "Pad (reflect, 1-d)": (lambda: Around(lambda h: F.pad(h.reshape(6, 2, 4), (3, 1), mode="reflect")), vectors),
    "ReduceLogSumExp (logsumexp)": (lambda: Around(lambda h: torch.logsumexp(h.reshape(6, 2, 4), dim=2)), vectors),
    "ReduceL2 (vector_norm)": (lambda: Around(lambda h: torch.linalg.vector_norm(h.reshape(6, 2, 4), dim=1)), vectors),
    "CumSum (last axis)": (lambda: Around(lambda h: torch.cumsum(h, 1)), vectors),
    "CumSum (middle axis)": (lambda: Around(lambda h: torch.cumsum(h.reshape(6, 2, 4), 1)), vectors),
    "ReduceMax (amax)": (lambda: Around(lambda h: h.reshape(6, 2, 4).amax(dim=2)), vectors),
    "ReduceMin (amin, keepdim)": (lambda: Around(lambda h: h.reshape(6, 2, 4).amin(dim=1, keepdim=True)), vectors),
    "ReduceL1": (lambda: Around(lambda h: torch.norm(h.reshape(6, 2, 4), p=1, dim=2)), vectors),
    "Sinh": (lambda: Around(lambda h: torch.sinh(h * 0.3)), vectors),
    "Cosh": (lambda: Around(lambda h: torch.cosh(h * 0.3)), vectors),
    "Asinh": (lambda: Around(torch.asinh), vectors),
    "Acosh": (lambda: Around(lambda h: torch.acosh(h * h + 1.5)), vectors),
    "Atanh": (lambda: Around(lambda h: torch.atanh(torch.tanh(h) * 0.9)), vectors),
    "Sign (zero gradient)": (lambda: Around(lambda h: torch.sign(h) * h * h), vectors),
    "Einsum bi,ij->bj": (lambda: Around(_einsum("bi,ij->bj", (6, 8), (8, 3))), vectors),
    "Einsum bij,bjk->bik": (lambda: Around(_einsum("bij,bjk->bik", (6, 2, 4), (6, 4, 3))), vectors),
    "Einsum bhqd,bhkd->bhqk": (lambda: Around(_einsum("bhqd,bhkd->bhqk", (6, 2, 2, 2), (6, 2, 3, 2))), vectors),
    "Einsum bi,bi->b": (lambda: Around(lambda h: torch.einsum("bi,bi->b", h, h).unsqueeze(1)), vectors),
    "Einsum bi,j->bij": (lambda: Around(_einsum("bi,j->bij", (6, 8), (3,))), vectors),
    "Einsum bij->bj": (lambda: Around(_einsum("bij->bj", (6, 2, 4))), vectors),
    "Einsum td,dnh->tnh": (lambda: Around(_einsum("td,dnh->tnh", (6, 8), (8, 2, 3), rows=(6, 6))), vectors),
    "Einsum bjk,bjk->b": (lambda: Around(lambda h: torch.einsum("bjk,bjk->b", h.reshape(6, 2, 4), h.reshape(6, 2, 4)).unsqueeze(1)),
                          vectors),
    "Einsum ibh,hnd->ibnd": (lambda: Around(_einsum("ibh,hnd->ibnd", (2, 3, 8), (8, 2, 2), rows=(6, 4))), vectors),
    "Einsum bn,bnij->bij (no free index on the left)": (lambda: Around(_einsum("bn,bnij->bij", (6, 8), (6, 8, 2, 2), rows=(6, 4))),
                                                        vectors),
    "Gather (every index of an axis: Split)": (lambda: Around(lambda h: _parts(h, 2, [0, 1])), vectors),
    "Gather (indices 0, 1 of 4: Split with rest)": (lambda: Around(lambda h: _parts(h, 4, [1, 0])), vectors),
    "Gather (one index: Slice)": (lambda: Around(lambda h: _parts(h, 4, [2])), vectors),
    "Gather (its tensor also read by a Softplus)": (lambda: Around(_lookup_beside_softplus), vectors),
}
EXPECTED_OP = {name: name.split(" ")[0] for name in CASES}
EXPECTED_OP["Mish (Softplus inside)"] = "Softplus"
REWRITTEN_IN_THE_EXPORT = {"AveragePool (ceil_mode, padding)"}  # rewrites.torch_pools


@pytest.mark.parametrize("case", CASES)
def test_rewritten_op_matches_torch(case, tmp_path):
    make, batch = CASES[case]
    torch.manual_seed(0)
    model = make()
    generator = torch.Generator().manual_seed(1)
    x = batch(generator)
    with torch.no_grad():
        target = torch.randn(copy.deepcopy(model)(x).shape, generator=generator)
    forward, trained = one_step(model, x, F.mse_loss, target, tmp_path)
    if case in REWRITTEN_IN_THE_EXPORT:  # for every graph (the eval graph too): its replacement is in the export
        assert any(f"{EXPECTED_OP[case]}_rewritten" in name for name in forward), f"{EXPECTED_OP[case]} not rewritten in the export"
        return
    replaced = [name for name, op_type in forward.items() if op_type == EXPECTED_OP[case]]
    assert replaced, f"the export has no {EXPECTED_OP[case]} node; the case tests nothing"
    assert not set(replaced) & trained, f"{EXPECTED_OP[case]} was not rewritten in the training graph"


class ResizedPositions(nn.Module):
    """A table of position embeddings resized to a 6x6 patch grid as ViT-style models do: reshaped to its 4x4 grid,
    permuted to channels first, interpolated to a size or by a factor, permuted back. ONNX Runtime's CPU layout
    transformer moved the permute through the cubic Resize of constant sizes and left one its kernel refuses
    (session._BREAKS_CUBIC_RESIZE)."""

    def __init__(self, mode, resize):
        super().__init__()
        self.positions, self.head = nn.Parameter(torch.randn(1, 16, 8)), nn.Linear(8, 3)
        self.mode, self.resize = mode, resize

    def forward(self, x):
        grid = self.positions.reshape(1, 4, 4, 8).permute(0, 3, 1, 2)
        resized = F.interpolate(grid, mode=self.mode, align_corners=False, **self.resize)
        return self.head(x + resized.permute(0, 2, 3, 1).reshape(1, 36, 8)).mean(1)


@pytest.mark.parametrize("mode", ["bicubic", "bilinear"])
@pytest.mark.parametrize("resize", [{"size": (6, 6)}, {"scale_factor": 1.5}], ids=["to a size", "by a factor"])
def test_a_resized_table_of_positions_trains_and_evaluates_like_torch(mode, resize):
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, 36, 8, generator=generator), torch.randn(2, 3, generator=generator)) for _ in range(3)]
    trainer, reference = run_parity(ResizedPositions(mode, resize), batches, optim.SGDConfig(lr=0.1),
                                    lambda parameters: torch.optim.SGD(parameters, lr=0.1), loss_fn=F.mse_loss)  # fmt: skip
    x, _ = batches[0]
    reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(trainer.eval_step(*batches[0])[1], reference(x), atol=1e-5, rtol=1e-5)


class PoolThenLinear(nn.Module):
    """A 1x1 convolution, ceil_mode pools, and a Linear over what torch's pools return."""

    def __init__(self, pool, size, dims):
        super().__init__()
        self.conv, self.pool = (nn.Conv1d if dims == 1 else nn.Conv2d)(2, 3, 1), pool
        with torch.no_grad():
            pooled = pool(torch.zeros((1, 3) + (size,) * dims)).numel()
        self.head = nn.Linear(pooled, 4)

    def forward(self, x):
        return self.head(self.pool(self.conv(x)).flatten(1))


@pytest.mark.parametrize("pool, size, dims", [
    (nn.MaxPool2d(2, stride=3, padding=1, ceil_mode=True), 4, 2),  # torch 2x2 windows, ONNX Runtime 3x3
    (nn.MaxPool2d(2, stride=3, padding=1, dilation=2, ceil_mode=True), 5, 2),
    (nn.MaxPool1d(2, stride=3, padding=1, ceil_mode=True), 7, 1),
    (nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True), 6, 2),  # a partial last window both make
    (nn.Sequential(nn.MaxPool2d(2, stride=3, padding=1, ceil_mode=True), nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True)),
     10, 2),
], ids=["2d", "dilated", "1d", "partial window kept", "max then average pool"])  # fmt: skip
def test_a_ceil_mode_max_pool_makes_torchs_windows(pool, size, dims):
    """ONNX Runtime's MaxPool makes a last ceil_mode window that starts in the end padding, which torch's does
    not (rewrites.torch_pools); the first-step check refused such a model. A MaxPool feeding a ceil_mode
    AveragePool: the AveragePool is rewritten for the sizes torch's MaxPool gives."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn((3, 2) + (size,) * dims, generator=generator), torch.randn(3, 4, generator=generator))
               for _ in range(2)]  # fmt: skip
    trainer, reference = run_parity(PoolThenLinear(pool, size, dims), batches, optim.SGDConfig(lr=0.1),
                                    lambda parameters: torch.optim.SGD(parameters, lr=0.1), loss_fn=F.mse_loss)  # fmt: skip
    with torch.no_grad():
        torch.testing.assert_close(trainer.eval_step(*batches[0])[1], reference.eval()(batches[0][0]), atol=1e-5, rtol=1e-5)


LOSSES = {
    "l1_loss": (F.l1_loss, None),
    "smooth_l1_loss": (lambda out, y: F.smooth_l1_loss(out, y, beta=0.5), None),
    "smooth_l1_loss (beta 0)": (lambda out, y: F.smooth_l1_loss(out, y, beta=0.0), None),
    "huber_loss": (lambda out, y: F.huber_loss(out, y, delta=2.0, reduction="sum"), None),
    "binary_cross_entropy": (lambda out, y: F.binary_cross_entropy(torch.sigmoid(out), y), "probability"),
    "binary_cross_entropy (weight)": (
        lambda out, y: F.binary_cross_entropy(torch.sigmoid(out), y, weight=torch.linspace(0.5, 2, 8)), "probability"),
    "soft_margin_loss": (F.soft_margin_loss, "sign"),
    "poisson_nll_loss": (F.poisson_nll_loss, "count"),
    "poisson_nll_loss (log_input False)": (lambda out, y: F.poisson_nll_loss(F.softplus(out) + 0.1, y, log_input=False), "count"),
    "hinge_embedding_loss": (lambda out, y: F.hinge_embedding_loss(out, y, margin=0.5), "sign"),
    "cross_entropy (label_smoothing)": (lambda out, y: F.cross_entropy(out, y, label_smoothing=0.1), "class"),
    "cross_entropy (label_smoothing, weight, ignore_index, sum)": (
        lambda out, y: F.cross_entropy(out, y, weight=torch.linspace(0.5, 2, 8), ignore_index=3, reduction="sum",
                                       label_smoothing=0.2), "class"),  # fmt: skip
    "cross_entropy (class probabilities)": (F.cross_entropy, "distribution"),
    "cross_entropy (class probabilities, label_smoothing, weight)": (
        lambda out, y: F.cross_entropy(out, y, weight=torch.linspace(0.5, 2, 8), label_smoothing=0.1), "distribution"),
}
TARGETS = {
    None: lambda shape, g: torch.randn(shape, generator=g),
    "probability": lambda shape, g: torch.rand(shape, generator=g),
    "sign": lambda shape, g: torch.randint(0, 2, shape, generator=g).float() * 2 - 1,
    "count": lambda shape, g: torch.randint(0, 5, shape, generator=g).float(),
    "class": lambda shape, g: torch.arange(shape[0]) % shape[1],  # every class once, 3 (ignored in one case) too
    "distribution": lambda shape, g: torch.softmax(torch.randn(shape, generator=g), 1),
}


@pytest.mark.parametrize("case", LOSSES)
def test_loss_exported_by_orttrainer_matches_torch(case, tmp_path):
    loss_fn, kind = LOSSES[case]
    torch.manual_seed(0)
    model = Around(nn.Identity())
    generator = torch.Generator().manual_seed(1)
    x = vectors(generator)
    one_step(model, x, loss_fn, TARGETS[kind]((6, 8), generator), tmp_path)


def test_bilinear_layer_exports_and_matches_torch(tmp_path):
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 5), nn.Linear(8, 3)
            self.bilinear = nn.Bilinear(5, 3, 4)

        def forward(self, x):
            return self.bilinear(self.a(x), self.b(x))

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    one_step(Pair(), vectors(generator), F.mse_loss, torch.randn(6, 4, generator=generator), tmp_path)


def _onnx_model_with(op_type, inputs_count, **attributes):
    """x [4, 6] @ W (trainable) -> op(h, h*2, ...) -> ReduceSum (scalar loss)."""
    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((6, 6)).astype(np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Mul", ["h", "two"], ["h2"])]
    nodes.append(helper.make_node(op_type, ["h", "h2", "h"][:inputs_count], ["y"], **attributes))
    nodes.append(helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [weight, numpy_helper.from_array(np.array(2.0, np.float32), "two")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize(
    "op_type, inputs, attributes, reference",
    [
        ("Sum", 3, {}, lambda h: (h + 2 * h + h).sum()),
        ("Mean", 2, {}, lambda h: ((h + 2 * h) / 2).sum()),
        ("ReduceSumSquare", 1, {"axes": [1], "keepdims": 0}, lambda h: (h * h).sum()),
        ("ReduceLogSum", 1, {"axes": [1], "keepdims": 1}, lambda h: torch.log((h * h).sum(1) + 0).sum()),
    ],
)
def test_ops_torch_does_not_emit_are_rewritten_in_onnx_models(op_type, inputs, attributes, reference):
    model = _onnx_model_with(op_type, inputs, **attributes)
    if op_type == "ReduceLogSum":  # keep the log's argument positive: feed h*h
        model.graph.node[2].input[0] = "hh"
        model.graph.node.insert(2, helper.make_node("Mul", ["h", "h"], ["hh"]))
        reference_fn = lambda h: torch.log((h * h).sum(1)).sum()  # noqa: E731
    else:
        reference_fn = reference
    weight = torch.from_numpy(numpy_helper.to_array(model.graph.initializer[0]).copy()).requires_grad_()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=1.0), options=cpu_options())
    loss = trainer.train_step(x)
    expected = reference_fn(x @ weight)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), atol=1e-4, rtol=1e-5)
    gradient = weight.detach() - trainer.state_dict(pytorch_format=True)["w"]
    torch.testing.assert_close(gradient, weight.grad, atol=1e-4, rtol=1e-4)


class Mixed(nn.Module):
    """GroupNorm + Mish + ELU + HardSwish in one model (the issue's acceptance model)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 8, 3, padding=1)
        self.norm = nn.GroupNorm(4, 8)
        self.conv2 = nn.Conv2d(8, 4, 3, padding=1)
        self.head = nn.Linear(4 * 8 * 8, 5)

    def forward(self, x):
        h = F.mish(self.norm(self.conv(x)))
        h = F.hardswish(F.elu(self.conv2(h)))
        return self.head(h.flatten(1))


def test_model_with_groupnorm_mish_elu_hardswish_and_l1_loss_trains_like_torch():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(4)
    batches = [(images(generator), torch.randn(3, 5, generator=generator)) for _ in range(6)]
    run_parity(Mixed(), batches, optim.SGDConfig(lr=0.05), lambda p: torch.optim.SGD(p, lr=0.05), loss_fn=F.l1_loss)


def test_an_op_that_cannot_be_rewritten_is_named():
    torch.manual_seed(0)
    model = Around(lambda h: torch.einsum("bi,bi,bi->b", h, h, h).unsqueeze(1))
    trainer = ORTTrainer(model, None, optim.SGDConfig(), loss_fn=F.mse_loss, options=cpu_options())
    with pytest.raises(GradientBuildError, match=r"Einsum node '/model/Einsum'.*has 3 operands"):
        trainer.train_step(vectors(torch.Generator()), torch.randn(6, 1))


def test_an_op_that_cannot_be_rewritten_names_its_module():
    """Nearest upsampling by a fraction exports a Resize whose rewrite repeats values a whole number of times only."""

    class WithFractionalNearest(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.up = nn.Upsample(scale_factor=1.5, mode="nearest")

        def forward(self, x):
            return self.up(self.conv(x)).mean((2, 3))

    trainer = ORTTrainer(WithFractionalNearest(), None, optim.SGDConfig(), loss_fn=F.mse_loss, options=cpu_options())
    with pytest.raises(GradientBuildError, match=r"cannot make this op differentiable in module 'up': Resize node .*whole-number"):
        trainer.train_step(torch.randn(2, 3, 8, 8), torch.randn(2, 4))


class WithLocalResponseNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.norm = nn.LocalResponseNorm(2)

    def forward(self, x):
        return self.norm(self.conv(x)).mean((2, 3))


def test_local_response_norm_trains_and_evaluates_as_torch_at_two_batch_sizes():
    """It exports a Pad before its AveragePool, whose pads torch's symbolic computed with ops shape inference
    could not follow: the pool's rewrite, which needs the sizes, refused it (symbolics.layers._onnx_paddings)."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(size, 3, 8, 8, generator=generator), torch.randn(size, 4, generator=generator)) for size in (2, 3, 2)]
    trainer, reference = run_parity(WithLocalResponseNorm(), data, optim.SGDConfig(lr=0.5),
                                    functools.partial(torch.optim.SGD, lr=0.5), loss_fn=F.mse_loss)  # fmt: skip
    reference.eval()
    torch.testing.assert_close(trainer.eval_step(*data[1])[1], reference(data[1][0]), atol=1e-5, rtol=1e-5)


class FrozenNorm(nn.Module):
    """Conv -> BatchNorm2d in eval() (running statistics, trainable affine) -> ReLU -> Linear, in train()."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.norm = nn.BatchNorm2d(3)
        self.head = nn.Linear(3 * 4 * 4, 2)
        with torch.no_grad():
            self.norm.running_mean.copy_(torch.tensor([0.5, -1.0, 2.0]))
            self.norm.running_var.copy_(torch.tensor([0.25, 4.0, 1e-3]))
            self.norm.weight.copy_(torch.tensor([1.5, -0.5, 2.0]))
            self.norm.bias.copy_(torch.tensor([0.1, 0.0, -0.3]))
        self.norm.eval()

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.conv(x))).flatten(1))


def test_batch_norm_in_eval_inside_a_training_model_uses_and_keeps_running_statistics():
    """A BatchNorm the user put in eval() normalizes with its running statistics, which stay
    unchanged; conv, scale and bias get torch's gradients (ONNX Runtime's optimizer would turn
    it into a training-mode BatchNormInternal: batch statistics, running ones overwritten)."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 2, 4, 4, generator=generator), torch.randn(4, 2, generator=generator)) for _ in range(2)]
    options = cpu_options({"debug": {"check_against_torch": "off"}})  # compared step by step here
    trainer, _ = run_parity(FrozenNorm(), batches, optim.SGDConfig(lr=0.5), lambda p: torch.optim.SGD(p, lr=0.5),
                            loss_fn=F.mse_loss, options=options)  # fmt: skip
    assert "BatchNormalization" in {node.op_type for node in trainer._onnx_model.graph.node}
    state = trainer.state_dict(pytorch_format=True)
    torch.testing.assert_close(state["norm.running_mean"], torch.tensor([0.5, -1.0, 2.0]), rtol=0, atol=0)
    torch.testing.assert_close(state["norm.running_var"], torch.tensor([0.25, 4.0, 1e-3]), rtol=0, atol=0)


def _export_ops(function, x, opset=17):
    """The ONNX op types torch's TorchScript exporter emits for ``function(x)``."""
    import io
    import warnings

    class Wrapped(nn.Module):
        def forward(self, x):
            return function(x)

    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's deprecation notice
        torch.onnx.export(Wrapped(), (x,), buffer, dynamo=False, opset_version=opset)
    return [node.op_type for node in onnx.load_from_string(buffer.getvalue()).graph.node]


def test_exporting_registers_orttrainers_symbolics_for_one_export_only():
    """Inside symbolics.exporting() orttrainer's symbolics win, also over ones the user
    registered; afterwards torch's registry is as before: the user's symbolics are back,
    ops torch cannot export fail as they did, and torch's own symbolics apply again."""
    from torch.onnx.errors import UnsupportedOperatorError

    from orttrainer.export import symbolics

    x = torch.randn(3, 4)
    l1 = lambda h: F.l1_loss(h, torch.zeros_like(h))  # noqa: E731
    huber = lambda h: F.huber_loss(h, torch.zeros_like(h))  # noqa: E731
    maximum = lambda h: torch.max(h, 1).values  # noqa: E731
    with pytest.raises(UnsupportedOperatorError):
        _export_ops(huber, x)
    assert _export_ops(maximum, x) == ["ReduceMax"]
    torch.onnx.register_custom_op_symbolic("aten::softplus", lambda g, h, beta, threshold: g.op("Relu", h), 9)
    torch.onnx.register_custom_op_symbolic("aten::l1_loss", lambda g, h, target, reduction: g.op("Neg", h), 12)
    try:
        with symbolics.exporting():
            with symbolics.exporting():  # nested: leaves the outer block's registrations
                pass
            assert "Where" in _export_ops(F.softplus, x)
            assert "IsNaN" in _export_ops(l1, x)
            assert "Abs" in _export_ops(huber, x)
            assert "GatherElements" in _export_ops(maximum, x, opset=18)  # torch has its own max at opset 18
        assert _export_ops(F.softplus, x) == ["Relu"]
        assert _export_ops(l1, x)[-1] == "Neg"
    finally:
        torch.onnx.unregister_custom_op_symbolic("aten::softplus", 9)
        torch.onnx.unregister_custom_op_symbolic("aten::l1_loss", 12)
    assert _export_ops(F.softplus, x) == ["Softplus"]
    assert _export_ops(maximum, x) == ["ReduceMax"]
    with pytest.raises(UnsupportedOperatorError):  # not another error from an entry orttrainer left behind
        _export_ops(huber, x)


def _squeeze_if_model(shape, dim):
    """x -> the exporter's squeeze(dim) of a dimension it could not size: If(size(x, dim) == 1, Squeeze, Identity)."""
    constant = lambda name, value: helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(value, np.int64)))  # noqa: E731
    then_branch = helper.make_graph([constant("axes", [dim]), helper.make_node("Squeeze", ["x", "axes"], ["squeezed"])], "then", [],
                                    [helper.make_empty_tensor_value_info("squeezed")])  # fmt: skip
    else_branch = helper.make_graph([helper.make_node("Identity", ["x"], ["kept"])], "else", [], [helper.make_empty_tensor_value_info("kept")])
    nodes = [helper.make_node("Shape", ["x"], ["shape"]), constant("dim", [dim]), helper.make_node("Gather", ["shape", "dim"], ["size"]),
             constant("one", [1]), helper.make_node("Equal", ["size", "one"], ["is_one"]),
             helper.make_node("If", ["is_one"], ["y"], name="If", then_branch=then_branch, else_branch=else_branch)]  # fmt: skip
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, shape)],
                              [helper.make_empty_tensor_value_info("y")])  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("shape, dim, expected", [([2, 1, 3], 1, "Squeeze"), ([2, 1, 3], 2, "Identity"), ([2, "n", 3], 1, "If")])
def test_an_if_on_a_size_shape_inference_knows_becomes_the_branch_taken(shape, dim, expected):
    model = _squeeze_if_model(shape, dim)
    replaced = rewrites.fold_static_sizes(model)
    assert ("If" in replaced) == (expected != "If")
    assert expected in {node.op_type for node in model.graph.node} and ("If" in {node.op_type for node in model.graph.node}) == (expected == "If")
    x = np.arange(6, dtype=np.float32).reshape(2, 1, 3)
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], x.squeeze(1) if dim == 1 else x)


def _size_arithmetic_model(dims, division_by_zero=False):
    """x of ``dims`` -> one int64 vector of the exporter's kinds of size arithmetic at edge values (negative
    quotients, halves, a square root, truncating casts, a size of 0), made from Shape and read by an Identity;
    with ``division_by_zero`` a second output, 7 // 0 (which stops the process in an ONNX Runtime run)."""
    nodes, made = [], iter(range(1000))

    def node(op_type, *inputs, **attributes):
        name = f"t{next(made)}"
        nodes.append(helper.make_node(op_type, list(inputs), [name], name=name, **attributes))
        return name

    def constant(value, dtype=np.int64):
        return node("Constant", value=numpy_helper.from_array(np.array(value, dtype)))

    shape = node("Shape", "x")
    size = {axis: node("Gather", shape, constant(axis)) for axis in (1, 2, 3)}  # 7, 2, 0
    negative = node("Neg", size[1])
    real = {axis: node("Cast", size[axis], to=TensorProto.FLOAT) for axis in (1, 2)}
    halves = node("Div", node("Neg", real[1]), real[2])  # -3.5
    third = node("Mul", node("Div", real[1], constant(3.0, np.float32)), constant(3.0, np.float32))  # 7/3*3 in float32
    results = [
        node("Div", negative, size[2]), node("Div", size[1], node("Neg", size[2])), node("Mod", negative, size[2]),
        node("Mod", negative, size[2], fmod=1), node("Cast", halves, to=TensorProto.INT64),
        node("Cast", node("Floor", halves), to=TensorProto.INT64), node("Cast", node("Ceil", halves), to=TensorProto.INT64),
        node("Cast", node("Round", halves), to=TensorProto.INT64), node("Cast", third, to=TensorProto.INT64),
        node("Cast", node("Pow", real[1], constant(0.5, np.float32)), to=TensorProto.INT64),
        node("Cast", node("Sqrt", node("Mul", real[2], real[2])), to=TensorProto.INT64),
        node("Max", negative, size[3]), node("Mul", size[1], size[3]), node("ReduceProd", node("Slice", shape, constant([1]), constant([4])), keepdims=0),
    ]  # fmt: skip
    vector = node("Concat", *[node("Unsqueeze", result, constant([0])) for result in results], axis=0)
    nodes.append(helper.make_node("Identity", [vector], ["sizes"]))
    nodes.append(helper.make_node("Identity", [node("Gather", shape, constant(0))], ["batch"]))
    if division_by_zero:
        nodes.append(helper.make_node("Identity", [node("Div", size[1], size[3])], ["by_zero"]))
    outputs = ["sizes", "batch", "by_zero"] if division_by_zero else ["sizes", "batch"]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
                              [helper.make_tensor_value_info(name, TensorProto.INT64, None) for name in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_folded_sizes_are_what_a_run_computes_at_edge_values():
    """rewrites.fold_static_sizes evaluates size arithmetic as ONNX Runtime would: truncating integer
    division, both Mods, casts of negative halves, float32 rounding. The Shape of a dynamic batch stays."""
    model = _size_arithmetic_model(["batch", 7, 2, 0])
    folded = copy.deepcopy(model)
    rewrites.fold_static_sizes(folded)
    assert sorted(node.op_type for node in folded.graph.node if node.op_type != "Constant") == ["Gather", "Identity", "Identity",
                                                                                                  "Shape"]  # fmt: skip
    x = np.zeros((3, 7, 2, 0), np.float32)
    run = lambda m: onnxruntime.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})  # noqa: E731
    np.testing.assert_array_equal(run(folded)[0], run(model)[0])
    np.testing.assert_array_equal(run(model)[0], [-3, -3, 1, -1, -3, -4, -3, -4, 7, 2, 2, 0, 0, 0])
    assert run(folded)[1] == 3


def test_a_division_by_a_size_of_zero_is_left_to_the_run():
    """numpy's integer division by 0 gives 0; ONNX Runtime's stops the process: never folded."""
    model = _size_arithmetic_model(["batch", 7, 2, 0], division_by_zero=True)
    rewrites.fold_static_sizes(model)
    producers = {node.output[0]: node for node in model.graph.node}
    assert producers[producers["by_zero"].input[0]].op_type == "Div"


def test_random_ops_and_module_tensors_are_never_folded():
    """A Bernoulli of constant probabilities draws anew at every run; a module's buffer can change."""
    nodes = [helper.make_node("Constant", [], ["half"], value=numpy_helper.from_array(np.full(4, 0.5, np.float32))),
             helper.make_node("Bernoulli", ["half"], ["draws"], name="draws"),
             helper.make_node("Mul", ["scale", "scale"], ["squared"], name="squared"),
             helper.make_node("Add", ["draws", "squared"], ["y"], name="y")]  # fmt: skip
    graph = helper.make_graph(nodes, "g", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
                              [numpy_helper.from_array(np.ones(4, np.float32), "scale")])  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    assert rewrites.fold_static_sizes(model, module_tensors={"scale"}) == []
    assert rewrites.fold_static_sizes(model) == ["squared"]


def test_a_tensor_only_an_inner_branch_reads_is_kept():
    """fold_static_sizes drops the nodes nothing reads; a tensor read only inside an If inside an If's branch
    is read (the conditions are graph inputs: nothing to decide)."""
    inner = helper.make_graph([helper.make_node("Identity", ["relu"], ["inner_y"])], "inner", [],
                              [helper.make_tensor_value_info("inner_y", TensorProto.FLOAT, None)])  # fmt: skip
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["other_y"])], "other", [],
                              [helper.make_tensor_value_info("other_y", TensorProto.FLOAT, None)])  # fmt: skip
    then_branch = helper.make_graph([helper.make_node("If", ["second"], ["then_y"], then_branch=inner, else_branch=other)],
                                    "then", [], [helper.make_tensor_value_info("then_y", TensorProto.FLOAT, None)])  # fmt: skip
    nodes = [helper.make_node("Relu", ["x"], ["relu"], name="relu"),
             helper.make_node("If", ["first"], ["y"], name="If", then_branch=then_branch, else_branch=other)]  # fmt: skip
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3]), helper.make_tensor_value_info("first", TensorProto.BOOL, []),
              helper.make_tensor_value_info("second", TensorProto.BOOL, [])]  # fmt: skip
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    assert rewrites.fold_static_sizes(model) == []
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.array([-1.0, 0.0, 2.0], np.float32)
    np.testing.assert_array_equal(session.run(None, {"x": x, "first": np.array(True), "second": np.array(True)})[0], [0, 0, 2])


# ---------------------------------------------------------------------------- grouped convolutions
def _conv_gradient_overflow(rank, groups, channels=8, batch=2, length=5):
    """Values ONNX Runtime's CPU ConvGrad writes past the end of the input gradient it is handed (a buffer twice as
    long, filled with a marker)."""
    spatial, kernel = [length] * rank, [1] * rank
    node = helper.make_node("ConvGrad", ["dY", "X", "W"], ["dX", "dW", "dB"], domain="com.microsoft", group=groups,
                            kernel_shape=kernel, pads=[0] * 2 * rank, strides=[1] * rank, dilations=[1] * rank)  # fmt: skip
    x_shape, w_shape = [batch, channels, *spatial], [channels, channels // groups, *kernel]
    graph = helper.make_graph([node], "conv_grad", [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape
                                                    in (("dY", x_shape), ("X", x_shape), ("W", w_shape))],
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("dX", "dW", "dB")])  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=8)  # fmt: skip
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    generator = np.random.default_rng(0)
    binding = session.io_binding()
    for name, shape in (("dY", x_shape), ("X", x_shape), ("W", w_shape)):
        binding.bind_cpu_input(name, generator.standard_normal(shape).astype(np.float32))
    size = int(np.prod(x_shape))
    buffer = torch.full((2 * size,), 7.0)
    binding.bind_output("dX", "cpu", 0, np.float32, x_shape, buffer.data_ptr())
    binding.bind_output("dW")
    binding.bind_output("dB")
    session.run_with_iobinding(binding)
    return int((buffer[size:] != 7.0).sum())


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_onnx_runtimes_grouped_conv_gradient_writes_past_its_end_in_1d_and_3d(rank):
    """The stack fact rewrites.convolutions.grouped_convolution works around (onnxruntime-training 1.19.2): each group clears
    C x (input length) values from its own start, so groups - 1 groups' worth of zeros land past the end; the 2-d
    kernel, and any ungrouped one, stay in bounds. A release that fixes it fails here: the rewrite can go."""
    assert _conv_gradient_overflow(rank, groups=1) == 0
    assert (_conv_gradient_overflow(rank, groups=4) > 0) == (rank != 2)


class GroupedConvolutions(nn.Module):
    """Grouped 1-d convolutions (depthwise with stride, and dilated without bias), an AvgPool1d (rewritten into a
    depthwise convolution) and a grouped 3-d convolution, all on the gradient path."""

    def __init__(self):
        super().__init__()
        self.depthwise = nn.Conv1d(8, 8, 3, stride=2, padding=1, groups=8)
        self.dilated = nn.Conv1d(8, 12, 3, padding=2, dilation=2, groups=4, bias=False)
        self.pool = nn.AvgPool1d(3, stride=2, padding=1, count_include_pad=False)
        self.volume = nn.Conv3d(4, 6, 3, padding=1, groups=2)
        self.head = nn.Linear(12 * 2 + 6 * 8, 3)

    def forward(self, sequence, volume):
        line = self.pool(self.dilated(torch.relu(self.depthwise(sequence)))).flatten(1)
        return self.head(torch.cat([line, self.volume(volume).mean(2).flatten(1)], 1))


def _grouped_conv_gradients(model: onnx.ModelProto) -> list:
    """(rank of W, group) of each ConvGrad with groups in a training graph."""
    inferred = onnx.shape_inference.infer_shapes(model)
    ranks = {info.name: len(info.type.tensor_type.shape.dim)
             for info in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]}  # fmt: skip
    ranks.update({init.name: len(init.dims) for init in model.graph.initializer})
    return [(ranks.get(node.input[2]), rewrites.node_attribute(node, "group", 1)) for node in model.graph.node
            if node.op_type == "ConvGrad" and rewrites.node_attribute(node, "group", 1) > 1]  # fmt: skip


@pytest.mark.parametrize("kernels", ["onnxruntime", "torch"])
def test_grouped_1d_and_3d_convolutions_train_like_torch_with_gradients_in_bounds(kernels, tmp_path):
    """Every grouped convolution whose gradient ONNX Runtime computes is 2-d (a 1-d one over a unit axis) or
    ungrouped (a 3-d one, per group); the model trains as torch, on ONNX Runtime's convolutions and on torch's."""
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(3, 8, 8, generator=generator), torch.randn(3, 4, 4, 4, 2, generator=generator),
                torch.randint(0, 3, (3,), generator=generator)) for _ in range(3)]  # fmt: skip
    path = tmp_path / "train.onnx"
    options = cpu_options({"utils": {"convolution_kernels": kernels},
                           "debug": {"graph_save_paths": {"model_with_training_graph_path": str(path)}}})  # fmt: skip
    torch.manual_seed(0)
    run_parity(GroupedConvolutions(), batches, optim.SGDConfig(lr=0.1), functools.partial(torch.optim.SGD, lr=0.1),
               loss_fn=F.cross_entropy, options=options)  # fmt: skip
    gradients = _grouped_conv_gradients(onnx.load(path))
    assert gradients and all(rank == 4 for rank, _ in gradients), gradients


# ---------------------------------------------------------------------------- auto_pad
def test_onnx_runtimes_conv_gradient_ignores_auto_pad():
    """The stack fact rewrites.convolutions.convolution_pads works around (onnxruntime-training 1.19.2): ConvGrad of a Conv with
    auto_pad SAME_UPPER pads by nothing, and its gradients are not those of the same Conv with the pads written out
    (which are torch's). A release that fixes it fails here: the rewrite can go."""
    generator = np.random.default_rng(0)
    shapes = {"dY": [2, 4, 5, 5], "X": [2, 4, 5, 5], "W": [4, 1, 3, 3]}
    feeds = {name: generator.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}

    def gradients(**padding):
        node = helper.make_node("ConvGrad", ["dY", "X", "W"], ["dX", "dW"], domain="com.microsoft", group=4,
                                kernel_shape=[3, 3], strides=[1, 1], dilations=[1, 1], **padding)  # fmt: skip
        graph = helper.make_graph([node], "conv_grad", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in shapes.items()],
                                  [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("dX", "dW")])  # fmt: skip
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                                  ir_version=8)  # fmt: skip
        return onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)

    x, w = (torch.from_numpy(feeds[name]).requires_grad_() for name in ("X", "W"))
    F.conv2d(x, w, padding=1, groups=4).backward(torch.from_numpy(feeds["dY"]))
    written_out = gradients(pads=[1, 1, 1, 1])
    np.testing.assert_allclose(written_out[0], x.grad.numpy(), atol=1e-4)
    np.testing.assert_allclose(written_out[1], w.grad.numpy(), atol=1e-4)
    assert not np.allclose(gradients(auto_pad="SAME_UPPER")[1], w.grad.numpy(), atol=1e-4)


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER", "VALID"])
@pytest.mark.parametrize("kernel, stride, dilation, length", [(3, 1, 1, 7), (4, 1, 1, 6), (3, 2, 1, 7), (4, 3, 1, 8), (2, 2, 1, 5)])
def test_a_conv_with_auto_pad_computes_the_same_with_its_pads_written_out(auto_pad, kernel, stride, dilation, length):
    """rewrites.convolutions.convolution_pads against ONNX Runtime's forward Conv, which follows auto_pad: odd and even kernels,
    strides that leave a remainder, both SAME rules (the odd pad at the end or the start). (Its forward refuses
    dilation with SAME; a dilated 'same' convolution trains against torch below.)"""
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="conv", auto_pad=auto_pad, kernel_shape=[kernel, kernel],
                            strides=[stride, stride], dilations=[dilation, dilation])  # fmt: skip
    generator = np.random.default_rng(1)
    values = {"x": generator.standard_normal((1, 2, length, length + 1)).astype(np.float32),
              "w": generator.standard_normal((3, 2, kernel, kernel)).astype(np.float32)}  # fmt: skip
    graph = helper.make_graph([node], "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, values["x"].shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [numpy_helper.from_array(values["w"], "w")])  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    rewritten = copy.deepcopy(model)
    assert rewrites.explicit_convolution_pads(rewritten) == ([] if auto_pad == "VALID" else ["conv"])
    assert all(rewrites.node_attribute(node, "auto_pad", "NOTSET") in ("NOTSET", "VALID") for node in rewritten.graph.node)
    expected, actual = (onnxruntime.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": values["x"]})[0]
                        for m in (model, rewritten))  # fmt: skip
    np.testing.assert_array_equal(actual, expected)


class SameConvolutions(nn.Module):
    """torch's padding='same' (exported as auto_pad SAME_UPPER): an odd kernel, an even dilated one, an even dilated
    grouped 1-d one."""

    def __init__(self):
        super().__init__()
        self.image = nn.Conv2d(3, 8, 3, padding="same")
        self.dilated = nn.Conv2d(3, 8, 2, padding="same", dilation=2)  # ONNX Runtime's forward refuses auto_pad with it
        self.line = nn.Conv1d(8, 8, 4, padding="same", dilation=2, groups=2)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.line(torch.relu(self.image(x) + self.dilated(x)).mean(2)).mean(-1))


@pytest.mark.parametrize("kernels", ["onnxruntime", "torch"])
def test_same_padded_convolutions_train_and_evaluate_like_torch(kernels):
    """On ONNX Runtime's convolutions the gradients were garbage (its ConvGrad ignores auto_pad), and a dilated one
    could not run at all; the check is off, so only the parity against torch's loop (eval_step included) decides."""
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, 3, 6, 7, generator=generator), torch.randint(0, 3, (2,), generator=generator)) for _ in range(3)]
    options = cpu_options({"utils": {"convolution_kernels": kernels}, "debug": {"check_against_torch": "off"}})
    torch.manual_seed(0)
    trainer, reference = run_parity(SameConvolutions(), batches, optim.SGDConfig(lr=0.1),
                                    functools.partial(torch.optim.SGD, lr=0.1), loss_fn=F.cross_entropy, options=options)  # fmt: skip
    x, label = batches[0]
    with torch.no_grad():
        expected = reference.eval()(x)
    torch.testing.assert_close(trainer.eval_step(x, label)[1], expected, atol=1e-5, rtol=1e-5)
