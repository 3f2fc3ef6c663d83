"""bfloat16 mixed precision: the graphs compute as torch.autocast("cpu", dtype=torch.bfloat16) does (float32 master
weights, no loss scale), the ops ONNX Runtime has no bfloat16 kernel for in float32 between casts (graph/bfloat16.py)."""

import copy

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
import torch.nn.functional as F
from boundary import edge_values, exported_model, run_training_graph, torch_reference, upstream_like
from models import CNN, MLP, Encoder, MLPWithLoss, cnn_batch, lm_loss, mlp_batch, token_batch, training_onnx
from onnx import TensorProto, helper
from parity import (assert_outputs_within_float32_error, assert_within_float32_error, cpu_options, float64_copy, run_parity,
                    train_keywords_like_torch)

from orttrainer import ORTTrainer, ORTTrainerOptions, amp, optim
from orttrainer.graph import bfloat16, cpu_kernels

BFLOAT16 = {"mixed_precision": {"enabled": True, "dtype": torch.bfloat16}}
LR = 0.1


def autocast_loss(loss_fn):
    """torch's loss of a batch as a torch.autocast(bfloat16) loop computes it (float64 modules stay float64)."""

    def loss(module, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss_fn(module(*batch[:-1]), batch[-1])

    return loss


def sgd(parameters):
    return torch.optim.SGD(parameters, lr=LR)


MODELS = {"mlp": (MLP, F.cross_entropy, mlp_batch), "transformer": (lambda: Encoder(dropout=0.0), lm_loss, token_batch),
          "cnn": (CNN, F.cross_entropy, cnn_batch)}  # fmt: skip


@pytest.mark.parametrize("name", MODELS)
def test_trains_as_torch_autocast_within_its_distance_from_float64(name):
    """Losses and every state_dict key (BatchNorm statistics included) over 4 steps within K times the distance of a
    torch.autocast(bfloat16) loop from a float64 one: the first-step check runs on the same weights, under autocast."""
    make, loss_fn, make_batch = MODELS[name]
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    batches = [make_batch(generator=generator) for _ in range(4)]
    run_parity(make(), batches, optim.SGDConfig(lr=LR), sgd, loss_fn=loss_fn, options=cpu_options(BFLOAT16),
               reference_loss=autocast_loss(loss_fn), float64=True)  # fmt: skip


def autocast_forward(module):
    """``module`` with its forward run under torch.autocast("cpu", bfloat16), as a torch.autocast loop calls it."""
    forward = module.forward

    def forward_under_autocast(*args, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return forward(*args, **kwargs)

    module.forward = forward_under_autocast
    return module


def hugging_face_models():
    """{name: (model maker, batch maker)}: tiny random-init BERT and GPT-2 of test_hf_models.py, in transformers'
    default "sdpa" attention, their batches padded (an attention mask with masked keys)."""
    hf = pytest.importorskip("test_hf_models", reason="Hugging Face models need transformers (the test extra)")
    return {"bert-classification": (hf.bert_classifier, hf.classification_batch), "gpt2-lm": (hf.gpt2_lm, hf.causal_lm_batch)}


@pytest.mark.parametrize("name", ["bert-classification", "gpt2-lm"])
def test_hugging_face_model_trains_as_torch_autocast(name):
    """BERT and GPT-2 through scaled_dot_product_attention with a mask: the outputs (loss, logits, hidden states) and
    every state_dict key over 4 SGD steps within K times the torch.autocast loop's distance from float64."""
    make, make_batch = hugging_face_models()[name]
    torch.manual_seed(0)
    model = make()
    assert model.config._attn_implementation == "sdpa"
    generator = torch.Generator().manual_seed(1)
    batches = [make_batch(generator) for _ in range(4)]
    assert all((batch["attention_mask"] == 0).any() for batch in batches)
    reference, reference64 = autocast_forward(copy.deepcopy(model)), float64_copy(model)
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=LR), options=cpu_options(BFLOAT16))
    train_keywords_like_torch(trainer, reference, reference64, batches, LR, compare_returned_fields)


def compare_returned_fields(outputs, expected, expected64, where):
    """Each field train_step returns (GPT-2's past_key_values is left out of the graph) as close to float64 as
    torch.autocast's, and the loss and logits among them."""
    assert {"loss", "logits"} <= set(outputs.keys()), f"{where}: fields {list(outputs.keys())}"
    for key in outputs.keys():
        assert_outputs_within_float32_error(outputs[key], expected[key], expected64[key], f"{where}.{key}")


class AutocastInForward(MLP):
    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = self.fc1(x)
        return self.head(F.gelu(self.fc2(torch.relu(hidden.to(x.dtype)))))


@pytest.mark.parametrize("options", [{}, BFLOAT16], ids=["float32", "bfloat16"])
def test_autocast_inside_forward_trains_as_torch(options):
    """torch.autocast inside forward is traced like the option's: its bfloat16 ops run in float32 between casts (it
    was refused for want of a bfloat16 Gemm kernel); under the option's autocast too."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    run_parity(AutocastInForward(), [mlp_batch(generator=generator) for _ in range(3)], optim.SGDConfig(lr=LR), sgd,
               loss_fn=F.cross_entropy, options=cpu_options(options),
               reference_loss=autocast_loss(F.cross_entropy) if options else None, float64=True)  # fmt: skip


def first_losses(model, batch, options, lr=LR):
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=lr), loss_fn=F.cross_entropy, options=cpu_options(options))
    return trainer.train_step(*batch)


def test_computes_in_bfloat16_where_autocast_does():
    """From fc1.weight = 0, SGD with lr 1 leaves -gradient in it: torch.autocast's gradient of a weight a matrix
    product reads is a bfloat16 one (cast to float32), and so is orttrainer's, within one bfloat16 unit in the last
    place of torch's (float32 summation order moves a rounding); a graph optimizer that dropped the casts would
    compute it in float32. The logits are bfloat16, as torch's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))  # fmt: skip
    batch = mlp_batch(batch=64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model[0].weight.zero_()
    reference = copy.deepcopy(model)
    _, logits = first_losses(model, batch, BFLOAT16, lr=1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected_logits = reference(batch[0])
        F.cross_entropy(expected_logits, batch[1]).backward()
    ours, expected = -model[0].weight.detach(), reference[0].weight.grad
    assert logits.dtype == expected_logits.dtype == torch.bfloat16
    assert torch.equal(ours.bfloat16().float(), ours) and torch.equal(expected.bfloat16().float(), expected)
    ulp = 2.0 ** (torch.floor(torch.log2(expected.abs().clamp_min(1e-30))) - 7)
    assert ((ours - expected).abs() <= ulp).all()
    assert (ours != 0).any()


# ------------------------------------------------------------------------------------------- the rewrite, op by op
BOUNDARY = [0.0, -0.0, 1e-40, -1e-40, 1.0 + 2**-8, -(1.0 + 3 * 2**-8), 0.1, -2.5, 3e38, -3e38, float("inf"),
            float("-inf"), float("nan")]  # fmt: skip
UNARY = {"Relu": torch.relu, "Neg": torch.neg, "Abs": torch.abs, "Exp": torch.exp, "Tanh": torch.tanh,
         "Sigmoid": torch.sigmoid, "Sqrt": torch.sqrt, "Erf": torch.erf, "Reciprocal": torch.reciprocal}  # fmt: skip
BINARY = {"Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": torch.div, "Pow": torch.pow, "Max": torch.maximum}
REDUCING = {"Softmax": lambda x: torch.softmax(x, -1), "ReduceSum": lambda x: x.sum(-1, keepdim=True),
            "MatMul": lambda x: x @ x.transpose(0, 1)}  # fmt: skip


def bfloat16_graph(op_type, inputs, node_inputs=None, **attributes):
    """x_i (float32) -> Cast to bfloat16 -> ``op_type`` -> Cast to float32: the form an autocast trace takes."""
    nodes = [helper.make_node("Cast", [name], [f"{name}.bf16"], to=TensorProto.BFLOAT16) for name in inputs]
    nodes.append(helper.make_node(op_type, node_inputs or [f"{name}.bf16" for name in inputs], ["y.bf16"], **attributes))
    nodes.append(helper.make_node("Cast", ["y.bf16"], ["y"], to=TensorProto.FLOAT))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in inputs],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def run_rewritten(model, feeds):
    """``model`` through compute_in_float32 and the exact CPU kernels a float32 graph gets (as the trainer builds it)
    on ONNX Runtime's CPU provider, which refuses it as it is."""
    with pytest.raises(Exception, match="NOT_IMPLEMENTED|Could not find an implementation"):
        onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rewritten = bfloat16.compute_in_float32(model)
    cpu_kernels.use_exact_cpu_kernels(rewritten)
    session = onnxruntime.InferenceSession(rewritten.SerializeToString(), providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(None, {name: value.numpy() for name, value in feeds.items()})[0])


def assert_same_bfloat16(ours, expected, what):
    """Equal, NaN where torch's is NaN, the sign of a zero or infinity included."""
    expected = expected.float()
    same = (ours == expected) & (torch.signbit(ours) == torch.signbit(expected)) | (ours.isnan() & expected.isnan())
    assert same.all(), f"{what}: at {(~same).nonzero().tolist()} {ours[~same].tolist()} != torch {expected[~same].tolist()}"


@pytest.mark.parametrize("op_type", UNARY)
def test_a_unary_op_rounds_as_torchs_bfloat16_kernel(op_type):
    x = torch.tensor(BOUNDARY + [0.5, 2.0, -0.75, 10.0, 1e-3])
    if op_type in ("Erf", "Sqrt"):  # ONNX Runtime's float32 kernels, float32 graphs' too (reported): erf(NaN) = 1;
        # erf and sqrt of a subnormal, sqrt(-0) = +0 and sqrt(-subnormal) = inf
        x = x[~x.isnan() & (x.abs() > 1e-38)]
    assert_same_bfloat16(run_rewritten(bfloat16_graph(op_type, ["x"]), {"x": x}), UNARY[op_type](x.bfloat16()), op_type)


@pytest.mark.parametrize("op_type", BINARY)
def test_a_binary_op_rounds_as_torchs_bfloat16_kernel(op_type):
    """Every pair of boundary values (ties of bfloat16 rounding among them and their sums and products)."""
    values = torch.tensor(BOUNDARY)
    a, b = values.repeat_interleave(len(values)), values.repeat(len(values))
    ours = run_rewritten(bfloat16_graph(op_type, ["a", "b"]), {"a": a, "b": b})
    assert_same_bfloat16(ours, BINARY[op_type](a.bfloat16(), b.bfloat16()), op_type)


@pytest.mark.parametrize("op_type", REDUCING)
def test_a_reducing_op_rounds_its_float32_result_once(op_type):
    """A row sum, softmax and matrix product of bfloat16 values, computed in float32 (products exact) and rounded
    once, as torch's bfloat16 CPU kernels do; rows of finite values (one of them cancelling to 0), of an infinity, a
    NaN. Within one bfloat16 unit in the last place where the float32 summation order moves a rounding."""
    rows = torch.tensor([[1.0 + 2**-8, 1e-3, -1.0, 3.0], [2**-7, -(2**-7), 0.5, -0.5], [float("inf"), 1.0, 2.0, 3.0],
                         [float("nan"), 1.0, 0.0, -0.0], [100.0, -100.0, 7.0, 1e-2]])  # fmt: skip
    attributes = {"axis": -1} if op_type == "Softmax" else {"keepdims": 1} if op_type == "ReduceSum" else {}
    node_inputs = ["x.bf16", "xt.bf16"] if op_type == "MatMul" else None
    model = bfloat16_graph(op_type, ["x", "xt"] if op_type == "MatMul" else ["x"], node_inputs, **attributes)
    if op_type == "ReduceSum":
        model.graph.node[1].input.append("axes")
        model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([-1], np.int64), "axes"))
    feeds = {"x": rows, "xt": rows.transpose(0, 1).contiguous()} if op_type == "MatMul" else {"x": rows}
    ours, expected = run_rewritten(model, feeds), REDUCING[op_type](rows.bfloat16()).float()
    assert (ours.isnan() == expected.isnan()).all(), op_type
    finite = ~expected.isnan()
    ulp = 2.0 ** (torch.floor(torch.log2(expected[finite].abs().clamp_min(1e-30))) - 7)
    assert ((ours[finite] - expected[finite]).abs() <= ulp).all() or torch.equal(ours[finite], expected[finite]), op_type


@pytest.mark.parametrize("op_type, attributes", [("Transpose", {"perm": [1, 0]}), ("Identity", {})])
def test_an_op_that_only_moves_values_stays_bfloat16(op_type, attributes):
    """No float32 round trip around it (two casts over the tensor for the same values): ONNX Runtime's bfloat16
    kernel moves the values, signs of zeros and NaN included."""
    x = torch.tensor(BOUNDARY[:12]).reshape(3, 4)
    rewritten = bfloat16.compute_in_float32(bfloat16_graph(op_type, ["x"], **attributes))
    assert [node.op_type for node in rewritten.graph.node] == ["Cast", op_type, "Cast"]
    session = onnxruntime.InferenceSession(rewritten.SerializeToString(), providers=["CPUExecutionProvider"])
    ours = torch.from_numpy(session.run(None, {"x": x.numpy()})[0])
    expected = x.bfloat16().transpose(0, 1) if op_type == "Transpose" else x.bfloat16()
    assert_same_bfloat16(ours, expected, op_type)


# ------------------------------------------------------------------------------------------- options and refusals
def test_dtype_defaults_to_float16_with_its_loss_scaler():
    options = ORTTrainerOptions({"mixed_precision": {"enabled": True}})
    assert options.mixed_precision.dtype == torch.float16
    assert amp.scales_loss(options.mixed_precision) and amp.compute_dtype(options.mixed_precision) == torch.float16
    bf16 = ORTTrainerOptions(BFLOAT16).mixed_precision
    assert not amp.scales_loss(bf16) and amp.compute_dtype(bf16) == torch.bfloat16
    assert amp.compute_dtype(ORTTrainerOptions({"mixed_precision": {"dtype": torch.bfloat16}}).mixed_precision) == torch.float32


@pytest.mark.parametrize("value, message", [
    (torch.float32, r"mixed_precision.dtype: must be one of \[torch.float16, torch.bfloat16\], got torch.float32"),
    ("bfloat16", r"mixed_precision.dtype: must be of torch.dtype type, got str 'bfloat16'"),
])  # fmt: skip
def test_an_invalid_dtype_is_named_with_the_allowed_values(value, message):
    with pytest.raises(ValueError, match=message):
        ORTTrainerOptions({"mixed_precision": {"enabled": True, "dtype": value}})


def test_a_loss_scaler_with_bfloat16_is_refused():
    with pytest.raises(ValueError, match=r"mixed_precision.loss_scaler: must be None with mixed_precision.dtype "
                                         r"torch.bfloat16 .* got DynamicLossScaler"):  # fmt: skip
        ORTTrainerOptions({"mixed_precision": {"enabled": True, "dtype": torch.bfloat16,
                                               "loss_scaler": amp.DynamicLossScaler()}})  # fmt: skip


def test_bfloat16_trainer_has_no_loss_scale():
    trainer = ORTTrainer(MLP(), None, optim.SGDConfig(lr=LR), loss_fn=F.cross_entropy, options=cpu_options(BFLOAT16))
    trainer.train_step(*mlp_batch())
    assert trainer.options.mixed_precision.loss_scaler is None and trainer._runtime.loss_scale is None
    assert "loss_scaler" not in trainer.state_dict() and not trainer.state_dict()["trainer_options"]["mixed_precision"]


@pytest.mark.parametrize("options, dtype", [({}, torch.bfloat16), ({"mixed_precision": {"enabled": True}}, torch.bfloat16),
                                            (BFLOAT16, torch.float16)])  # fmt: skip
@pytest.mark.parametrize("call", ["train_step", "eval_step"])
def test_a_step_inside_another_autocast_is_refused(options, dtype, call):
    """A step inside torch.autocast whose dtype the graphs do not compute in is refused naming autocast, never run in
    float32 (or float16) silently."""
    trainer = ORTTrainer(MLP(), None, optim.SGDConfig(lr=LR), loss_fn=F.cross_entropy, options=cpu_options(options))
    with torch.autocast("cpu", dtype=dtype), pytest.raises(ValueError, match=rf"{call} inside torch.autocast\('cpu', "
                                                                            rf"dtype={dtype}\)"):  # fmt: skip
        getattr(trainer, call)(*mlp_batch())


def test_a_step_inside_autocast_bfloat16_trains_as_outside_it():
    torch.manual_seed(0)
    model, batch = MLP(), mlp_batch()
    outside = first_losses(copy.deepcopy(model), batch, BFLOAT16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = first_losses(model, batch, BFLOAT16)
    for ours, theirs in zip(inside, outside):
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0)


def test_an_onnx_model_is_refused_in_bfloat16(tmp_path):
    model = training_onnx(MLPWithLoss(), mlp_batch(), tmp_path / "mlp.onnx")
    with pytest.raises(ValueError, match="mixed_precision.dtype torch.bfloat16 trains a torch.nn.Module"):
        ORTTrainer(model, None, optim.SGDConfig(lr=LR), options=cpu_options(BFLOAT16))


# ------------------------------------------------------------------------------- symbolics given bfloat16 inputs
def bfloat16_values(*extra):
    """boundary.edge_values and ``extra`` rounded to bfloat16 (FLT_MAX to inf), as float32."""
    return torch.tensor(edge_values(*extra)).bfloat16().float().numpy()


def bfloat16_rows(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).bfloat16().float().numpy()


X = bfloat16_values(0.5, -0.5, 0.25, -1.5, 2.0, 3.0, -3.0, 7.0, 1e-3, 0.75, -0.75, 40.0)
UNIT = np.array([0.0, -0.0, 1e-30, 0.5, -0.5, 0.9921875, -0.9921875, 1.0, -1.0, 2.0, np.nan], np.float32)
AT_LEAST_ONE = np.array([1.0, 1.0078125, 1.5, 2.0, 4096.0, 1e20, 3e38, np.inf, np.nan, 0.5, 0.0], np.float32)
FINITE_ROWS = bfloat16_rows((6, 8))
FINITE_ROWS[1] = 0.0  # a zero row
ROWS = FINITE_ROWS.copy()
ROWS[0, :2], ROWS[2, 3] = (np.inf, -np.inf), np.nan  # an infinite row, a NaN
QUERIES, KEYS, VALUES = bfloat16_rows((2, 5, 4), 1), bfloat16_rows((2, 3, 4), 2), bfloat16_rows((2, 3, 6), 3)
TARGETS = np.array([0, 2, 1, 7, 3, 2], np.int64)
# name: (function of bfloat16 tensors (float64 ones for the reference), {input: float32 value}, trainable inputs).
# cdist is left out: torch.autocast computes it in float32, and torch's CPU cdist has no bfloat16 kernel.
SYMBOLIC_CASES = {
    "floor_divide": (lambda x: torch.floor_divide(x, 0.75), {"x": X[np.isfinite(X) | np.isnan(X)]}, []),  # inf // 0.75:
    # torch NaN, orttrainer inf (in float32 too)
    "threshold": (lambda x: F.threshold(x, 0.5, -2.0), {"x": X}, ["x"]),
    "softplus": (lambda x: F.softplus(x, beta=2.0, threshold=5.0), {"x": X}, ["x"]),
    "clamp": (lambda x: x.clamp(-1.5, 0.5), {"x": X}, ["x"]),
    "clamp_min-tensor": (lambda x: torch.clamp_min(x, torch.full_like(x, 0.25)), {"x": X}, ["x"]),
    "clamp_max": (lambda x: torch.clamp_max(x, -1.0), {"x": X}, ["x"]),
    "hardtanh": (lambda x: F.hardtanh(x, -0.5, 0.75), {"x": X}, ["x"]),
    "relu6": (lambda x: F.relu6(x), {"x": X}, ["x"]),
    "atan2": (lambda y, x: torch.atan2(y, x), {"y": np.repeat(X[:16], 16), "x": np.tile(X[:16], 16)}, ["y", "x"]),
    "hardshrink": (lambda x: F.hardshrink(x, 0.5), {"x": X}, ["x"]),
    "softshrink": (lambda x: F.softshrink(x, 0.5), {"x": X}, ["x"]),
    "sinh": (torch.sinh, {"x": X}, ["x"]),
    "cosh": (torch.cosh, {"x": X}, ["x"]),
    "asinh": (torch.asinh, {"x": X}, ["x"]),
    "acosh": (torch.acosh, {"x": AT_LEAST_ONE}, ["x"]),
    "atanh": (torch.atanh, {"x": UNIT}, ["x"]),
    "log_sigmoid": (F.logsigmoid, {"x": X}, ["x"]),
    "baddbmm-beta-0": (lambda x, a, b: torch.baddbmm(x, a, b, beta=0.0, alpha=0.5),
                       {"x": np.full((2, 5, 3), np.nan, np.float32), "a": QUERIES, "b": bfloat16_rows((2, 4, 3))}, ["a", "b"]),
    "layer_norm": (lambda x, w: F.layer_norm(x, (8,), w), {"x": ROWS[3:], "w": bfloat16_rows((8,), 2)}, ["x", "w"]),
    "batch_norm-no-statistics": (lambda x: F.batch_norm(x, None, None, training=True), {"x": ROWS[3:]}, ["x"]),
    "rms_norm": (lambda x, w: F.rms_norm(x, (8,), w), {"x": ROWS, "w": bfloat16_rows((8,), 2)}, ["x", "w"]),
    "bilinear": (lambda a, b, w: F.bilinear(a, b, w), {"a": ROWS[3:, :3], "b": ROWS[3:, 3:7], "w": bfloat16_rows((2, 3, 4), 3)}, ["a", "b", "w"]),
    "adaptive_avg_pool1d": (lambda x: F.adaptive_avg_pool1d(x, 3), {"x": ROWS[None, 3:]}, ["x"]),
    "max-dim": (lambda x: x.max(1).values, {"x": ROWS}, ["x"]),
    "argmin": (lambda x: torch.argmin(x, 1).to(x.dtype), {"x": ROWS}, []),
    "vector_norm-3": (lambda x: torch.linalg.vector_norm(x, 3.0, dim=1), {"x": ROWS}, ["x"]),
    "std": (lambda x: x.std(1), {"x": ROWS}, ["x"]),
    "var_mean": (lambda x: torch.stack(torch.var_mean(x, 1)), {"x": ROWS}, ["x"]),
    "sort": (lambda x: torch.sort(x, 1).values, {"x": ROWS}, ["x"]),
    "topk": (lambda x: torch.topk(x, 3, 1).values, {"x": ROWS[[0, 2, 3, 4, 5]]}, ["x"]),  # the zero row's ties: torch
    # picks the last of them here, orttrainer the first (in float32 too)
    "diff": (lambda x: torch.diff(x, dim=1), {"x": ROWS}, ["x"]),
    "cumsum": (lambda x: torch.cumsum(x, 1), {"x": ROWS}, ["x"]),
    "cumprod": (lambda x: torch.cumprod(x, 1), {"x": ROWS}, ["x"]),
    "dot": (lambda a, b: torch.dot(a, b), {"a": ROWS[4], "b": ROWS[5]}, ["a", "b"]),
    "mv": (lambda m, v: torch.mv(m, v), {"m": ROWS, "v": ROWS[5]}, ["m", "v"]),
    "pairwise_distance": (lambda a, b: F.pairwise_distance(a, b), {"a": FINITE_ROWS, "b": FINITE_ROWS[::-1].copy()}, ["a", "b"]),
    "cosine_similarity": (lambda a, b: F.cosine_similarity(a, b), {"a": FINITE_ROWS, "b": FINITE_ROWS[::-1].copy()}, ["a", "b"]),
    "index_add": (lambda x, y: x.index_add(0, torch.tensor([1, 0, 1]), y), {"x": ROWS[:2], "y": ROWS[3:]}, ["x", "y"]),
    "embedding_bag-mean": (lambda w: F.embedding_bag(torch.tensor([0, 2, 2, 5, 1]), w, torch.tensor([0, 2]), mode="mean"),
                           {"w": ROWS}, ["w"]),
    "scaled_dot_product_attention-bool-mask": (
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=torch.tensor([[True, False, True]] * 4 + [[False] * 3])),
        {"q": QUERIES, "k": KEYS, "v": VALUES}, ["q", "k", "v"]),
    "scaled_dot_product_attention-float-mask": (
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=torch.tensor([0.0, -1.5, float("-inf")]), scale=0.3),
        {"q": QUERIES, "k": KEYS, "v": VALUES}, ["q", "k", "v"]),
    "l1_loss": (lambda x, t: F.l1_loss(x, t), {"x": FINITE_ROWS, "t": FINITE_ROWS[::-1].copy()}, ["x"]),
    "smooth_l1_loss": (lambda x, t: F.smooth_l1_loss(x, t, reduction="none"), {"x": FINITE_ROWS, "t": FINITE_ROWS[::-1].copy()}, ["x"]),
    "huber_loss": (lambda x, t: F.huber_loss(x, t, delta=0.5), {"x": FINITE_ROWS, "t": FINITE_ROWS[::-1].copy()}, ["x"]),
    "binary_cross_entropy_with_logits": (lambda x, t: F.binary_cross_entropy_with_logits(x, t, reduction="none"),
                                         {"x": FINITE_ROWS, "t": (FINITE_ROWS[::-1] > 0).astype(np.float32)}, ["x"]),
    "soft_margin_loss": (lambda x, t: F.soft_margin_loss(x, t, reduction="none"),
                         {"x": FINITE_ROWS, "t": np.sign(FINITE_ROWS[::-1] + 0.1).astype(np.float32)}, ["x"]),
    "cross_entropy": (lambda x, t: F.cross_entropy(x, t, reduction="none"), {"x": FINITE_ROWS[3:], "t": TARGETS[:3]}, ["x"]),
    "nll_loss": (lambda x, t: F.nll_loss(F.log_softmax(x, 1), t, ignore_index=7), {"x": FINITE_ROWS, "t": TARGETS}, ["x"]),
}


@pytest.mark.parametrize("case", SYMBOLIC_CASES)
def test_a_symbolic_given_bfloat16_inputs_computes_as_torchs_bfloat16_kernel(case):
    """Every computing symbolic of export/symbolics on inputs torch.autocast computed in bfloat16: it exports
    (constants were built through numpy, which has no bfloat16) and computes in float32 between casts; its value and
    the gradients within K times torch's bfloat16 distance from float64 (parity.assert_within_float32_error), NaN and
    infinities where torch's bfloat16 kernels give them. The gradient at an input that is NaN itself is not compared
    (boundary.check_against_torch says why)."""
    function, values, trainable = SYMBOLIC_CASES[case]

    def in_bfloat16(**tensors):  # the symbolic gets bfloat16 inputs; the loss reads float32
        return function(**{name: value.bfloat16() if value.is_floating_point() else value for name, value in tensors.items()}).float()

    upstream = upstream_like(tuple(in_bfloat16(**{name: torch.tensor(value) for name, value in values.items()}).shape))
    model = bfloat16.compute_in_float32(exported_model(in_bfloat16, values, upstream, trainable))
    results, _ = run_training_graph(model, values, trainable)
    expected, gradients = torch_reference(in_bfloat16, values, upstream, trainable, torch.float32)
    expected64, gradients64 = torch_reference(function, values, upstream, trainable)
    assert_within_float32_error(results["output"], expected, expected64, f"{case} value")
    for name in trainable:
        compared = ~np.isnan(values[name])
        assert_within_float32_error(results[f"{name}_grad"].reshape(values[name].shape)[compared], gradients[name][compared],
                                    gradients64[name][compared], f"{case} gradient of {name}")  # fmt: skip
