"""An inference graph and its weights written as an ONNX file (``ORTTrainer.save_as_onnx``).

The graph reads its weights as graph inputs (their data is in torch tensors); the file holds them as
initializers. A protobuf message cannot pass 2 GiB, so a model whose weights would pass it is written as
the graph and, beside it, one file of the weights' bytes that the graph's initializers point into (ONNX's
external data, which ``onnxruntime.InferenceSession(path)`` and ``onnx.load(path)`` read). The weights
are written tensor by tensor from torch memory, never gathered into one message, and both files appear
only once whole (``checkpoint.written_whole``: a temporary file, synced and renamed).
"""

import os

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from ..update.checkpoint import written_whole

# a message's size limit (protobuf's 2 GiB), which the graph and its weights must stay under to be one file
PROTOBUF_LIMIT = onnx.checker.MAXIMUM_PROTOBUF


def save(model: onnx.ModelProto, weights: dict, path, external_data=None) -> None:
    """Write ``model``, whose graph inputs named in ``weights`` ({name: tensor}) become initializers, to ``path``.

    ``external_data`` None: the weights go to '<path>.data' beside it when the model would pass
    ``PROTOBUF_LIMIT``, else into the one file; True or False choose. ``path`` may be a binary file object
    for a model written as one file.
    """
    if external_data not in (None, True, False):
        raise TypeError(f"save_as_onnx's external_data must be None (when the model passes 2 GiB), True or False, got "
                        f"{external_data!r}")  # fmt: skip
    stored = [graph_input for graph_input in model.graph.input if graph_input.name in weights]
    size = model.ByteSize() + sum(_tensor_bytes(weights[graph_input.name]) for graph_input in stored)
    if external_data is None:
        external_data = size >= PROTOBUF_LIMIT
    if not external_data and size >= PROTOBUF_LIMIT:
        raise ValueError(f"save_as_onnx: the model and its weights are {size / 2**30:.2f} GiB, past the 2 GiB a single "
                         "ONNX file can hold; pass external_data=True or None (the weights in a file beside it)")  # fmt: skip
    if external_data and not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"save_as_onnx: a model written with external data needs a file path (its weights go in a file "
                        f"beside it), got a {type(path).__name__}")  # fmt: skip
    saved = onnx.ModelProto()
    saved.CopyFrom(model)
    kept = [graph_input for graph_input in saved.graph.input if graph_input.name not in weights]
    del saved.graph.input[:]
    saved.graph.input.extend(kept)
    names = [graph_input.name for graph_input in stored]
    if not external_data:
        saved.graph.initializer.extend(numpy_helper.from_array(_as_array(weights[name]), name) for name in names)
        onnx.save(saved, path)
        return
    data_path = f"{os.fspath(path)}.data"
    with written_whole(data_path) as temporary, open(temporary, "wb") as data:
        for name in names:
            saved.graph.initializer.append(_external_tensor(name, weights[name], data, os.path.basename(data_path)))
    with written_whole(os.fspath(path)) as temporary, open(temporary, "wb") as graph_file:
        graph_file.write(saved.SerializeToString())


def _as_array(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().contiguous().numpy()


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _external_tensor(name: str, tensor: torch.Tensor, data, location: str) -> onnx.TensorProto:
    """An initializer ``name`` whose bytes are appended to the open file ``data`` (named ``location`` beside the
    graph's file)."""
    array = _as_array(tensor)
    offset = data.tell()
    data.write(memoryview(array.reshape(-1)).cast("B"))
    entry = onnx.TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype), dims=array.shape)
    entry.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(array.nbytes))):
        entry.external_data.add(key=key, value=value)
    return entry
