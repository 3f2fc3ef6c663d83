"""Broadcast inputs get torch's gradients (rewrites.arithmetic.broadcast_gradient), or a clear refusal.

onnxruntime-training 1.19 does not reduce Where's gradient, nor Pow's base gradient, to the
shape of a broadcast input, and reduces those of Add/Sub/Mul/Div/Max/Min wrongly when two
differently named dynamic dimensions meet. The full matrix (7 ops, Where's condition, Expand
and PRelu over 14 broadcast patterns, with weights and with dynamic-batch activations; 290
cases) is in docs/stack_facts.md, "Broadcast gradients"; these cases are one per kind of failure.
The builder's reductions that provably never reduce are dropped (training_graph.drop_empty_broadcast_reductions).
"""

import copy

import onnx
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from onnx import TensorProto, helper
from parity import cpu_options

from orttrainer import GradientBuildError, ORTTrainer, optim
from orttrainer.graph import training_graph


class Operands(nn.Module):
    """fn(xa * a, xb * b): both operands carry gradients; every input's dim 0 is dynamic."""

    def __init__(self, fn, shape_a, shape_b):
        super().__init__()
        self.a, self.b, self.fn = nn.Parameter(torch.randn(shape_a)), nn.Parameter(torch.randn(shape_b)), fn

    def forward(self, xa, xb, xc=None):
        operands = (xa * self.a, xb * self.b)
        return self.fn(*operands) if xc is None else self.fn(xc > 0, *operands)


def _positive(t):
    return t.abs() + 0.5


CASES = {
    "where, lower-rank branch": (torch.where, [3, 4, 5], [4, 5], [3, 4, 5]),
    "where, both branches and the condition broadcast": (torch.where, [3, 1, 5], [1, 4, 1], [1, 4, 5]),
    "where, scalar branch": (torch.where, [], [3, 4, 5], [5]),
    "pow, broadcast base": (lambda a, b: torch.pow(_positive(a), torch.full(b.shape, 1.5)) + b, [1, 4, 5], [3, 4, 5], None),
    "add, dim 0 named differently": (torch.add, [3, 4, 5], [1, 4, 1], None),
    "mul, both broadcast, named differently": (torch.mul, [3, 1, 5], [1, 4, 1], None),
    "maximum, size-1 against the batch": (torch.maximum, [3, 4, 5], [1], None),
}


def _assert_sgd_step_is_torchs(model, inputs, target, options=None):
    """One SGD step of lr 1 with an MSE loss moves every weight by torch's gradient."""
    reference = copy.deepcopy(model)
    F.mse_loss(reference(*inputs), target).backward()
    initial = {key: value.clone() for key, value in model.state_dict().items()}
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=1.0), loss_fn=F.mse_loss, options=cpu_options(options))
    trainer.train_step(*inputs, target)
    state = trainer.state_dict(pytorch_format=True)
    for key, parameter in reference.named_parameters():
        torch.testing.assert_close(initial[key] - state[key], parameter.grad, atol=1e-5, rtol=1e-4,
                                   msg=lambda m: f"gradient of {key}: {m}")  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_broadcast_operand_gets_torch_gradient(name):
    fn, shape_a, shape_b, shape_condition = CASES[name]
    torch.manual_seed(0)
    model = Operands(fn, shape_a, shape_b)
    inputs = [torch.randn(shape) for shape in (shape_a, shape_b, shape_condition) if shape is not None]
    _assert_sgd_step_is_torchs(model, inputs, torch.randn(model(*inputs).shape))


def test_trainable_pow_exponent_is_refused_before_anything_runs():
    model = Operands(lambda a, b: torch.pow(_positive(a), b), [3, 4], [4])
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=1.0), loss_fn=F.mse_loss, options=cpu_options())
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(GradientBuildError, match=r"Pow \(node .*its input 1 \(the exponent\)"):
        trainer.train_step(torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4))
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key])


def _broadcast_reduction(shape_x, shape_y, position):
    """x + y's builder-style gradient of operand ``position``: ReduceSum(dz, BroadcastGradientArgs(Shape(x),
    Shape(y))[position]) reshaped to that operand's shape (a graph output)."""
    operand = "xy"[position]
    nodes = [
        helper.make_node("Add", ["x", "y"], ["z"], name="add"),
        helper.make_node("Shape", ["x"], ["x_shape"], name="add_Grad/Shape_x"),
        helper.make_node("Shape", ["y"], ["y_shape"], name="add_Grad/Shape_y"),
        helper.make_node("BroadcastGradientArgs", ["x_shape", "y_shape"], ["x_axes", "y_axes"], name="add_Grad/BGA",
                         domain="com.microsoft"),
        helper.make_node("ReduceSum", ["z", f"{operand}_axes"], ["summed"], name="add_Grad/ReduceSum", keepdims=1,
                         noop_with_empty_axes=1),
        helper.make_node("Reshape", ["summed", f"{operand}_shape"], [f"{operand}_grad"], name="add_Grad/Reshape"),
    ]
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in (("x", shape_x), ("y", shape_y))]
    outputs = [helper.make_tensor_value_info(f"{operand}_grad", TensorProto.FLOAT, None)]
    return helper.make_model(helper.make_graph(nodes, "add", inputs, outputs),
                             opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


@pytest.mark.parametrize("shape_x, shape_y, position, dropped", [
    (["batch", 256], [256], 0, True),  # a bias add's input: never broadcast
    (["batch", 256], [256], 1, False),  # the bias: summed over the batch
    ([4, 1], ["batch", 1], 0, True),  # a static size above 1 against a dynamic one
    (["batch", 256], ["batch", 256], 0, True),  # the same name: the same size
    (["batch", 256], ["rows", 256], 0, False),  # two names: one could be 1 at run time
    ([None, 256], [None, 256], 0, False),  # unknown sizes
    ([1, 256], ["batch", 256], 0, False),  # a static 1 against a dynamic size
    ([256], ["batch", 256], 0, False),  # fewer dims
    (["batch", 8], [1, 8], 0, True),  # the other is a static 1 there
], ids=["bias-add-input", "bias", "static-above-1", "same-name", "two-names", "unknown", "static-1", "lower-rank",
        "other-static-1"])  # fmt: skip
def test_broadcast_reduction_is_dropped_only_when_the_operand_keeps_its_shape(shape_x, shape_y, position, dropped):
    model = _broadcast_reduction(shape_x, shape_y, position)
    training_graph.drop_empty_broadcast_reductions(model, model)  # the forward Add is in the same graph
    op_types = [node.op_type for node in model.graph.node]
    assert ("ReduceSum" not in op_types) == dropped, op_types
    if dropped:
        assert model.graph.node[-1].input[0] == "z" and "BroadcastGradientArgs" not in op_types


@pytest.mark.parametrize("sample_x, sample_y, dropped", [
    ([7, 256], [7, 256], True),  # the same size above 1 at the built batch: the same size at every batch
    ([1, 256], [1, 256], False),  # both 1 there: either could be the larger at another batch
    ([7, 256], [1, 256], False),  # the other was broadcast there: this one could be at another batch
], ids=["same-above-1", "both-1", "other-1"])  # fmt: skip
def test_sizes_the_shapes_do_not_name_are_read_at_the_built_batch(sample_x, sample_y, dropped):
    """Lengths dynamic under two names (a Reshape loses which is which): the sizes at the batch the graph is built
    at decide."""
    model = _broadcast_reduction(["length", 256], ["positions", 256], 0)
    training_graph.drop_empty_broadcast_reductions(model, model, {"x": sample_x, "y": sample_y})
    assert ("ReduceSum" not in [node.op_type for node in model.graph.node]) == dropped


class Projections(nn.Module):
    """A Linear over [batch, sequence, 8] (a MatMul against the 2-D weight, then the bias add), then a batched
    MatMul and a broadcast product."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 6)
        self.mix = nn.Parameter(torch.randn(6, 6))

    def forward(self, x):
        h = self.linear(x)
        return h @ (self.mix * h.mean(1, keepdim=True).transpose(1, 2))


def test_linear_over_a_sequence_trains_without_the_reductions_that_never_reduce(tmp_path):
    torch.manual_seed(0)
    path = str(tmp_path / "train.onnx")
    _assert_sgd_step_is_torchs(Projections(), [torch.randn(4, 5, 8)], torch.randn(4, 5, 6),
                               {"debug": {"graph_save_paths": {"model_with_gradient_graph_path": path}}})  # fmt: skip
    reductions = [node.name for node in onnx.load(path).graph.node if node.op_type == "ReduceSum"]
    assert not any(name.startswith("/model/linear/MatMul_Grad/") for name in reductions), reductions
    assert any(name.startswith("/model/linear/Add_Grad/") for name in reductions), reductions  # the bias's sum stays
