"""Slow CPU kernels replaced by fast equivalents: same values as the kernels they replace.

Each case runs a small graph with the original onnxruntime-training kernel and the same
graph after ``use_fast_cpu_kernels``, on inputs that reach the edge cases (ignored labels,
zeros at the ReLU kink, overlapping pooling windows), and checks the original op is gone.
The trainer-level effect (training graphs use the replacements, parity with torch) is
checked at the end and by every parity test that uses these ops.
"""

import copy

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper
from models import SEQ, VOCAB, Encoder, TokenTagger, lm_loss
from parity import cpu_options, run_parity

from orttrainer import ORTTrainer, optim
from orttrainer.graph.cpu_kernels import WIDE_LAYER_NORM, use_fast_cpu_kernels

MS = "com.microsoft"


def _run(model, feeds):
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _compare(nodes, inputs, outputs, feeds, replaced_op, atol=1e-6, output_shapes=None):
    """Run ``nodes`` as they are and with fast kernels; outputs must agree.

    MaxPoolGrad takes its output shape from the graph (``output_shapes``), and crashes
    without one.
    """
    for number, node in enumerate(nodes):
        node.name = f"{node.op_type}_{number}"
    graph = helper.make_graph(
        nodes, "case", [helper.make_tensor_value_info(name, dtype, shape) for name, dtype, shape in inputs],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, (output_shapes or {}).get(name)) for name in outputs],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    model.ir_version = 8
    fast = copy.deepcopy(model)
    assert use_fast_cpu_kernels(fast), "nothing was replaced"
    assert replaced_op not in {node.op_type for node in fast.graph.node}
    for expected, actual, name in zip(_run(model, feeds), _run(fast, feeds), outputs):
        np.testing.assert_allclose(actual, expected, atol=atol, rtol=1e-5, err_msg=name)


def _labels(shape, classes, ignored, generator):
    labels = generator.integers(0, classes, shape).astype(np.int64)
    labels.reshape(-1)[::3] = ignored  # every third label ignored
    return labels


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("spatial", [(), (5,)])
@pytest.mark.parametrize("ignore_index", [None, -100, 2])
def test_softmax_cross_entropy_and_its_gradient(reduction, spatial, ignore_index):
    generator = np.random.default_rng(0)
    batch, classes = 6, 7
    logits = (generator.standard_normal((batch, classes, *spatial)) * 3).astype(np.float32)
    labels = _labels((batch, *spatial), classes, -100 if ignore_index is None else ignore_index, generator)
    if ignore_index is None:
        labels[labels < 0] = 1
    loss_shape = [batch, *spatial] if reduction == "none" else []
    loss_grad = generator.standard_normal(loss_shape).astype(np.float32)
    attributes = {"reduction": reduction} | ({} if ignore_index is None else {"ignore_index": ignore_index})
    nodes = [
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss", "log_prob"], **attributes),
        helper.make_node("SoftmaxCrossEntropyLossGrad", ["loss_grad", "log_prob", "labels"], ["logits_grad"], domain=MS, **attributes),
    ]
    inputs = [("logits", TensorProto.FLOAT, logits.shape), ("labels", TensorProto.INT64, labels.shape),
              ("loss_grad", TensorProto.FLOAT, loss_shape)]  # fmt: skip
    feeds = {"logits": logits, "labels": labels, "loss_grad": loss_grad}
    _compare(nodes, inputs, ["loss", "log_prob", "logits_grad"], feeds, "SoftmaxCrossEntropyLossGrad")


@pytest.mark.parametrize("op_type", ["GeluGrad", "BiasGeluGrad_dX", "FastGeluGrad", "BiasFastGeluGrad_dX"])
def test_gelu_gradient(op_type):
    """The erf GELU's gradient and its tanh approximation's, with and without bias."""
    generator = np.random.default_rng(1)
    x = (generator.standard_normal((4, 16, 32)) * 3).astype(np.float32)
    x.reshape(-1)[:7] = [0.0, -8.0, 8.0, 1e-8, -30.0, 1e4, -1e4]
    feeds = {"dy": generator.standard_normal(x.shape).astype(np.float32), "x": x}
    inputs = [("dy", TensorProto.FLOAT, x.shape), ("x", TensorProto.FLOAT, x.shape)]
    if op_type.startswith("Bias"):
        feeds["bias"] = generator.standard_normal(32).astype(np.float32)
        inputs.append(("bias", TensorProto.FLOAT, [32]))
    node = helper.make_node(op_type, [name for name, _, _ in inputs], ["dx"], domain=MS)
    _compare([node], inputs, ["dx"], feeds, node.op_type, atol=2e-6)


def test_relu_gradient():
    generator = np.random.default_rng(2)
    x = generator.standard_normal((8, 300)).astype(np.float32)
    x[:, ::7] = 0.0  # the kink: no gradient, as in torch
    feeds = {"dy": generator.standard_normal(x.shape).astype(np.float32), "x": x}
    node = helper.make_node("ReluGrad", ["dy", "x"], ["dx"], domain=MS)
    _compare([node], [("dy", TensorProto.FLOAT, x.shape), ("x", TensorProto.FLOAT, x.shape)], ["dx"], feeds, "ReluGrad", atol=0)


@pytest.mark.parametrize("kernel, stride, pads", [(2, 2, 0), (3, 2, 1), (3, 1, 1)])
def test_max_pool_gradient(kernel, stride, pads):
    generator = np.random.default_rng(3)
    x = generator.standard_normal((3, 4, 9, 9)).astype(np.float32)
    attributes = {"kernel_shape": [kernel, kernel], "strides": [stride, stride], "pads": [pads] * 4}
    out = (9 + 2 * pads - kernel) // stride + 1
    nodes = [
        helper.make_node("MaxPool", ["x"], ["y", "indices"], **attributes),
        helper.make_node("MaxPoolGrad", ["dy", "indices"], ["dx"], **attributes),
    ]
    feeds = {"x": x, "dy": generator.standard_normal((3, 4, out, out)).astype(np.float32)}
    inputs = [("x", TensorProto.FLOAT, x.shape), ("dy", TensorProto.FLOAT, [3, 4, out, out])]
    _compare(nodes, inputs, ["dx"], feeds, "MaxPoolGrad", output_shapes={"dx": x.shape})


def _layer_norm_rows(shape, normalized_dims, generator, nonfinite=False):
    """x over ``shape`` whose rows (the ``normalized_dims`` trailing dims) reach LayerNorm's edges:
    a constant row (variance 0), huge and tiny magnitudes, an exact tie, ±0; with ``nonfinite``
    also a row holding ±inf and one holding NaN."""
    x = generator.standard_normal(shape).astype(np.float32)
    rows = x.reshape(-1, int(np.prod(shape[-normalized_dims:])))
    row = generator.standard_normal(rows.shape[1])
    edges = [np.full(rows.shape[1], 3.0), row * 1e18, row * 1e-30, np.where(row > 0, 1.0, -1.0), np.zeros(rows.shape[1]),
             -np.zeros(rows.shape[1])]  # fmt: skip
    if nonfinite:
        edges += [np.where(row > 1, np.inf, np.where(row < -1, -np.inf, row)), np.where(row > 1, np.nan, row)]
    for index, row in enumerate(edges[: len(rows)]):
        rows[index] = row
    return x


def _layer_norm_gradient_case(shape, normalized_dims, outputs, generator, nonfinite=False):
    """(one-node LayerNormalizationGrad model, its feeds): the forward's float32 statistics of x;
    with ``nonfinite`` also inf and NaN in x (``_layer_norm_rows``) and an inf in dy's last row."""
    x = _layer_norm_rows(shape, normalized_dims, generator, nonfinite)
    normalized = list(shape[-normalized_dims:])
    scale = generator.standard_normal(normalized).astype(np.float32)
    _, mean, inverse_std = torch.ops.aten.native_layer_norm(torch.from_numpy(x), normalized, None, None, 1e-5)
    stat_shape = list(mean.shape)
    dy = generator.standard_normal(shape).astype(np.float32)
    if nonfinite:
        dy.reshape(-1)[-1] = np.inf  # a finite row of x: its dx is NaN, the bias gradient's column inf
    feeds = {"dy": dy, "x": x, "scale": scale, "mean": mean.numpy(), "inverse_std": inverse_std.numpy()}
    inputs = [("dy", shape), ("x", shape), ("scale", normalized), ("mean", stat_shape), ("inverse_std", stat_shape)]
    node = helper.make_node("LayerNormalizationGrad", [name for name, _ in inputs], outputs, name="grad", domain=MS,
                            axis=-normalized_dims)  # fmt: skip
    graph = helper.make_graph([node], "case", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs])  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    model.ir_version = 8
    return model, feeds


@pytest.mark.parametrize("shape, normalized_dims, outputs, nonfinite", [
    ((4, 3, 512), 1, ["dx", "dscale", "dbias"], False),
    ((6, 2, 256), 2, ["dx", "dscale", "dbias"], False),
    ((1, 600), 2, ["dx", "dscale", "dbias"], False),  # every axis normalized: one row, a constant one (variance 0)
    ((4, 3, 512), 1, ["dx", "dscale"], False),  # LayerNorm without bias
    ((4, 3, 512), 1, ["dx", "dscale", "dbias"], True),  # rows with ±inf and NaN, an inf in dy
])  # fmt: skip
def test_layer_norm_gradient_at_edge_values(shape, normalized_dims, outputs, nonfinite):
    """LayerNormalizationGrad replaced: dx, d scale, d bias equal torch's native_layer_norm_backward in
    float64 on the same inputs (the forward's float32 mean and inverse standard deviation), to float32
    rounding of each row's largest finite value (dx sums to 0 over a row, so its entries cancel);
    NaN and ±inf where torch's are. Known difference, ONNX Runtime's own kernel's too: in the row of
    dx whose dy holds an inf, half the entries are -inf where torch's are all NaN (non-finite both)."""
    model, feeds = _layer_norm_gradient_case(shape, normalized_dims, outputs, np.random.default_rng(4), nonfinite)
    normalized = list(shape[-normalized_dims:])
    assert use_fast_cpu_kernels(model) and "LayerNormalizationGrad" not in {n.op_type for n in model.graph.node}
    actual = dict(zip(outputs, _run(model, feeds)))
    as64 = {name: torch.from_numpy(value).double() for name, value in feeds.items()}
    expected = torch.ops.aten.native_layer_norm_backward(as64["dy"], as64["x"], normalized, as64["mean"], as64["inverse_std"],
                                                         as64["scale"], as64["scale"], [True, True, True])  # fmt: skip
    for name, reference in zip(["dx", "dscale", "dbias"], expected):
        if name not in actual:
            continue
        reference = reference.numpy()
        assert actual[name].shape == reference.shape, name
        rows = reference.reshape(-1, int(np.prod(normalized))) if name == "dx" else reference.reshape(1, -1)
        values = actual[name].reshape(rows.shape)
        finite = np.isfinite(rows)
        np.testing.assert_array_equal(np.isfinite(values), finite, err_msg=f"{name}: non-finite positions")
        infinite_dy_row = np.isinf(feeds["dy"]).reshape(-1, rows.shape[1]).any(axis=1, keepdims=True) if name == "dx" else False
        exact = ~finite & ~np.broadcast_to(infinite_dy_row, rows.shape)
        np.testing.assert_array_equal(values[exact], rows[exact], err_msg=f"{name}: NaN and inf values")
        expected_finite = np.abs(np.where(finite, rows, 0.0))  # the non-finite entries were compared above
        error = np.abs(np.where(finite, values, 0.0) - np.where(finite, rows, 0.0))
        row_scale = expected_finite.max(axis=1, keepdims=True)
        assert np.all(error <= 2e-6 * row_scale + 1e-5 * expected_finite), f"{name}: worst {error.max()}"
        if nonfinite:
            assert not finite.all(), f"{name}: the case reaches no non-finite value"


def test_trainer_uses_fast_kernels_with_ignored_labels(tmp_path):
    """Cross-entropy with ignored labels over [N, C, T] scores: 3 SGD steps equal torch's."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(3):
        tokens = torch.randint(0, 50, (4, 6), generator=generator)
        labels = torch.randint(0, 9, (4, 6), generator=generator)
        labels[:, ::4] = -100
        batches.append((tokens, labels))
    path = tmp_path / "train.onnx"
    options = cpu_options({"debug": {"graph_save_paths": {"model_with_training_graph_path": str(path)}}})
    run_parity(TokenTagger(), batches, optim.SGDConfig(lr=0.5), lambda parameters: torch.optim.SGD(parameters, lr=0.5),
               loss_fn=F.cross_entropy, options=options)  # fmt: skip
    ops = {node.op_type for node in onnx.load(str(path)).graph.node}
    assert not ops & {"SoftmaxCrossEntropyLoss", "SoftmaxCrossEntropyLossGrad", "BiasGeluGrad_dX", "GeluGrad"}, ops


def test_narrow_layer_norm_keeps_onnxruntimes_gradient_kernel():
    """Rows narrower than WIDE_LAYER_NORM: ONNX Runtime's kernel is as fast or faster (NOTES.md §33)."""
    model, _ = _layer_norm_gradient_case((4, 3, WIDE_LAYER_NORM // 2), 1, ["dx", "dscale", "dbias"], np.random.default_rng(5))
    assert not use_fast_cpu_kernels(model)


def test_encoder_trains_as_torch_with_the_layer_norm_gradient_replaced(tmp_path):
    """A transformer encoder of width 512 (two LayerNorms in its layer, one before the head): 3 SGD steps equal
    torch's, every state_dict key, with LayerNormalizationGrad replaced in the training graph."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, VOCAB, (4, SEQ), generator=generator), torch.randint(0, VOCAB, (4, SEQ), generator=generator))
               for _ in range(3)]  # fmt: skip
    path = tmp_path / "train.onnx"
    options = cpu_options({"debug": {"graph_save_paths": {"model_with_training_graph_path": str(path)}}})
    run_parity(Encoder(d_model=WIDE_LAYER_NORM), batches, optim.SGDConfig(lr=0.5), lambda parameters: torch.optim.SGD(parameters, lr=0.5),
               loss_fn=lm_loss, options=options)  # fmt: skip
    ops = [node.op_type for node in onnx.load(str(path)).graph.node]
    assert "LayerNormalizationGrad" not in ops and ops.count("LayerNormalization") == 3, sorted(set(ops))


def _ties_cnn():
    """Conv -> ReLU -> MaxPool -> Linear, with one channel exactly 0 and one all negative."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(1, 3, 3, padding=1)
    with torch.no_grad():
        conv.weight[1:] = 0.0
        conv.bias[1], conv.bias[2] = 0.0, -1.0  # pre-activations: exactly 0 (the kink), all negative
    return torch.nn.Sequential(conv, torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(3 * 16, 5))


def test_relu_before_max_pool_is_swapped_with_torchs_gradients(tmp_path):
    """ReLU -> MaxPool trains as MaxPool -> ReLU, with torch's values and gradients, ties included."""
    model = _ties_cnn()
    reference = copy.deepcopy(model)
    images, labels = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 3])
    path = tmp_path / "train.onnx"
    options = cpu_options({"debug": {"graph_save_paths": {"model_with_training_graph_path": str(path)}}})
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=1.0), loss_fn=F.cross_entropy, options=options)
    loss = trainer.train_step(images, labels)[0]
    expected = F.cross_entropy(reference(images), labels)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), atol=1e-6, rtol=1e-6)
    state = trainer.state_dict(pytorch_format=True)
    for name, parameter in reference.named_parameters():
        torch.testing.assert_close(reference.state_dict()[name] - state[name], parameter.grad, atol=1e-6, rtol=1e-5,
                                   msg=lambda m: f"gradient of {name}: {m}")  # fmt: skip
    graph = onnx.load(str(path)).graph
    producers = {output: node.name for node in graph.node for output in node.output}
    relus = [node for node in graph.node if node.op_type == "Relu"]
    assert relus and all("MaxPool" in producers[relu.input[0]] for relu in relus), "the ReLU still comes first"


class SaturatedClassifier(torch.nn.Module):
    """Linear -> sigmoid, weights large enough that some probabilities saturate below exp(-17.5)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        with torch.no_grad():
            self.linear.weight.mul_(40.0)

    def forward(self, x):
        return torch.sigmoid(self.linear(x))


def test_sigmoid_with_binary_cross_entropy_trains_like_torch_where_it_saturates():
    """A BCELoss on sigmoid outputs, some logits near -20 to -60: ONNX Runtime's CPU Sigmoid alone gives
    0 there (loss 100 per element, gradient 0, where torch has -x and a gradient of -1)."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=generator), torch.ones(8, 3)) for _ in range(3)]
    with torch.no_grad():
        logits = SaturatedClassifier()(batches[0][0]).logit()
    assert (logits < -17.5).any(), "the batch must reach the saturated tail"
    run_parity(SaturatedClassifier(), batches, optim.SGDConfig(lr=0.01), lambda p: torch.optim.SGD(p, lr=0.01),
               loss_fn=F.binary_cross_entropy)  # fmt: skip
