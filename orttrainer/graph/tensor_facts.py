"""What ONNX shape inference says about a graph's tensors (element types and static shapes), inferred once
per build and handed to each question about that graph, or with the graph inputs fixed to one batch's shapes."""

from dataclasses import dataclass

import onnx

from . import rewrites


@dataclass(frozen=True)
class TensorFacts:
    """What one ONNX shape inference says about a graph's tensors: element types and static shapes.

    Inference walks the whole graph. A build infers its forward graph once and hands the result
    to each question about that graph (which weights reach the loss, which nodes lie on gradient
    paths, how much work the convolutions are) instead of each question inferring it again.
    Rewriting weights into graph inputs, naming nodes or dropping empty inputs changes no fact.
    """

    elem_types: dict  # tensor name -> ONNX element type (0: unknown)
    shapes: dict  # tensor name -> [size, or None where dynamic], initializers included


def infer_tensor_facts(model: onnx.ModelProto) -> TensorFacts:
    """One ONNX shape inference of ``model``, as TensorFacts."""
    inferred = onnx.shape_inference.infer_shapes(rewrites.structure_for_inference(model)).graph
    elem_types = {
        info.name: info.type.tensor_type.elem_type
        for info in list(inferred.value_info) + list(inferred.output) + list(inferred.input)
    }
    shapes = rewrites.shapes_in(list(inferred.value_info) + list(inferred.input) + list(inferred.output))
    shapes.update({initializer.name: list(initializer.dims) for initializer in model.graph.initializer})
    return TensorFacts(elem_types, shapes)


def shapes_at(model: onnx.ModelProto, sample_shapes: dict) -> dict:
    """Tensor name -> shape, inferred with the graph inputs fixed to ``sample_shapes``."""
    fixed = rewrites.structure_for_inference(model)
    for graph_input in fixed.graph.input:
        for dim, size in zip(graph_input.type.tensor_type.shape.dim, sample_shapes.get(graph_input.name, [])):
            dim.Clear()
            dim.dim_value = size
    inferred = onnx.shape_inference.infer_shapes(fixed, data_prop=True).graph
    shapes = {initializer.name: list(initializer.dims) for initializer in fixed.graph.initializer}
    shapes.update(rewrites.shapes_in(list(inferred.value_info) + list(inferred.input) + list(inferred.output)))
    return shapes
