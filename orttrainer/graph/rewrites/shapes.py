"""Shapes a graph has before it runs: ONNX shape inference on a copy without the weights' data
(``structure_for_inference``, ``copy_with_inputs_for``), as named sizes (``symbolic_shapes``) or numbers
(``static_shapes``). Its own module because rewrites, pools and convolutions passes, folding and the graph
build all read it.
"""

import numpy as np
import onnx
from onnx import helper


def symbolic_dim(dim):
    """A dimension's size, its dim_param, or None: also for the names onnx's inference makes up
    for sizes it cannot tell (unk__N), which ONNX Runtime's own inference leaves unnamed."""
    if dim.HasField("dim_value"):
        return dim.dim_value
    return dim.dim_param if dim.dim_param and not dim.dim_param.startswith("unk__") else None


# Initializers larger than this are weights to shape inference: their shape is what it reads (the
# values it propagates are shape-sized integer tensors).
_INFERENCE_READS_VALUES_UP_TO = 1024


def copy_with_inputs_for(model: onnx.ModelProto, names) -> onnx.ModelProto:
    """A copy of ``model`` in which the initializers ``names`` are graph inputs of their type and shape;
    their data is not copied (a model's weights can be most of a process's memory)."""
    wanted = set(names)
    copied = _copy_without(model, "graph")
    graph = copied.graph
    graph.CopyFrom(_copy_without(model.graph, "initializer"))
    declared = {graph_input.name for graph_input in graph.input}
    for initializer in model.graph.initializer:
        if initializer.name not in wanted:
            graph.initializer.add().CopyFrom(initializer)
        elif initializer.name not in declared:
            graph.input.append(helper.make_tensor_value_info(initializer.name, initializer.data_type, list(initializer.dims)))
    return copied


def structure_for_inference(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` as shape inference needs it: the weights' shapes without their data (``copy_with_inputs_for``)."""
    large = [init.name for init in model.graph.initializer if np.prod(init.dims) > _INFERENCE_READS_VALUES_UP_TO]
    return copy_with_inputs_for(model, large)


def _copy_without(message, skipped: str):
    """A copy of a protobuf ``message`` without its field ``skipped``."""
    copied = type(message)()
    for descriptor, value in message.ListFields():
        if descriptor.name == skipped:
            continue
        # protobuf >= 5.28 says is_repeated; older ones only label (removed in 7)
        repeated = descriptor.is_repeated if hasattr(descriptor, "is_repeated") else descriptor.label == descriptor.LABEL_REPEATED
        if repeated:
            getattr(copied, descriptor.name).extend(value)
        elif descriptor.type == descriptor.TYPE_MESSAGE:
            getattr(copied, descriptor.name).CopyFrom(value)
        else:
            setattr(copied, descriptor.name, value)
    return copied


def shapes_in(value_infos) -> dict:
    """Tensor name -> shape of the value infos that have one (None for a dynamic dimension)."""
    return {
        info.name: [dim.dim_value if dim.HasField("dim_value") else None for dim in info.type.tensor_type.shape.dim]
        for info in value_infos
        if info.type.tensor_type.HasField("shape")
    }


def symbolic_shapes(model: onnx.ModelProto) -> dict:
    """Tensor name -> shape from ONNX shape inference: sizes, dim_param names, None where unknown."""
    inferred = onnx.shape_inference.infer_shapes(structure_for_inference(model), data_prop=True).graph  # sizes from Shape ops too
    shapes = {}
    for info in list(inferred.value_info) + list(inferred.input) + list(inferred.output):
        tensor_type = info.type.tensor_type
        if tensor_type.HasField("shape"):
            shapes[info.name] = [symbolic_dim(dim) for dim in tensor_type.shape.dim]
    for initializer in model.graph.initializer:
        shapes[initializer.name] = list(initializer.dims)
    return shapes


def static_shapes(model: onnx.ModelProto, symbols: dict = None) -> dict:
    """Tensor name -> shape from ONNX shape inference (None for dynamic dims)."""
    symbols = symbolic_shapes(model) if symbols is None else symbols
    return {name: [dim if isinstance(dim, int) else None for dim in shape] for name, shape in symbols.items()}
