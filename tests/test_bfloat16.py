"""bfloat16 mixed precision: the graphs compute as torch.autocast("cpu", dtype=torch.bfloat16) does (float32 master
weights, no loss scale), the ops ONNX Runtime has no bfloat16 kernel for in float32 between casts (graph/bfloat16.py)."""

import copy

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
import torch.nn.functional as F
from models import CNN, MLP, Encoder, MLPWithLoss, cnn_batch, lm_loss, mlp_batch, token_batch, training_onnx
from onnx import TensorProto, helper
from parity import cpu_options, run_parity

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
