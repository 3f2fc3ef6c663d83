"""Convolutions run on torch's kernels between ONNX Runtime segments (orttrainer/runtime/torch_convolutions.py).

Through the public API: every kind of convolution torch can take trains and evaluates as a
plain torch loop does (loss and every state_dict key, step by step), inside and across
accumulation windows, at two batch sizes, with uneven ("same") padding and at boundary values.
The torch calls, the schedule and the choice of kernels (option and default) are checked on
their own.
"""

import copy
import functools
import warnings

import onnx
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import zoo
from onnx import TensorProto, helper
from boundary import FLOOR, KINKS, ULPS, edge_values, spread, upstream_like
from parity import assert_close_state, cpu_options, run_parity

from orttrainer import ORTTrainer, ORTTrainerOptions, optim
from orttrainer.runtime import torch_convolutions as split
from orttrainer.runtime import torch_ops

LR = 0.1


def kernels(choice, **extra):
    return cpu_options({"utils": {"convolution_kernels": choice}, **extra})


class EveryConvolution(nn.Module):
    """Conv1d/2d/3d with bias, stride, dilation, groups, depthwise, 1x1, a ConvTranspose2d (a Conv
    after orttrainer's rewrite) and BatchNorm + ReLU between them."""

    def __init__(self):
        super().__init__()
        self.line = nn.Conv1d(3, 4, 3, padding=1)
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(8)
        self.dilated = nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=2)
        self.depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.pointwise = nn.Conv2d(8, 16, 1)
        self.up = nn.ConvTranspose2d(16, 4, 2, stride=2)
        self.volume = nn.Conv3d(1, 2, (1, 3, 3), padding=(0, 1, 1))
        self.head = nn.Linear(4 + 4 + 2, 5)

    def forward(self, images):
        x = F.relu(self.norm(self.stem(images)))
        x = F.relu(self.dilated(x)) + x
        x = self.pointwise(F.relu(self.depthwise(x)))
        up = self.up(x).mean((2, 3))
        line = self.line(images.mean(2)).mean(2)
        volume = self.volume(images[:, :1].unsqueeze(1)).mean((2, 3, 4))
        return self.head(torch.cat([up, line, volume], 1))


def _image_batches(sizes, classes=5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 3, 8, 8, generator=generator), torch.randint(0, classes, (size,), generator=generator))
            for size in sizes]  # fmt: skip


def _last_runtime(trainer):
    graphs = trainer._graphs._graphs
    return list(graphs.values())[-1].runtime if isinstance(graphs, dict) else graphs[-1].runtime


def _assert_evaluates_like(trainer, reference, images, labels):
    """eval_step's loss and output equal the torch module's in eval mode."""
    reference.eval()
    with torch.no_grad():
        expected = reference(images)
    loss, output = trainer.eval_step(images, labels)
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, F.cross_entropy(expected, labels), atol=1e-5, rtol=1e-5)


def test_every_kind_of_convolution_trains_and_evaluates_like_torch():
    torch.manual_seed(0)
    batches = _image_batches([4, 4, 6, 4])  # a second batch size: the split graph serves other shapes too
    trainer, reference = run_parity(EveryConvolution(), batches, optim.SGDConfig(lr=LR),
                                    functools.partial(torch.optim.SGD, lr=LR), loss_fn=F.cross_entropy,
                                    options=kernels("torch"))  # fmt: skip
    session = _last_runtime(trainer).train_session
    assert isinstance(session, split.SplitSession)
    on_torch = [node.op_type for node in session._model.graph.node if node.name in session.on_torch
                and not torch_ops.runs_on_torch(node)]  # fmt: skip
    # 7 convolutions (the ConvTranspose's rewrite included), their gradients, the 3 ReLUs' and the BatchNorm's gradients
    assert sorted(on_torch) == ["BatchNormalizationGrad"] + ["Conv"] * 7 + ["ConvGrad"] * 7 + ["ReluGrad"] * 3
    _assert_evaluates_like(trainer, reference, *_image_batches([3], seed=1)[0])


def test_resnet_trains_like_torch_with_adam_and_every_convolution_on_torch():
    torch.manual_seed(0)
    model = zoo.ResNet()
    generator = torch.Generator().manual_seed(0)
    batches = [zoo.image_batch(4, generator=generator) for _ in range(3)]
    config = optim.AdamConfig(lr=1e-3, lambda_coef=0.0)
    adam = functools.partial(torch.optim.Adam, lr=1e-3)
    options = cpu_options({"utils": {"convolution_kernels": "torch", "grad_norm_clip": False}})
    trainer, _ = run_parity(model, batches, config, adam, loss_fn=F.cross_entropy, options=options)
    session = _last_runtime(trainer).train_session
    nodes = session._model.graph.node
    kinds = split.TORCH_OPS + ("ReluGrad", "BatchNormalizationGrad")
    assert {node.name for node in nodes if node.op_type in kinds} <= session.on_torch
    on_torch = {node.op_type for node in nodes if node.name in session.on_torch and not torch_ops.runs_on_torch(node)}
    assert on_torch == set(kinds)
    convolutions = sum(node.op_type in split.TORCH_OPS for node in nodes)
    assert session.segments <= convolutions / 2  # torch steps ready together share one gap between segments


def test_accumulation_window_averages_the_gradients_of_its_micro_batches_like_torch():
    """Inside a window the gradients go to scratch buffers (rebound between runs), also from torch's ConvGrad."""
    torch.manual_seed(0)
    model = zoo.ResNet()
    reference = copy.deepcopy(model)
    options = kernels("torch", batch={"gradient_accumulation_steps": 2})
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=LR), loss_fn=F.cross_entropy, options=options)
    generator = torch.Generator().manual_seed(3)
    halves = [zoo.image_batch(4, generator=generator) for _ in range(2)]
    for images, labels in halves:
        trainer.train_step(images, labels)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    for images, labels in halves:  # a window's update uses the mean of its micro-batches' gradients
        (F.cross_entropy(reference(images), labels) / len(halves)).backward()
    optimizer.step()
    assert_close_state(trainer, reference)


def test_eval_step_runs_the_convolutions_on_torch_and_matches_the_module():
    torch.manual_seed(0)
    model = zoo.ResNet()
    reference = copy.deepcopy(model).eval()
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.0), loss_fn=F.cross_entropy, options=kernels("torch"))
    images, labels = zoo.image_batch(5, generator=torch.Generator().manual_seed(4))
    trainer.train_step(images, labels)  # lr 0: weights unchanged, BatchNorm statistics updated as torch does
    reference.train()(images)
    _assert_evaluates_like(trainer, reference, images, labels)
    assert isinstance(_last_runtime(trainer).eval_session, split.SplitSession)


def test_the_choice_of_kernels_is_an_option_with_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"utils\.convolution_kernels.*must be one of \['auto', 'torch', 'onnxruntime'\]"):
        ORTTrainerOptions({"utils": {"convolution_kernels": "oneDNN"}})
    torch.manual_seed(0)
    saved = {"graph_save_paths": {"model_with_training_graph_after_optimization_path": str(tmp_path / "optimized.onnx")}}
    for choice, options in [("onnxruntime", kernels("onnxruntime")), ("one graph to save", kernels("torch", debug=saved)),
                            ("auto, small convolutions", cpu_options())]:  # fmt: skip
        trainer = ORTTrainer(zoo.ResNet(), None, optim.SGDConfig(lr=LR), loss_fn=F.cross_entropy, options=options)
        trainer.train_step(*zoo.image_batch(4, generator=torch.Generator().manual_seed(0)))
        assert not isinstance(_last_runtime(trainer).train_session, split.SplitSession), choice


def test_auto_splits_graphs_whose_work_is_in_larger_convolutions():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 3, 32, 32, generator=generator), torch.randint(0, 10, (4,), generator=generator))]
    trainer, _ = run_parity(model, batches, optim.SGDConfig(lr=LR), functools.partial(torch.optim.SGD, lr=LR),
                            loss_fn=F.cross_entropy)  # fmt: skip
    assert isinstance(_last_runtime(trainer).train_session, split.SplitSession)


def _lenet():
    """LeNet-sized: two small convolutions (~0.12M multiply-accumulates each per 28x28 image)."""
    return nn.Sequential(nn.Conv2d(1, 6, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(16 * 4 * 4, 10))  # fmt: skip


def _small_but_many():
    """Depthwise and 1x1 convolutions, each small (~0.3M multiply-accumulates per 32x32 image on average), ~6M in all."""
    blocks = ((16, 64, 24, 2), (24, 72, 24, 1), (24, 96, 40, 2), (40, 120, 40, 1))
    return zoo.MobileNetV3(classes=10, blocks=blocks, stem_stride=1)


@pytest.mark.parametrize("make_model, channels, size, batch, split_expected",
                         [(_lenet, 1, 28, 8, False), (_lenet, 1, 28, 64, True),
                          (_small_but_many, 3, 32, 2, False), (_small_but_many, 3, 32, 16, True)],
                         ids=["lenet-8", "lenet-64", "small-but-many-2", "small-but-many-16"])  # fmt: skip
def test_auto_splits_when_the_first_batch_gives_each_convolution_enough_work(make_model, channels, size, batch,
                                                                              split_expected):  # fmt: skip
    """Each convolution on torch adds boundaries that cost the same at any batch size, while what torch's
    kernels save grows with the batch: "auto" splits when the convolutions average 3M multiply-accumulates
    or more each on the first batch (benchmarks/NOTES.md §34: the faster choice at these sizes)."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    images, labels = torch.randn(batch, channels, size, size, generator=generator), torch.randint(0, 10, (batch,), generator=generator)
    trainer = ORTTrainer(make_model(), None, optim.SGDConfig(lr=LR), loss_fn=F.cross_entropy, options=cpu_options())
    trainer.train_step(images, labels)
    assert isinstance(_last_runtime(trainer).train_session, split.SplitSession) == split_expected


def test_mobilenet_trains_like_torch_with_hardswish_hardsigmoid_and_their_gradients_on_torch():
    """SGD: a block's output bias feeds the next block's BatchNorm, so its exact gradient is 0 and what
    each side computes is rounding noise, which Adam would scale up to a full step."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    batches = [zoo.image_batch(4, generator=generator) for _ in range(3)]
    trainer, reference = run_parity(zoo.MobileNetV3(), batches, optim.SGDConfig(lr=LR),
                                    functools.partial(torch.optim.SGD, lr=LR), loss_fn=F.cross_entropy,
                                    options=kernels("torch"))  # fmt: skip
    session = _last_runtime(trainer).train_session
    on_torch = [node.op_type for node in session._model.graph.node if node.name in session.on_torch]
    hard_swishes = sum(isinstance(module, nn.Hardswish) for module in reference.modules())
    assert on_torch.count("HardSwish") == on_torch.count(split.HARD_SWISH_GRADIENT) == hard_swishes
    gates = sum(isinstance(module, zoo.SqueezeExcite) for module in reference.modules())  # F.hardsigmoid in each
    assert on_torch.count("HardSigmoid") == on_torch.count(split.HARD_SIGMOID_GRADIENT) == gates > 0
    assert not any(kind in node.name and node.name not in session.on_torch for node in session._model.graph.node
                   for kind in ("HardSwish_Grad/", "HardSigmoid_Grad/"))  # fmt: skip
    _assert_evaluates_like(trainer, reference, *zoo.image_batch(3, generator=generator))


def _hard_swish_gradient_nodes(forward_name, x, dy, dx):
    """The nodes the gradient builder makes from defined_gradients' HardSwish definition (constants as initializers)."""
    from orttrainer.graph import defined_gradients

    prefix = f"{forward_name}_Grad/"
    nodes, constants = [], []
    for index, (op_type, inputs, outputs, *attributes) in enumerate(defined_gradients.GRADIENT_DEFINITIONS["HardSwish"]):
        if op_type == "Constant":
            value = attributes[0]["value"]["value"]
            constants.append(helper.make_tensor(prefix + outputs[0], TensorProto.FLOAT, [], [value]))
            continue
        named = [{"I(0)": x, "GO(0)": dy, "GI(0)": dx}.get(name, prefix + name) for name in inputs + outputs]
        nodes.append(helper.make_node(op_type, named[: len(inputs)], named[len(inputs) :], name=f"{prefix}{op_type}_{index}"))
    return nodes, constants


@pytest.mark.parametrize("also_read", [None, "slope"], ids=["collapsed", "intermediate-read-elsewhere-kept"])
def test_hard_swish_gradient_nodes_collapse_only_when_they_read_x_and_dy_and_hand_on_dx(also_read):
    forward = helper.make_node("HardSwish", ["x"], ["y"], name="act")
    gradient, constants = _hard_swish_gradient_nodes("act", "x", "dy", "dx")
    prefix = "act_Grad/"
    reader = [helper.make_node("Identity", [prefix + also_read], ["seen"], name="reader")] if also_read else []
    outputs = ["y", "dx"] + (["seen"] if also_read else [])
    graph = helper.make_graph([forward, *gradient, *reader], "g",
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, [2]) for name in ("x", "dy")],
                              [helper.make_empty_tensor_value_info(name) for name in outputs], constants)  # fmt: skip
    model = helper.make_model(graph)
    collapsed = split.collapse_defined_gradients(model)
    kinds = [node.op_type for node in model.graph.node]
    if also_read:
        assert collapsed == 0 and len(kinds) == 1 + len(gradient) + 1
    else:
        assert collapsed == 1 and kinds == ["HardSwish", split.HARD_SWISH_GRADIENT]
        assert list(model.graph.node[1].input) == ["dy", "x"] and list(model.graph.node[1].output) == ["dx"]


@pytest.mark.parametrize("kernel_size, dims", [(2, 2), (4, 2), ((2, 3), 2), (2, 1)])
def test_same_padding_with_an_even_kernel_trains_like_torch(kernel_size, dims):
    """The exporter writes "same" padding as auto_pad SAME_UPPER, which pads an even kernel more at the end.
    ONNX Runtime's ConvGrad got the weight gradient of such a Conv wrong (the built-in check refused it);
    torch's call pads a copy of the input, as torch's nn.Conv2d does."""
    conv = nn.Conv2d if dims == 2 else nn.Conv1d

    class Same(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = conv(3, 4, kernel_size, padding="same")
            self.other = conv(4, 4, 3, padding=1)
            self.head = nn.Linear(4, 5)

        def forward(self, images):
            x = self.other(F.relu(self.conv(images)))
            return self.head(x.flatten(2).mean(2))

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 3, *([7] * dims), generator=generator), torch.randint(0, 5, (4,), generator=generator))
               for _ in range(2)]  # fmt: skip
    with warnings.catch_warnings():  # torch's note that "same" with an even kernel copies the input
        warnings.filterwarnings("ignore", message="Using padding='same' with even kernel lengths")
        trainer, _ = run_parity(Same(), batches, optim.SGDConfig(lr=LR), functools.partial(torch.optim.SGD, lr=LR),
                                loss_fn=F.cross_entropy, options=kernels("torch"))  # fmt: skip
    session = _last_runtime(trainer).train_session
    assert all(n.name in session.on_torch for n in session._model.graph.node if n.op_type in split.TORCH_OPS)


class NormalizedBranches(nn.Module):
    """BatchNorm without affine weights, with frozen ones, BatchNorm1d after a Conv1d, and one activation
    read by three convolutions (a Sum of three gradients torch computed)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6, affine=False), nn.ReLU())
        self.left = nn.Sequential(nn.Conv2d(6, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU())
        self.right = nn.Sequential(nn.Conv2d(6, 6, 1), nn.BatchNorm2d(6))
        self.right[1].requires_grad_(False)
        self.skip = nn.Conv2d(6, 6, 1)
        self.line = nn.Sequential(nn.Conv1d(6, 4, 3), nn.BatchNorm1d(4), nn.ReLU())
        self.head = nn.Linear(6 + 4, 5)

    def forward(self, images):
        x = self.stem(images)
        x = self.left(x) + self.right(x) + self.skip(x)
        line = self.line(x.mean(2)).mean(2)
        return self.head(torch.cat([x.mean((2, 3)), line], 1))


def test_batch_norm_variants_and_residual_sums_train_like_torch():
    torch.manual_seed(0)
    trainer, _ = run_parity(NormalizedBranches(), _image_batches([4, 4, 6]), optim.SGDConfig(lr=LR),
                            functools.partial(torch.optim.SGD, lr=LR), loss_fn=F.cross_entropy, options=kernels("torch"))  # fmt: skip
    session = _last_runtime(trainer).train_session
    on_torch = [node for node in session._model.graph.node if node.name in session.on_torch]
    assert sum(node.op_type == "BatchNormalizationGrad" for node in on_torch) == 4
    assert any(node.op_type == "Sum" and len(node.input) == 3 for node in on_torch)


@pytest.mark.parametrize("normalized", [False, True], ids=["conv-relu", "conv-batchnorm-relu"])
@pytest.mark.parametrize("value", [0.0, 1e-40, -1e-40, 3e38, -3e38, float("inf"), float("-inf"), float("nan")])
def test_boundary_values_pass_through_the_torch_convolutions_as_in_torch(value, normalized, request):
    """Loss and weight gradients of a conv model fed a boundary value: as torch's (float32, what the trainer
    claims to equal; overflow and NaN included), and as float64 torch's where that is finite in float32."""
    if normalized and abs(value) == 3e38:  # ONNX Runtime's BatchNormalization squares in float32 (docs/stack_facts.md)
        request.applymarker(pytest.mark.xfail(strict=True, reason="ONNX Runtime's batch variance overflows: NaN, torch finite"))
    torch.manual_seed(0)
    norm = [nn.BatchNorm2d(4)] if normalized else []
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), *norm, nn.ReLU(), nn.Conv2d(4, 2, 1), nn.Flatten())
    images = torch.randn(2, 3, 4, 4)
    images[0, 1, 2, 2] = value
    images[1, :, 0, :] = value
    target = torch.randn(2, 32)
    initial = copy.deepcopy(model.state_dict())
    references = {dtype: copy.deepcopy(model).to(dtype) for dtype in (torch.float32, torch.float64)}
    losses = {dtype: F.mse_loss(module(images.to(dtype)), target.to(dtype)) for dtype, module in references.items()}
    for loss in losses.values():
        loss.backward()
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=1.0), loss_fn=F.mse_loss,
                         options=kernels("torch", debug={"check_against_torch": "off"}))  # fmt: skip
    loss = trainer.train_step(images, target)[0]
    state = trainer.state_dict(pytorch_format=True)
    gradients = {name: initial[name] - state[name] for name in initial}  # lr 1: the change is the gradient
    for dtype, reference in references.items():
        expected_loss = losses[dtype].detach().float()
        if dtype == torch.float64 and not torch.isfinite(losses[torch.float32]):
            continue
        torch.testing.assert_close(loss, expected_loss, atol=1e-5, rtol=1e-4, equal_nan=True)
        for name, parameter in reference.named_parameters():
            torch.testing.assert_close(gradients[name], parameter.grad.float(), atol=1e-4, rtol=1e-4, equal_nan=True,
                                       msg=lambda m: f"{dtype} {name}: {m}")  # fmt: skip


class ShiftedActivation(nn.Module):
    """activation(x + shift) -> 1x1 conv: with one image, the shift's gradient is the activation's input gradient
    (torch's ``hardswish_backward`` or ``hardsigmoid_backward`` in the split) and the conv's weight gradient reads
    its output."""

    def __init__(self, shape, activation):
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(shape))
        self.conv = nn.Conv2d(shape[0], 2, 1)
        self.activation = activation

    def forward(self, x):
        return self.conv(self.activation(x + self.shift)).flatten(1)


@pytest.mark.parametrize("activation, forward, gradient", [(F.hardswish, "HardSwish", split.HARD_SWISH_GRADIENT),
                                                           (F.hardsigmoid, "HardSigmoid", split.HARD_SIGMOID_GRADIENT),
                                                           (nn.ReLU6(inplace=True), "Clip", "Greater"),
                                                           (nn.Hardtanh(-2.0, 0.5), "Clip", "Less")],
                         ids=["hardswish", "hardsigmoid", "relu6", "hardtanh"])  # fmt: skip
def test_activations_on_torch_at_their_kinks_and_edges_give_torchs_values_and_gradients(activation, forward, gradient):
    """Also at hardtanh's bounds (6, 0.5, -2 and the edge values' 0 and ±1), where its gradient is 0 (clamp's is not)."""
    values = edge_values(*KINKS, 6.0, -2.0, 0.5, *spread(1e-3, 10))
    images = torch.from_numpy(values).reshape(1, 1, -1, 1)
    torch.manual_seed(0)
    model = ShiftedActivation(images.shape[1:], activation)
    initial = copy.deepcopy(model.state_dict())
    upstream = torch.from_numpy(upstream_like((1, 2 * len(values))))
    references = {dtype: copy.deepcopy(model).to(dtype) for dtype in (torch.float32, torch.float64)}
    for dtype, module in references.items():
        (module(images.to(dtype)) * upstream.to(dtype)).sum().backward()
    # the shift holds the image's size, which model_desc fixes: with it free, the shift's broadcast gradient leaves
    # shape arithmetic (Tile) beside the Clip, in a segment ONNX Runtime runs
    model_desc = {"inputs": [("x", list(images.shape)), ("label", list(upstream.shape))],
                  "outputs": [("loss", [], True), ("output", list(upstream.shape))]}
    trainer = ORTTrainer(model, model_desc, optim.SGDConfig(lr=1.0), loss_fn=lambda output, weights: (output * weights).sum(),
                         options=kernels("torch", debug={"check_against_torch": "off"}))  # fmt: skip
    trainer.train_step(images, upstream)
    session = _last_runtime(trainer).train_session
    assert {gradient, forward} <= {node.op_type for node in session._model.graph.node if node.name in session.on_torch}
    state = trainer.state_dict(pytorch_format=True)
    for name, parameter in references[torch.float32].named_parameters():  # torch's own float32 kernels: equal
        torch.testing.assert_close(initial[name] - state[name], parameter.grad, atol=0, rtol=0, equal_nan=True,
                                   msg=lambda m: f"{name}: {m}")  # fmt: skip
    gradient = (initial["shift"] - state["shift"]).flatten()  # float64 torch, where finite
    expected = references[torch.float64].shift.grad.flatten().float()
    finite = torch.isfinite(expected)
    torch.testing.assert_close(gradient[finite], expected[finite], atol=float(FLOOR), rtol=ULPS * 2**-23)


class ShiftedMaxPool(nn.Module):
    """max_pool(x + shift) -> 1x1 conv, as ShiftedActivation: the shift's gradient is the pooling's input gradient."""

    def __init__(self, shape, pool):
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(shape))
        self.pool = pool
        self.conv = getattr(nn, f"Conv{len(shape) - 1}d")(shape[0], 2, 1)

    def forward(self, x):
        return self.conv(self.pool(x + self.shift)).flatten(1)


@pytest.mark.parametrize("pool, shape", [
    (nn.MaxPool2d(2), (1, 6, 6)),
    (nn.MaxPool2d(3, stride=1, padding=1), (1, 6, 6)),  # overlapping windows: a maximum's gradients add up
    (nn.MaxPool2d(3, stride=2, padding=1, dilation=2, ceil_mode=True), (1, 8, 8)),
    (nn.MaxPool1d(3, stride=2, padding=1), (2, 19)),
    (nn.MaxPool3d((1, 2, 2)), (1, 2, 6, 6)),
], ids=["2x2", "3x3-overlapping", "dilated-ceil-mode", "1d", "3d"])  # fmt: skip
def test_max_pool_on_torch_at_edge_values_gives_torchs_values_and_gradients(pool, shape):
    """Ties (the first maximum wins), -inf windows, ±0, NaN (torch's kernel returns it, ONNX Runtime's skips
    it): the split runs torch's own kernels, so every gradient equals torch's float32 one exactly."""
    values = torch.from_numpy(edge_values(*KINKS))
    torch.manual_seed(0)
    images = torch.randn(2, *shape)
    flat = images.view(-1)
    flat[: 3 * len(values)] = torch.cat([values, values, torch.ones(len(values))])[torch.randperm(3 * len(values))]
    model = ShiftedMaxPool(shape, pool)
    initial = copy.deepcopy(model.state_dict())
    reference = copy.deepcopy(model)
    upstream = torch.from_numpy(upstream_like(reference(images).shape))
    (reference(images) * upstream).sum().backward()
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=1.0), loss_fn=lambda output, weights: (output * weights).sum(),
                         options=kernels("torch", debug={"check_against_torch": "off"}))  # fmt: skip
    trainer.train_step(images, upstream)
    session = _last_runtime(trainer).train_session
    assert {"MaxPool", split.MAX_POOL_GRADIENT} <= {node.op_type for node in session._model.graph.node
                                                    if node.name in session.on_torch}  # fmt: skip
    state = trainer.state_dict(pytorch_format=True)
    for name, parameter in reference.named_parameters():
        torch.testing.assert_close(initial[name] - state[name], parameter.grad, atol=0, rtol=0, equal_nan=True,
                                   msg=lambda m: f"{name}: {m}")  # fmt: skip


def test_cnn_with_max_pool_on_torch_trains_and_evaluates_like_torch():
    from models import CNN, cnn_batch

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    batches = [cnn_batch(size, generator) for size in (4, 4, 6)]
    trainer, reference = run_parity(CNN(), batches, optim.SGDConfig(lr=LR), functools.partial(torch.optim.SGD, lr=LR),
                                    loss_fn=F.cross_entropy, options=kernels("torch"))  # fmt: skip
    session = _last_runtime(trainer).train_session
    assert sum(session._model.graph.node[index].op_type == "MaxPool" for index in range(len(session._model.graph.node))
               if session._model.graph.node[index].name in session.on_torch) == 2  # fmt: skip
    _assert_evaluates_like(trainer, reference, *cnn_batch(5, generator))


def test_size_one_spatial_dims_train_like_torch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.Flatten(), nn.Linear(4, 2))
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(3, 3, 1, 1, generator=generator), torch.randint(0, 2, (3,), generator=generator)) for _ in range(2)]
    trainer, _ = run_parity(model, batches, optim.SGDConfig(lr=LR), functools.partial(torch.optim.SGD, lr=LR),
                            loss_fn=F.cross_entropy, options=kernels("torch"))  # fmt: skip
    assert isinstance(_last_runtime(trainer).train_session, split.SplitSession)


# ------------------------------------------------------------------ the parts on their own
@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER", "VALID", "NOTSET"])
@pytest.mark.parametrize("size", [5, 6])
def test_torch_call_computes_the_onnx_conv_and_its_gradient(auto_pad, size):
    """One Conv node with each padding rule, stride 2 and an even kernel: torch's call against ONNX Runtime's
    Conv forward, and its ConvGrad against torch autograd through the same padding."""
    import onnxruntime

    pads = {"pads": [0, 1, 1, 2]} if auto_pad == "NOTSET" else {}
    attributes = dict(kernel_shape=[2, 3], strides=[2, 2], auto_pad=auto_pad, **pads)
    conv = helper.make_node("Conv", ["x", "w"], ["y"], name="conv", **attributes)
    grad = helper.make_node("ConvGrad", ["dy", "x", "w"], ["dx", "dw", ""], name="grad", domain="com.microsoft", **attributes)
    torch.manual_seed(0)
    x, w = torch.randn(2, 3, size, size), torch.randn(4, 3, 2, 3)
    y = split._Convolution(conv).run({"x": x, "w": w})["y"]
    graph = helper.make_graph([conv], "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "xw"],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])  # fmt: skip
    onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    expected = onnxruntime.InferenceSession(onnx_model.SerializeToString()).run(None, {"x": x.numpy(), "w": w.numpy()})[0]
    torch.testing.assert_close(y, torch.from_numpy(expected), atol=1e-5, rtol=1e-5)

    dy = torch.randn(y.shape)
    gradients = split._Convolution(grad).run({"dy": dy, "x": x, "w": w})
    assert set(gradients) == {"dx", "dw"}
    padding, extra = split._Convolution(conv)._padding(x)
    x_ = x.clone().requires_grad_()
    w_ = w.clone().requires_grad_()
    torch.convolution(split._Convolution._padded(x_, extra), w_, None, [2, 2], padding, [1, 1], False, [0, 0], 1).backward(dy)
    torch.testing.assert_close(gradients["dx"], x_.grad)
    torch.testing.assert_close(gradients["dw"], w_.grad)



@pytest.mark.parametrize("dims", [1, 2, 3])
def test_torch_max_pool_hands_on_onnx_runtimes_indices(dims):
    """The indices the torch MaxPool step hands on are ONNX Runtime's (flat over the whole input), and the gradient
    step reads them back."""
    import onnxruntime

    attributes = dict(kernel_shape=[3] * dims, strides=[2] * dims, pads=[1] * 2 * dims)
    node = helper.make_node("MaxPool", ["x"], ["y", "indices"], name="pool", **attributes)
    torch.manual_seed(0)
    x = torch.randn(2, 3, *[7] * dims)
    produced = split._MaxPool(node).run({"x": x})
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("indices", TensorProto.INT64, None)])  # fmt: skip
    onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    y, indices = onnxruntime.InferenceSession(onnx_model.SerializeToString()).run(None, {"x": x.numpy()})
    assert torch.equal(produced["y"], torch.from_numpy(y)) and torch.equal(produced["indices"], torch.from_numpy(indices))
    grad = helper.make_node(split.MAX_POOL_GRADIENT, ["dy", "indices", "x"], ["dx"], name="grad", **attributes)
    dy = torch.randn(y.shape)
    x_ = x.clone().requires_grad_()
    getattr(F, f"max_pool{dims}d")(x_, 3, 2, 1).backward(dy)
    assert torch.equal(split._MaxPoolGradient(grad).run({"dy": dy, "indices": produced["indices"], "x": x})["dx"], x_.grad)


def _node(op, inputs, output):
    return helper.make_node(op, inputs, [output], name=output)


def test_schedule_puts_every_ready_convolution_in_one_gap_and_keeps_dependencies():
    # two independent branches, each Relu -> Conv -> Relu: both convolutions run in one gap
    nodes = [_node("Relu", ["x"], "a1"), _node("Conv", ["a1", "w"], "c1"), _node("Relu", ["c1"], "b1"),
             _node("Relu", ["x"], "a2"), _node("Conv", ["a2", "w"], "c2"), _node("Relu", ["c2"], "b2"),
             _node("Add", ["b1", "b2"], "y")]  # fmt: skip
    steps = split.schedule(nodes, lambda node: node.op_type == "Conv")
    shape = [[n.name for n in step] if isinstance(step, list) else step.name for step in steps]
    assert shape == [["a1", "a2"], "c1", "c2", ["b1", "b2", "y"]]
    done = {"x", "w"}
    for step in steps:
        for node in step if isinstance(step, list) else [step]:
            assert set(node.input) <= done, node.name
            done |= set(node.output)


def test_graphs_the_split_cannot_cut_are_left_whole():
    conv = helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[1, 1, 1, 1], kernel_shape=[3, 3])
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("x", "w")]

    def model(nodes, outputs=("y",), elem_type=TensorProto.FLOAT):
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(i.name, elem_type, None) for i in inputs],
                                  [helper.make_tensor_value_info(name, elem_type, None) for name in outputs])  # fmt: skip
        return helper.make_model(graph)

    assert split.can_split(model([conv]))
    assert not split.can_split(model([conv], elem_type=TensorProto.FLOAT16))  # torch's CPU convolutions: float32/64
    assert not split.can_split(model([conv], outputs=("y", "x")))  # an output no node computes
    unnamed = onnx.NodeProto()
    unnamed.CopyFrom(conv)
    unnamed.name = ""
    assert not split.can_split(model([unnamed]))  # kernel choices are remembered by node name
    assert not split.torch_can_run(helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3], pads=[-1, 0, 0, 0]))
    assert not split.torch_can_run(helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1]))  # no kernel_shape
