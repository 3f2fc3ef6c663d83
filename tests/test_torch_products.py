"""A bfloat16 graph's matrix products on torch's bfloat16 kernels (orttrainer/runtime/torch_products.py).

Each product form the bfloat16 rewrite and the gradient builder write (MatMul with numpy broadcasting and 1-D
operands, Gemm with transposes, bias and beta, FusedMatMul with transposes, a Reshape on either side) run through a
split graph, against the same graph in ONNX Runtime (float32 between casts) and against a float64 product of the
bfloat16 operands rounded to bfloat16, at boundary values; then what the rewrite leaves alone, and the trainer's
choice of route.
"""

import re
import warnings

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
import torch.nn.functional as F
from models import Encoder, lm_loss, token_batch
from onnx import TensorProto, helper
from parity import cpu_options, run_parity
from test_bfloat16 import BFLOAT16, BOUNDARY, LR, autocast_loss, sgd

from orttrainer import ORTTrainer, optim
from orttrainer.runtime import session as bound
from orttrainer.runtime import torch_convolutions as split
from orttrainer.runtime import torch_products

FLOAT, BF16 = TensorProto.FLOAT, TensorProto.BFLOAT16


def product_graph(op_type, operands, attributes=None, domain="", reshape_operand=None, reshape_result=None):
    """The form compute_in_float32 and the gradient builder leave: each float32 input x_i -> Cast to bfloat16 ->
    Cast to float32 (-> Reshape to ``reshape_operand``[i]) -> the product (-> Reshape to ``reshape_result``) -> Cast
    to bfloat16 -> Cast to float32, the output y."""
    nodes, initializers, inputs = [], [], []
    for index, name in enumerate(operands):
        nodes += [helper.make_node("Cast", [name], [f"{name}.bf16"], name=f"{name}.round", to=BF16),
                  helper.make_node("Cast", [f"{name}.bf16"], [f"{name}.f32"], name=f"{name}.up", to=FLOAT)]  # fmt: skip
        inputs.append(f"{name}.f32")
        shape = (reshape_operand or {}).get(index)
        if shape is not None:
            initializers.append(onnx.numpy_helper.from_array(np.array(shape, np.int64), f"{name}.shape"))
            nodes.append(helper.make_node("Reshape", [inputs[-1], f"{name}.shape"], [f"{name}.r"], name=f"{name}.reshape"))
            inputs[-1] = f"{name}.r"
    result = "p"
    nodes.append(helper.make_node(op_type, inputs, [result], name="product", domain=domain, **(attributes or {})))
    if reshape_result is not None:
        initializers.append(onnx.numpy_helper.from_array(np.array(reshape_result, np.int64), "p.shape"))
        nodes.append(helper.make_node("Reshape", [result, "p.shape"], ["p.r"], name="p.reshape"))
        result = "p.r"
    nodes += [helper.make_node("Cast", [result], ["y.bf16"], name="y.round", to=BF16),
              helper.make_node("Cast", ["y.bf16"], ["y"], name="y.up", to=FLOAT)]  # fmt: skip
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(name, FLOAT, None) for name in operands],
                              [helper.make_tensor_value_info("y", FLOAT, None)], initializers)  # fmt: skip
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def _open_session(model, all_threads=True):
    return bound.TorchBoundSession(model, torch.device("cpu"), [("CPUExecutionProvider", {})], bound.session_options())


def run_split(model, feeds):
    """``model`` as a split graph, its products on torch; (y, the split session)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    assert split.can_split(model, convolutions=False, products=True)
    session = split.SplitSession(model, _open_session, convolutions=False, products=True)
    for name, value in feeds.items():
        session.bind_input(name, value)
    session.allocate_outputs(["y"])
    return session.run()[0], session


def run_emulated(model, feeds):
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(None, {name: value.numpy() for name, value in feeds.items()})[0])


def _t(x, flag):
    return x.transpose(-1, -2) if flag and x.dim() >= 2 else x


def float64_reference(op_type, attributes, operands):
    """The node's product in float64 on the bfloat16-rounded operands (ONNX's meaning), rounded to bfloat16 once."""
    values = [value.bfloat16().double() for value in operands]
    a, b = _t(values[0], attributes.get("transA", 0)), _t(values[1], attributes.get("transB", 0))
    y = torch.matmul(a, b)
    if op_type == "Gemm" and len(values) > 2 and attributes.get("beta", 1.0) != 0.0:
        y = y + attributes.get("beta", 1.0) * values[2]
    return y.bfloat16().float()


def assert_within_one_bfloat16_unit(ours, expected, what):
    """NaN and the infinities where the float64 product has them; finite values within one bfloat16 unit in the last
    place (a float32 sum of exact products rounds once, but its order may move that rounding)."""
    assert ours.shape == expected.shape, what
    assert torch.equal(ours.isnan(), expected.isnan()), what
    special = expected.isinf() | ours.isinf()
    assert torch.equal(ours[special], expected[special]), what
    finite = ~expected.isnan() & ~special
    ulp = 2.0 ** (torch.floor(torch.log2(expected[finite].abs().clamp_min(2.0**-133))) - 7)
    assert ((ours[finite] - expected[finite]).abs() <= ulp).all(), f"{what}: {ours[finite]} against {expected[finite]}"


# test_bfloat16's boundary values, +-huge a tenth of theirs: a sum of a few products of it stays within float32's range
# (both routes sum in float32, where a larger one overflows and float64 does not)
EDGES = torch.tensor([value / 10 if abs(value) == 3e38 else value for value in BOUNDARY])


def _boundary_matrix(rows, columns, generator):
    """Random values with the boundary values (0, -0, subnormals, ties, +-huge, +-inf, NaN) strewn in."""
    x = torch.randn(rows, columns, generator=generator)
    flat = x.view(-1)
    positions = torch.randperm(flat.numel(), generator=generator)[: len(EDGES)]
    flat[positions] = EDGES[: len(positions)]
    return x


CASES = {  # name: (op type, domain, operand shapes, attributes, Reshape of an operand, Reshape of the result)
    "MatMul 2-D": ("MatMul", "", [(6, 5), (5, 7)], {}, None, None),
    "MatMul batched, broadcast": ("MatMul", "", [(3, 1, 4, 5), (2, 5, 6)], {}, None, None),
    "MatMul batched by a matrix": ("MatMul", "", [(2, 3, 4, 5), (5, 6)], {}, None, None),
    "MatMul vector by batch": ("MatMul", "", [(5,), (2, 5, 6)], {}, None, None),
    "MatMul matrix by vector": ("MatMul", "", [(4, 5), (5,)], {}, None, None),
    "MatMul size-1 and empty dims": ("MatMul", "", [(1, 0, 5), (5, 1)], {}, None, None),
    "Gemm bias, transB": ("Gemm", "", [(6, 5), (7, 5), (7,)], {"transB": 1}, None, None),
    "Gemm bias row, transA": ("Gemm", "", [(5, 6), (5, 7), (1, 7)], {"transA": 1}, None, None),
    "Gemm both transposed, beta 0.5": ("Gemm", "", [(5, 6), (7, 5), (6, 7)], {"transA": 1, "transB": 1, "beta": 0.5}, None, None),
    "Gemm beta 0 ignores C": ("Gemm", "", [(6, 5), (5, 7), (7,)], {"beta": 0.0}, None, None),
    "Gemm without C": ("Gemm", "", [(6, 5), (5, 7)], {}, None, None),
    "Gemm weight gradient of reshaped operands": ("Gemm", "", [(2, 3, 5), (2, 3, 7)], {"transA": 1, "beta": 0.0},
                                                  {0: [6, 5], 1: [6, 7]}, None),
    "FusedMatMul transB, result reshaped": ("FusedMatMul", "com.microsoft", [(2, 4, 5), (2, 6, 5)], {"transB": 1}, None,
                                            [8, 6]),
    "FusedMatMul transA, broadcast": ("FusedMatMul", "com.microsoft", [(3, 5, 4), (5, 6)], {"transA": 1}, None, None),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_a_product_on_torch_computes_as_the_float32_emulation_and_float64(case):
    """Both routes within one bfloat16 unit of the float64 product rounded once, NaN and infinities alike, at boundary
    values; the product runs on torch (a torch step of the split, the casts around it gone)."""
    op_type, domain, shapes, attributes, reshape_operand, reshape_result = CASES[case]
    generator = torch.Generator().manual_seed(0)
    names = ["a", "b", "c"][: len(shapes)]
    feeds = {}
    for name, shape in zip(names, shapes):
        values = torch.randn(*shape, generator=generator)
        if values.dim() == 2 and values.numel() >= len(EDGES) and name != "c":
            values = _boundary_matrix(*shape, generator)
        feeds[name] = values
    model = product_graph(op_type, names, attributes, domain, reshape_operand, reshape_result)
    ours, session = run_split(model, feeds)
    operands = [feeds[name].reshape(reshape_operand[index]) if reshape_operand and index in reshape_operand else feeds[name]
                for index, name in enumerate(names)]  # fmt: skip
    expected = float64_reference(op_type, attributes, operands)
    if reshape_result is not None:
        expected = expected.reshape(reshape_result)
    assert_within_one_bfloat16_unit(ours, expected, f"{case}, on torch")
    assert_within_one_bfloat16_unit(run_emulated(model, feeds), expected, f"{case}, emulated")
    assert "product" in session.on_torch
    assert not any(node.op_type == "Cast" and node.input[0] in ("a.bf16", "b.bf16") for node in session._model.graph.node)


def test_a_linear_on_torch_is_torch_autocasts_own_bit_for_bit():
    """The forward Gemm of nn.Linear (transB, bias) is the addmm torch.autocast runs: the same bits."""
    generator = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(64, 48, generator=generator), torch.randn(32, 48, generator=generator), torch.randn(32, generator=generator)
    ours, _ = run_split(product_graph("Gemm", ["a", "b", "c"], {"transB": 1}), {"a": x, "b": w, "c": b})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.linear(x, w, b)
    assert torch.equal(ours, expected.float())


def test_a_product_whose_float32_result_is_read_elsewhere_stays_emulated():
    """A forward product's unrounded result feeds another node (a symbolic computing in float32, as attention's):
    computing it in bfloat16 would round that node's input, which torch's kernel does not."""
    model = product_graph("MatMul", ["a", "b"])
    model.graph.node.append(helper.make_node("Relu", ["p"], ["z"], name="relu"))
    model.graph.output.append(helper.make_tensor_value_info("z", FLOAT, None))
    assert torch_products.rewrite(model) == 0


def test_a_gradient_product_summed_in_float32_rounds_first_as_torchs_autograd():
    """ONNX Runtime's gradient builder sums the input gradients of the products that read one tensor (BERT's query,
    key and value) in float32, and a broadcast product's in a ReduceSum: torch's autograd rounds each product to
    bfloat16 first. On torch, the gradient product rounds, then is cast up for that sum."""
    model = product_graph("MatMul", ["a", "b"])
    product = next(node for node in model.graph.node if node.name == "product")
    product.name = "/layer/MatMul_Grad/MatMul_0"
    model.graph.node.append(helper.make_node("Sum", ["p", "p"], ["s"], name="gradients summed"))
    model.graph.output.append(helper.make_tensor_value_info("s", FLOAT, None))
    rewritten = onnx.ModelProto.FromString(model.SerializeToString())
    assert torch_products.rewrite(rewritten) == 1
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 24, generator=generator), torch.randn(24, 8, generator=generator)
    session = split.SplitSession(rewritten, _open_session, convolutions=False, products=True)
    session.bind_input("a", a)
    session.bind_input("b", b)
    session.allocate_outputs(["s"])
    (summed,) = session.run()
    rounded = torch.matmul(a.bfloat16(), b.bfloat16()).float()
    assert torch.equal(summed, rounded + rounded)


def test_a_product_of_a_float32_operand_stays_emulated():
    model = product_graph("MatMul", ["a", "b"])
    model.graph.node[-3].input[1] = "b"  # the product reads the float32 input itself
    assert torch_products.rewrite(model) == 0


def test_an_operand_reshape_two_products_read_is_moved_once():
    """Two weight gradients x^T dy and x^T dz of one reshaped x: one Reshape of the bfloat16 x serves both, and the
    float32 copies go."""
    model = product_graph("Gemm", ["a", "b"], {"transA": 1}, reshape_operand={0: [6, 5], 1: [6, 7]})
    model.graph.node.extend([helper.make_node("Gemm", ["a.r", "b.r"], ["q"], name="second", transA=1, alpha=1.0),
                             helper.make_node("Cast", ["q"], ["z"], name="z.round", to=BF16)])  # fmt: skip
    model.graph.output.append(helper.make_tensor_value_info("z", BF16, None))
    rewritten = onnx.ModelProto.FromString(model.SerializeToString())
    assert torch_products.rewrite(rewritten) == 2
    assert sorted(node.input[0] for node in rewritten.graph.node if node.op_type == "Reshape") == ["a.bf16", "b.bf16"]
    assert not any(node.op_type == "Cast" and node.attribute[0].i == FLOAT and node.input[0] in ("a.bf16", "b.bf16")
                   for node in rewritten.graph.node)  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    feeds = {"a": torch.randn(2, 3, 5, generator=generator), "b": torch.randn(2, 3, 7, generator=generator)}
    ours, _ = run_split(model, feeds)
    expected = float64_reference("Gemm", {"transA": 1}, [feeds["a"].reshape(6, 5), feeds["b"].reshape(6, 7)])
    assert_within_one_bfloat16_unit(ours, expected, "x^T dy")


# ------------------------------------------------------------------------------------------- in the trainer
def _products_on_torch(trainer) -> int:
    session = trainer._train_session
    return sum(map(torch_products.is_product, session._model.graph.node)) if isinstance(session, split.SplitSession) else 0


def _transformer_trainer(kernels):
    options = cpu_options({**BFLOAT16, "utils": {"bfloat16_matmul_kernels": kernels}})
    trainer = ORTTrainer(Encoder(dropout=0.0), None, optim.SGDConfig(lr=LR), loss_fn=lm_loss, options=options)
    trainer.train_step(*token_batch())
    return trainer


@pytest.mark.parametrize("kernels", ["torch", "onnxruntime"])
def test_the_transformer_trains_as_torch_autocast_on_either_route(kernels):
    """Losses and every state_dict key over 4 steps within test_bfloat16's bound of torch.autocast's loop, every
    product of bfloat16 operands on torch (only attention's float32 ones left to ONNX Runtime) or every one emulated
    (no split)."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    batches = [token_batch(generator=generator) for _ in range(4)]
    options = cpu_options({**BFLOAT16, "utils": {"bfloat16_matmul_kernels": kernels}})
    trainer, *_ = run_parity(Encoder(dropout=0.0), batches, optim.SGDConfig(lr=LR), sgd, loss_fn=lm_loss, options=options,
                             reference_loss=autocast_loss(lm_loss), float64=True)  # fmt: skip
    if kernels == "onnxruntime":
        assert _products_on_torch(trainer) == 0
        return
    model = trainer._train_session._model
    left = [node.name for node in model.graph.node if node.op_type in ("MatMul", "Gemm", "FusedMatMul") and not torch_products.is_product(node)]
    assert _products_on_torch(trainer) >= 12 and torch_products.rewrite(onnx.ModelProto.FromString(model.SerializeToString())) == 0
    # attention's two products and their gradients: the bfloat16 symbolic computes attention in float32 (scaled operands)
    assert left and all(re.fullmatch(r"/model/layer/self_attn/MatMul_[12](_Grad/FusedMatMul_[06])?", name) for name in left), left


def test_auto_takes_torchs_kernels_on_a_cpu_with_bfloat16_instructions(monkeypatch):
    monkeypatch.setattr(torch_products, "fast_on_this_cpu", lambda: True)
    assert _products_on_torch(_transformer_trainer("auto")) > 0


def test_auto_keeps_the_emulation_on_a_cpu_without_and_says_so(monkeypatch):
    """Without bfloat16 instructions oneDNN's bfloat16 GEMMs are no faster: "auto" warns and emulates, "torch"
    takes them anyway."""
    monkeypatch.setattr(torch_products, "fast_on_this_cpu", lambda: False)
    with pytest.warns(UserWarning, match="no bfloat16 instructions .* utils.bfloat16_matmul_kernels 'torch'"):
        assert _products_on_torch(_transformer_trainer("auto")) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert _products_on_torch(_transformer_trainer("torch")) > 0


def test_an_invalid_choice_of_kernels_is_named():
    with pytest.raises(ValueError, match=r"utils.bfloat16_matmul_kernels: must be one of \['auto', 'torch', "
                                         r"'onnxruntime'\], got 'mkl'"):  # fmt: skip
        cpu_options({"utils": {"bfloat16_matmul_kernels": "mkl"}})
