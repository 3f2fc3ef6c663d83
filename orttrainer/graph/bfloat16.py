"""bfloat16 mixed precision: a graph exported under ``torch.autocast(dtype=torch.bfloat16)`` computed in float32
between casts, rounding where torch rounds.

The trace records torch's autocast policy as it ran: Casts of the weights and activations to bfloat16 before the
ops autocast runs in bfloat16 (matrix products, convolutions), bfloat16 ops downstream of them until a Cast back to
float32 (losses, the ops autocast runs in float32). ONNX Runtime 1.19.2's CPU provider has bfloat16 kernels for
Cast and data movement only (none for MatMul, Gemm, Add, Softmax, ...), so every other op with a bfloat16 input
or output runs in float32: its bfloat16 inputs cast to float32 (exact), its bfloat16 outputs computed in float32
and rounded to bfloat16. A matrix product of bfloat16 operands is then exact in its products and sums them in
float32, as torch's bfloat16 GEMMs do, and an elementwise op or a reduction computes in float32 and rounds once,
as torch's bfloat16 CPU kernels do. The bfloat16 tensors of the graph are torch's, so the gradients ONNX Runtime
builds round where torch's autograd rounds (the gradient of a bfloat16 tensor is bfloat16).
"""

import onnx
from onnx import helper

from .graph_edits import with_ir_version

BFLOAT16 = onnx.TensorProto.BFLOAT16
# Ops that keep their bfloat16 inputs and outputs: they convert, or only make values (kernels for every type)
_KEPT_OPS = ("Cast", "Constant")
# Ops that only move values, with bfloat16 kernels in ONNX Runtime 1.19.2's CPU provider, whose gradients are the
# same ops: on a bfloat16 tensor they stay bfloat16 (a float32 round trip would give the same values, in two casts)
MOVING_OPS = ("Transpose", "Reshape", "Identity", "Squeeze", "Unsqueeze")


def casts_to_bfloat16(model: onnx.ModelProto) -> bool:
    """Whether ``model`` holds a bfloat16 tensor (a graph exported under torch.autocast with bfloat16)."""
    return BFLOAT16 in _elem_types(model).values()


def compute_in_float32(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every op that reads or writes a bfloat16 tensor, but casts and ``MOVING_OPS``, computing in
    float32 between casts (the module docstring). The bfloat16 tensors keep their names, graph inputs and outputs their types."""
    model = with_ir_version(model)
    types = _elem_types(model)
    to_float32 = {}  # bfloat16 tensor -> its float32 copy, one Cast per tensor
    nodes = []
    for node in model.graph.node:
        moves_bfloat16 = node.op_type in MOVING_OPS and node.domain in ("", "ai.onnx") and types.get(node.input[0]) == BFLOAT16
        if node.op_type in _KEPT_OPS or moves_bfloat16 or not any(types.get(name) == BFLOAT16 for name in (*node.input, *node.output)):
            nodes.append(node)
            continue
        for position, name in enumerate(node.input):
            if types.get(name) == BFLOAT16:
                if name not in to_float32:
                    to_float32[name] = f"{name}.float32"
                    nodes.append(_cast(name, to_float32[name], onnx.TensorProto.FLOAT))
                node.input[position] = to_float32[name]
        nodes.append(node)
        for position, name in enumerate(node.output):
            if types.get(name) == BFLOAT16:
                node.output[position] = f"{name}.unrounded"
                nodes.append(_cast(node.output[position], name, BFLOAT16))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def _cast(source: str, target: str, to: int) -> onnx.NodeProto:
    return helper.make_node("Cast", [source], [target], name=f"{target}.cast", to=to)


def _elem_types(model: onnx.ModelProto) -> dict:
    """{tensor name: ONNX element type} of every tensor ONNX's type inference can type."""
    inferred = onnx.shape_inference.infer_shapes(model).graph
    values = [*inferred.input, *inferred.value_info, *inferred.output]
    types = {value.name: value.type.tensor_type.elem_type for value in values if value.type.HasField("tensor_type")}
    types.update({initializer.name: initializer.data_type for initializer in inferred.initializer})
    return types
