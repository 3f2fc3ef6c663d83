"""A bfloat16 graph's matrix products on torch's bfloat16 kernels, in a split graph (torch_convolutions.py).

ONNX Runtime 1.19.2's CPU provider has no bfloat16 MatMul or Gemm, so graph/bfloat16.py runs a product of bfloat16
operands as a float32 one between casts: ``Cast(bfloat16) -> Cast(float32) -> MatMul -> Cast(bfloat16)``, and the
gradient builder writes the products of its gradients the same way (``MatMul``, ``Gemm``, ``FusedMatMul``, with a
``Reshape`` between an operand's cast and the product, or between the product and its rounding). Each is what
torch.autocast computes in one call: ``torch.matmul`` or ``addmm`` on the bfloat16 tensors (products summed in
float32, the result rounded once). On a CPU with bfloat16 instructions (AVX512-BF16, AMX) torch's oneDNN kernels
run those at several times their float32 rate (benchmarks/NOTES.md §57).

``rewrite`` replaces each such product, in place, by a node of the torch domain that reads the bfloat16 tensors
and writes the rounded one (a ``Reshape`` on either side moves to the bfloat16 tensor: it only moves values); the
float32 copies nothing else reads go. Where ONNX Runtime's gradient builder (its nodes' names hold ``_Grad/``) sums
a product of bfloat16 operands in float32 before rounding (a broadcast product's ``ReduceSum``, the input gradients
of several products of one tensor added up), the product on torch rounds first, then is cast to float32 for that
sum: torch's autograd rounds each product, and sums bfloat16 gradients. A :class:`~orttrainer.torch_convolutions.SplitSession` runs those nodes
with ``step``.
"""

import dataclasses

import onnx
import torch
from onnx import helper

from ..graph import bfloat16
from ..graph.rewrites import node_attributes
from .torch_ops import TORCH_DOMAIN, NodeStep

_FLOAT, _BFLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.BFLOAT16
_PRODUCTS = {("", "MatMul"), ("ai.onnx", "MatMul"), ("", "Gemm"), ("ai.onnx", "Gemm"), ("com.microsoft", "FusedMatMul")}


def fast_on_this_cpu() -> bool:
    """Whether torch's bfloat16 GEMMs run on bfloat16 instructions here (AVX512-BF16 or AMX); elsewhere oneDNN
    converts to float32 inside the kernel and the products are no faster than ONNX Runtime's float32 ones."""
    capable = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    return torch.backends.mkldnn.is_available() and any(check is not None and check() for check in capable)


@dataclasses.dataclass
class _Product:
    """A product whose float32 operands are bfloat16 tensors cast up and whose result is only rounded to bfloat16."""

    node: onnx.NodeProto
    operands: list  # per input: (the bfloat16 tensor, the Reshape between its cast and the product, or None)
    rounding: onnx.NodeProto  # the Cast to bfloat16 of the result, or None where float32 ops read it
    reshape: onnx.NodeProto  # the Reshape between the product and that Cast, or None


def _is_cast(node, to: int) -> bool:
    return node is not None and node.op_type == "Cast" and node_attributes(node).get("to") == to


def _single_reader(readers: dict, name: str, graph_outputs: set):
    found = readers.get(name, [])
    return found[0] if len(found) == 1 and name not in graph_outputs else None


def _bfloat16_tensors(nodes) -> set:
    """The tensors of a graph bfloat16.compute_in_float32 left that are bfloat16: those Casts to bfloat16 write, and
    what its ``MOVING_OPS`` make of them (``nodes`` in graph order)."""
    found = set()
    for node in nodes:
        moved = node.op_type in bfloat16.MOVING_OPS and node.domain in ("", "ai.onnx") and node.input[0] in found
        if moved or _is_cast(node, _BFLOAT16):
            found.add(node.output[0])
    return found


def _bfloat16_source(name: str, producers: dict, bfloat16_tensors: set):
    """(bfloat16 tensor, Reshape or None) when ``name`` is a bfloat16 tensor cast to float32, maybe reshaped; else None."""
    reshape = producers.get(name)
    if reshape is not None and reshape.op_type == "Reshape":
        name = reshape.input[0]
    else:
        reshape = None
    cast = producers.get(name)
    if not _is_cast(cast, _FLOAT) or cast.input[0] not in bfloat16_tensors:
        return None
    return cast.input[0], reshape


def _computes_as_torch(node: onnx.NodeProto) -> bool:
    """A product whose attributes torch's call takes: no scaling but Gemm's bias, no batch transposes."""
    attributes = node_attributes(node)
    if node.op_type == "FusedMatMul":
        return attributes.get("alpha", 1.0) == 1.0 and not attributes.get("transBatchA", 0) and not attributes.get("transBatchB", 0)
    if node.op_type == "Gemm":
        return attributes.get("alpha", 1.0) == 1.0
    return True


def _products(model: onnx.ModelProto) -> list:
    nodes = model.graph.node
    producers = {name: node for node in nodes for name in node.output if name}
    readers = {}
    for node in nodes:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    graph_outputs = {output.name for output in model.graph.output}
    bfloat16_tensors = _bfloat16_tensors(nodes)
    found = []
    for node in nodes:
        if (node.domain, node.op_type) not in _PRODUCTS or not _computes_as_torch(node) or len(node.output) != 1:
            continue
        operands = [_bfloat16_source(name, producers, bfloat16_tensors) for name in node.input]
        reader = _single_reader(readers, node.output[0], graph_outputs)
        reshape = reader if reader is not None and reader.op_type == "Reshape" else None
        rounding = _single_reader(readers, reshape.output[0], graph_outputs) if reshape is not None else reader
        if not all(operands):
            continue
        if _is_cast(rounding, _BFLOAT16):
            found.append(_Product(node, operands, rounding, reshape))
        elif "_Grad/" in node.name:  # a gradient summed in float32 (a broadcast's ReduceSum, gradients added up)
            found.append(_Product(node, operands, None, None))
    return found


def is_product(node: onnx.NodeProto) -> bool:
    """A product ``rewrite`` left for torch."""
    return node.domain == TORCH_DOMAIN and node.op_type in {op_type for _, op_type in _PRODUCTS}


def products_for_torch(model: onnx.ModelProto) -> set:
    """Names of the products torch runs: those ``rewrite`` would replace or has replaced."""
    return {product.node.name for product in _products(model)} | {node.name for node in model.graph.node if is_product(node)}


def rewrite(model: onnx.ModelProto) -> int:
    """Replace, in place, each product of bfloat16 operands rounded to bfloat16, or summed in float32 by the
    gradient builder, by a torch-domain node on the bfloat16 tensors (the module docstring); return how many."""
    products = _products(model)
    replaced = {}  # id of a node: the nodes that take its place
    moved = set()  # the operands' Reshapes already moved to the bfloat16 tensor (two products may read one)
    for product in products:
        inputs = []
        for source, reshape in product.operands:
            if reshape is None:
                inputs.append(source)
                continue
            inputs.append(f"{reshape.output[0]}.bfloat16")
            if inputs[-1] not in moved:
                moved.add(inputs[-1])
                replaced.setdefault(id(product.node), []).append(_reshaped(reshape, source, inputs[-1]))
        rounded_by_torch = product.rounding is not None and product.reshape is None  # torch writes the rounded tensor
        result = product.rounding.output[0] if rounded_by_torch else f"{product.node.output[0]}.bfloat16"
        torch_node = helper.make_node(product.node.op_type, inputs, [result], name=product.node.name, domain=TORCH_DOMAIN)
        torch_node.attribute.extend(product.node.attribute)
        replaced.setdefault(id(product.node), []).append(torch_node)
        if product.rounding is None:
            replaced[id(product.node)].append(
                helper.make_node("Cast", [result], [product.node.output[0]], name=f"{product.node.name}/float32", to=_FLOAT))
            continue
        rounded = [] if product.reshape is None else [_reshaped(product.reshape, result, product.rounding.output[0])]
        replaced[id(product.rounding)] = rounded
        if product.reshape is not None:
            replaced[id(product.reshape)] = []
    kept = [new for node in model.graph.node for new in replaced.get(id(node), [node])]
    del model.graph.node[:]
    model.graph.node.extend(_without_unread_casts(kept, {output.name for output in model.graph.output}))
    return len(products)


def _reshaped(reshape: onnx.NodeProto, source: str, target: str) -> onnx.NodeProto:
    """``reshape`` (its shape and attributes) applied to ``source``, written to ``target``."""
    moved = helper.make_node("Reshape", [source, reshape.input[1]], [target], name=f"{reshape.name}/bfloat16")
    moved.attribute.extend(reshape.attribute)
    return moved


def _without_unread_casts(nodes: list, graph_outputs: set) -> list:
    """``nodes`` without the Casts and Reshapes nothing reads any more (the float32 copies of the products'
    operands), last first, so that a Reshape's Cast goes with it."""
    read = {}
    for node in nodes:
        for name in node.input:
            read[name] = read.get(name, 0) + 1
    kept = []
    for node in reversed(nodes):
        unread = node.op_type in ("Cast", "Reshape") and not any(read.get(name) or name in graph_outputs for name in node.output)
        if unread:
            for name in node.input:
                read[name] -= 1
        else:
            kept.append(node)
    return kept[::-1]


class _MatMul(NodeStep):
    """``MatMul`` (numpy's broadcasting, as torch's) and com.microsoft's ``FusedMatMul`` (the last two dims of either
    operand transposed) as ``torch.matmul``."""

    def run(self, values: dict) -> dict:
        a, b = (values[name] for name in self.inputs)
        if self.attributes.get("transA", 0) and a.dim() >= 2:
            a = a.transpose(-1, -2)
        if self.attributes.get("transB", 0) and b.dim() >= 2:
            b = b.transpose(-1, -2)
        return {self.outputs[0]: torch.matmul(a, b)}


class _Gemm(NodeStep):
    """``Gemm`` (alpha 1) as ``torch.addmm``, or ``torch.mm`` without a bias or with beta 0 (ONNX ignores C then)."""

    def run(self, values: dict) -> dict:
        a, b = values[self.inputs[0]], values[self.inputs[1]]
        a = a.t() if self.attributes.get("transA", 0) else a
        b = b.t() if self.attributes.get("transB", 0) else b
        beta = self.attributes.get("beta", 1.0)
        if len(self.inputs) < 3 or not self.inputs[2] or beta == 0.0:
            return {self.outputs[0]: torch.mm(a, b)}
        return {self.outputs[0]: torch.addmm(values[self.inputs[2]], a, b, beta=beta)}


def step(node: onnx.NodeProto) -> NodeStep:
    """The torch step of a product ``rewrite`` left (``is_product``)."""
    return _Gemm(node) if node.op_type == "Gemm" else _MatMul(node)
