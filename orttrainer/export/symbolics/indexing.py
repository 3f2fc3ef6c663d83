"""Indexing: advanced indexing and index_put, scatters that add (index_add, scatter_add, accumulate=True),
embeddings and embedding bags, splits, repeat_interleave, one_hot, diagonals, channel shuffles, a real matrix's
conjugate transpose."""

import numpy as np
import onnx
import torch
from torch.onnx import symbolic_helper
from torch.onnx._internal.torchscript_exporter import (_type_utils, symbolic_opset9, symbolic_opset11,
                                                       symbolic_opset13, symbolic_opset16)

from ...graph import rewrites
from ._graph import DOMAIN, _dtype, _ExportGraph, _module_scope


def _from_the_end_wrapped(g, index, size):
    """torch's negative index counts from the end: ``index + size`` where it is below 0."""
    negative = g.op("Less", index, g.op("Constant", value_t=torch.tensor(0, dtype=torch.int64)))
    return g.op("Where", negative, g.op("Add", index, size), index)


def index(g, self, indices):
    """``tensor[i, j]`` with integer index tensors: torch's symbolic, with negative indices first
    turned into their positive equivalent (its flattened-index formula is wrong for them)."""
    if not symbolic_helper._is_packed_list(indices):
        return symbolic_opset11.index(g, self, indices)
    listed = symbolic_helper._unpack_list(indices)
    shape = g.op("Shape", self)
    wrapped = []
    for dim, entry in enumerate(listed):
        integer = not symbolic_helper._is_none(entry) and entry.type().scalarType() not in ("Bool", "Byte")
        size = g.op("Gather", shape, g.op("Constant", value_t=torch.tensor([dim], dtype=torch.int64)), axis_i=0)
        wrapped.append(_from_the_end_wrapped(g, g.op("Cast", entry, to_i=7), size) if integer else entry)
    return symbolic_opset11.index(g, self, g.op("prim::ListConstruct", *wrapped))


@symbolic_helper.parse_args("v", "v", "i", "b", "v")
def embedding(g, weight, indices, padding_idx, scale_grad_by_freq, sparse):
    """A Gather; with padding_idx or scale_grad_by_freq, whose indices pass through a marker node.

    torch's own symbolic drops padding_idx (the padding row would train) and refuses
    scale_grad_by_freq. The marker carries both to exported_graph.py, which removes it and tells
    the trainer, which applies them to this lookup's gradient (outputs_for_trainer.EmbeddingGradient).
    """
    if padding_idx < 0 and not scale_grad_by_freq:
        return g.op("Gather", weight, indices)
    marked = g.op(f"{DOMAIN}::EmbeddingIndices", indices, padding_idx_i=padding_idx, scale_grad_by_freq_i=int(scale_grad_by_freq))
    marked.setType(indices.type())
    return g.op("Gather", weight, marked)


_BAG_MODES = ("sum", "mean", "max")


@symbolic_helper.parse_args("v", "v", "v", "i", "i", "i", "v", "i", "i")
def embedding_bag(g, weight, indices, offsets, scale_grad_by_freq, mode, sparse, per_sample_weights, include_last_offset,
                  padding_idx):  # fmt: skip
    """torch's embedding_bag without a Loop: the bags laid out as rows of a [bags, longest bag]
    index matrix, each row a bag's positions in ``indices``, the positions past its end (and the
    entries equal to ``padding_idx``) masked out; then a sum, mean or max over the rows' embeddings.

    torch's own symbolic writes a Loop over the bags, which onnxruntime-training cannot
    differentiate. Masked entries take 0 (sum, mean) or -inf (max) through a Where, so an inf
    or NaN embedding reaches only the bags that hold it, as in torch. mean divides the sum by
    the bag's size, an empty bag being 0 (size 1), as torch's kernel does. max follows torch's
    kernel, a running ``if value > current``: the bag's first entry if it is NaN, else the first
    of the largest values, NaN skipped; that entry alone gets the gradient.
    """
    if scale_grad_by_freq:
        raise ValueError(f"nn.EmbeddingBag '{_module_scope(g)}' with scale_grad_by_freq=True: orttrainer does not "
                         "train it (only nn.Embedding's); set scale_grad_by_freq=False")  # fmt: skip
    build, dtype = _ExportGraph(g), _dtype(weight)
    rows, valid, positions = _bags(build, weight, indices, offsets, include_last_offset, padding_idx)
    kept = build.unsqueeze(valid, [2])  # [bags, longest, 1]
    if not symbolic_helper._is_none(per_sample_weights):  # mode "sum" (torch refuses the others)
        return _weighted_sum(build, rows, kept, positions, per_sample_weights, dtype), None, None, None
    if _BAG_MODES[mode] == "max":
        empty = build.op("Equal", [build.reduce("ReduceMax", rewrites.mask(build, valid), [1], 1), build.const(0.0)])
        return build.op("Where", [empty, build.const(0, dtype), _first_running_max(build, rows, kept, dtype)]), None, None, None
    total = build.reduce("ReduceSum", build.op("Where", [kept, rows, build.const(0, dtype)]), [1], 0)
    if _BAG_MODES[mode] == "mean":
        sizes = build.reduce("ReduceSum", build.op("Where", [valid, build.const(1, dtype), build.const(0, dtype)]), [1], 1)
        total = build.op("Div", [total, build.op("Max", [sizes, build.const(1, dtype)])])
    return total, None, None, None


def _bags(build, weight, indices, offsets, include_last_offset, padding_idx):
    """([bags, longest bag, dim] embeddings of each bag's entries in order, [bags, longest bag]
    bool: which of them belong to the bag, [bags, longest bag] their positions in ``indices``
    (``len(indices)`` past a bag's end)). At least one column, so that an empty bag has an
    entry to take max over."""
    offsets, count = build.op("Cast", [offsets], to=onnx.TensorProto.INT64), build.op("Shape", [indices])
    if include_last_offset:  # torch's kernel ends the last bag at the end of ``indices``, whatever the last offset says
        offsets = build.op("Slice", [offsets, build.const([0], np.int64), build.const([-1], np.int64)])
    following = build.op("Slice", [offsets, build.const([1], np.int64), build.const([2**62], np.int64)])
    starts, ends = offsets, build.op("Concat", [following, count], axis=0)
    lengths = build.op("Sub", [ends, starts])
    longest = build.op("Max", [build.reduce("ReduceMax", lengths, [0], 0), build.const(1, np.int64)])
    steps = build.unsqueeze(build.op("Range", [build.const(0, np.int64), longest, build.const(1, np.int64)]), [0])
    valid = build.op("Less", [steps, build.unsqueeze(lengths, [1])])
    positions = build.op("Where", [valid, build.op("Add", [build.unsqueeze(starts, [1]), steps]), count])
    padded = build.op("Concat", [build.op("Cast", [indices], to=onnx.TensorProto.INT64), build.const([0], np.int64)], axis=0)
    words = build.op("Gather", [padded, positions])  # past a bag's end: position `count`, word 0
    if padding_idx is not None and padding_idx >= 0:
        valid = build.op("And", [valid, build.op("Not", [build.op("Equal", [words, build.const(padding_idx, np.int64)])])])
    return build.op("Gather", [weight, words]), valid, positions


def _weighted_sum(build, rows, kept, positions, per_sample_weights, dtype):
    """[bags, dim]: each bag's sum of its embeddings times their per-sample weights, in float64.
    torch's kernel adds each product with a fused multiply-add, which does not overflow where
    the product alone would (2 * FLT_MAX next to -inf is -inf there); float64 products do not
    overflow either, and round to what torch's float32 sums round to."""
    double = onnx.TensorProto.DOUBLE
    padded = build.op("Concat", [per_sample_weights, build.const([0], dtype)], axis=0)
    weights = build.unsqueeze(build.op("Cast", [build.op("Gather", [padded, positions])], to=double), [2])
    products = build.op("Mul", [build.op("Cast", [rows], to=double), weights])
    total = build.reduce("ReduceSum", build.op("Where", [kept, products, build.const(0, np.float64)]), [1], 0)
    return build.op("Cast", [total], to=_type_utils.JitScalarType.from_dtype(dtype).onnx_type())


def _first_running_max(build, rows, kept, dtype):
    """[bags, dim]: what torch's max bag computes, ``current = value if value > current`` over
    the bag's entries from its first: the first entry if it is NaN (nothing is greater than
    NaN), else the first of the largest, NaN entries never taken. Gathered from ``rows``, so
    that entry alone gets the gradient."""
    shape = build.op("Shape", [rows])
    first = build.op("ArgMax", [build.op("Expand", [rewrites.mask(build, kept), shape])], axis=1, keepdims=1)
    nan = build.op("IsNaN", [rows])
    candidates = build.op("Where", [build.op("Or", [build.op("Not", [kept]), nan]), build.const(-np.inf, dtype), rows])
    largest = build.reduce("ReduceMax", candidates, [1], 1)
    ties = build.op("And", [build.op("Equal", [candidates, largest]), kept])
    first_tie = build.op("ArgMax", [rewrites.mask(build, ties)], axis=1, keepdims=1)
    first_is_nan = build.op("IsNaN", [build.op("GatherElements", [rows, first], axis=1)])
    chosen = build.op("Where", [first_is_nan, first, first_tie])
    return build.squeeze(build.op("GatherElements", [rows, chosen], axis=1), [1])


def repeat_interleave(g, self, repeats, dim=None, output_size=None):
    """torch's symbolic, on a constant of its own for ``dim``: torch's adds the rank to a negative dim in place, in
    the tensor of the trace's constant, which the trace shares with every later use of the same number (Cohere's
    rotary ``repeat_interleave(freqs, 2, dim=-1)`` on a rank-3 tensor turned the -1 of a later ``torch.stack`` into
    2, and a softmax over dim=-1 would have run over another axis)."""
    if not symbolic_helper._is_none(dim) and symbolic_helper._is_constant(dim):
        dim = g.op("Constant", value_t=torch.tensor(symbolic_helper._get_const(dim, "i", "dim")))
    torch_symbolic = symbolic_opset13.repeat_interleave if g.opset >= 13 else symbolic_opset9.repeat_interleave
    return torch_symbolic(g, self, repeats, dim, output_size)


def one_hot(g, x, num_classes):
    """torch's symbolic, refused for num_classes=-1: torch then takes the number of classes from the batch's largest
    value, which the graph would keep from the first batch (ONNX Runtime failed on a depth of -1)."""
    if symbolic_helper._maybe_get_const(num_classes, "i") == -1:
        raise ValueError(f"F.one_hot in module '{_module_scope(g)}' without num_classes takes the number of classes from "
                         "the batch's largest value; pass num_classes")  # fmt: skip
    return symbolic_opset9.one_hot(g, x, num_classes)


def split(g, x, split_size_or_sizes, dim, _outputs=None):
    """torch's symbolic, except ``x.split(k, dim)`` along a dimension whose size changes with the batch: torch's took
    the size to be k times the number of parts, so a last part shorter than k failed in ONNX Runtime ("Sum of sizes in
    'split'"). Here the parts are Slices, the last one to the end."""
    torch_symbolic = symbolic_opset13.split if g.opset >= 13 else symbolic_opset11.split
    axis = symbolic_helper._maybe_get_const(dim, "i")
    dynamic = isinstance(axis, int) and symbolic_helper._get_tensor_dim_size(x, axis) is None
    if not (dynamic and _outputs and symbolic_helper._is_constant(split_size_or_sizes)):
        return torch_symbolic(g, x, split_size_or_sizes, dim, _outputs)
    if symbolic_helper._node_get(split_size_or_sizes.node(), "value").dim() > 0:  # sizes given: torch's is right
        return torch_symbolic(g, x, split_size_or_sizes, dim, _outputs)
    size, build = symbolic_helper._get_const(split_size_or_sizes, "i", "split_size"), _ExportGraph(g)
    bounds = [part * size for part in range(_outputs)] + [2**63 - 1]
    return [build.op("Slice", [x, build.const([start], np.int64), build.const([end], np.int64), build.const([axis], np.int64)])
            for start, end in zip(bounds, bounds[1:])]  # fmt: skip


@symbolic_helper.parse_args("v", "i", "i", "i")
def diagonal(g, x, offset, dim1, dim2):
    """torch's diagonal (``torch.diagonal``, ``Tensor.diag`` of a matrix): the diagonal's positions gathered from
    the rows it crosses, appended as the last dimension.

    torch's symbolic multiplied x by an eye mask and summed each row, so an inf or NaN anywhere in a row made its
    diagonal value NaN, and wrote an If for an empty diagonal, which the gradient builder cannot pass.
    """
    rank = symbolic_helper._get_tensor_rank(x)
    if rank is None:
        return symbolic_helper._unimplemented("diagonal", "unknown input rank", x)
    dim1, dim2 = dim1 % rank, dim2 % rank
    build = _ExportGraph(g)
    moved = build.op("Transpose", [x], perm=[dim for dim in range(rank) if dim not in (dim1, dim2)] + [dim1, dim2])
    shape = build.op("Shape", [moved])
    rows = build.op("Slice", [shape, build.const([rank - 2], np.int64), build.const([rank - 1], np.int64)])
    columns = build.op("Slice", [shape, build.const([rank - 1], np.int64), build.const([rank], np.int64)])
    first_row, first_column = max(-offset, 0), max(offset, 0)
    length = build.op("Max", [build.op("Min", [build.op("Sub", [rows, build.const([first_row], np.int64)]),
                                               build.op("Sub", [columns, build.const([first_column], np.int64)])]),
                              build.const([0], np.int64)])  # fmt: skip
    crossed = build.op("Slice", [moved, build.const([first_row], np.int64),
                                 build.op("Add", [length, build.const([first_row], np.int64)]), build.const([-2], np.int64)])  # fmt: skip
    scalar_length = symbolic_helper._squeeze_helper(g, length, [0])
    positions = build.op("Range", [build.const(first_column, np.int64),
                                   build.op("Add", [scalar_length, build.const(first_column, np.int64)]), build.const(1, np.int64)])  # fmt: skip
    batch = build.op("Slice", [shape, build.const([0], np.int64), build.const([rank - 2], np.int64)])
    index_shape = build.op("Concat", [batch, length, build.const([1], np.int64)], axis=0)
    indices = build.op("Expand", [symbolic_helper._unsqueeze_helper(g, positions, [1]), index_shape])
    return symbolic_helper._squeeze_helper(g, build.op("GatherElements", [crossed, indices], axis=rank - 1), [rank - 1])


@symbolic_helper.parse_args("v", "i")
def diag(g, x, offset):
    """torch's diag of a matrix (its diagonal, as ``diagonal``), which the exporter has no symbolic for."""
    if symbolic_helper._get_tensor_rank(x) != 2:
        return symbolic_helper._unimplemented("diag", "of a vector (the matrix made from it)", x)
    return diagonal(g, x, offset, 0, 1)


@symbolic_helper.parse_args("v", "i")
def channel_shuffle(g, x, groups):
    """torch's channel_shuffle (nn.ChannelShuffle): channels viewed as [groups, C / groups],
    transposed, flattened back. A permutation, so exact; the exporter has no symbolic for it."""
    build = _ExportGraph(g)
    shape = build.op("Shape", [x])
    channels = build.op("Slice", [shape, build.const([1], np.int64), build.const([2], np.int64)])
    grouped = build.op("Concat", [build.op("Slice", [shape, build.const([0], np.int64), build.const([1], np.int64)]),
                                  build.const([groups], np.int64), build.op("Div", [channels, build.const([groups], np.int64)]),
                                  build.const([-1], np.int64)], axis=0)  # fmt: skip
    swapped = build.op("Transpose", [build.op("Reshape", [x, grouped])], perm=[0, 2, 1, 3])
    return build.op("Reshape", [swapped, shape])


# ScatterElements and ScatterND add the values sent to one place (reduction='add') from this opset on; before
# it a scatter keeps one of them, where torch adds them all.
_ADDING_SCATTER_OPSET = 16


def _refuse_before_adding_scatters(g, call: str) -> None:
    if g.opset < _ADDING_SCATTER_OPSET:
        raise ValueError(f"{call} in module '{_module_scope(g)}' adds up the values of repeated indices, which an ONNX "
                         f"scatter does from opset {_ADDING_SCATTER_OPSET} on; this export is at opset {g.opset}: set "
                         f"ORTTrainerOptions({{'_internal_use': {{'onnx_opset_version': {_ADDING_SCATTER_OPSET}}}}}) "
                         "or higher")  # fmt: skip


def scatter_add(g, self, dim, index, source):
    """torch's symbolic from opset 16 on (a ScatterElements adding into ``self``); refused below, where it
    scatters into zeros and keeps one value per repeated index."""
    _refuse_before_adding_scatters(g, "scatter_add")
    return symbolic_opset16.scatter_add(g, self, dim, index, source)


@symbolic_helper.parse_args("v", "i", "v", "v", "v")
def index_add(g, self, dim, index, source, alpha=None):
    """torch.index_add: every slice of ``source`` added at its index, repeated indices included, in one
    ScatterElements adding into ``self``. torch's symbolic scatters into zeros without reduction, which keeps
    one slice per repeated index (its warning says so)."""
    _refuse_before_adding_scatters(g, "index_add")
    rank = symbolic_helper._get_tensor_rank(self)
    if rank is None or symbolic_helper._get_tensor_rank(source) != rank:
        raise ValueError(f"index_add in module '{_module_scope(g)}' needs a tensor and a source of the same known rank")
    dim %= max(rank, 1)
    if not symbolic_helper._is_none(alpha) and symbolic_helper._maybe_get_const(alpha, "f") != 1:
        scalar_type = _type_utils.JitScalarType.from_value(source)
        source = g.op("Mul", source, g.op("Cast", alpha, to_i=scalar_type.onnx_type()))
    along_dim = [1] * dim + [-1] + [1] * (rank - dim - 1)
    index = g.op("Reshape", index, g.op("Constant", value_t=torch.tensor(along_dim, dtype=torch.int64)))
    index = g.op("Expand", index, g.op("Shape", source))
    return g.op("ScatterElements", self, index, source, axis_i=dim, reduction_s="add")


def _broadcast_mask(self, indices, values):
    """The mask of ``self[mask] = values`` when ``values`` is one value per selected element's position (broadcast
    to every selected element: Wav2Vec2's ``hidden_states[mask_time_indices] = self.masked_spec_embed``), else None."""
    listed = symbolic_helper._unpack_list(indices) if symbolic_helper._is_packed_list(indices) else [indices]
    if len(listed) != 1 or not symbolic_helper._is_bool(listed[0]):
        return None
    ranks = [symbolic_helper._get_tensor_rank(value) for value in (self, listed[0], values)]
    if None in ranks:
        return None
    data_rank, mask_rank, values_rank = ranks
    per_position = 0 < values_rank <= data_rank - mask_rank
    return listed[0] if per_position else None


def index_put(g, self, indices, values, accumulate=False):
    """torch's symbolic, except:

    - ``accumulate=True`` with integer indices: one ScatterND adding into ``self``, repeated indices included.
      torch's scatters into zeros without reduction, which keeps one value per repeated index. A boolean mask
      (each element at most once) is placed into -0 zeros, the identity of +, and added;
    - a boolean mask whose values broadcast to every selected element (``_broadcast_mask``): a Where.
      torch's passed them to a masked_scatter, which takes one value per selected element, and ONNX Runtime
      failed on the shapes."""
    if symbolic_helper._parse_arg(accumulate, "b"):
        return _accumulated(g, self, indices, values)
    mask = _broadcast_mask(self, indices, values)
    if mask is None:
        return symbolic_opset11.index_put(g, self, indices, values, accumulate)
    mask_rank, data_rank = symbolic_helper._get_tensor_rank(mask), symbolic_helper._get_tensor_rank(self)
    mask = symbolic_helper._unsqueeze_helper(g, mask, list(range(mask_rank, data_rank)))
    scalar_type = _type_utils.JitScalarType.from_value(self)
    return g.op("Where", mask, g.op("Cast", values, to_i=scalar_type.onnx_type()), self)


def _accumulated(g, self, indices, values):
    """``self.index_put(indices, values, accumulate=True)`` (see ``index_put``)."""
    scalar_type = _type_utils.JitScalarType.from_value(self)
    zeros = g.op("ConstantOfShape", g.op("Shape", self), value_t=torch.tensor([-0.0], dtype=scalar_type.dtype()))
    placed = index_put(g, zeros, indices, values, False)
    if placed.node().kind() != "onnx::ScatterND":
        return g.op("Add", self, placed)
    _refuse_before_adding_scatters(g, "index_put with accumulate=True")
    return g.op("ScatterND", self, placed.node().inputsAt(1), placed.node().inputsAt(2), reduction_s="add")


def matrix_H(g, x):
    """``x.H`` (``x.mH``) of a real matrix (a batch of them): its transpose over the last two dimensions, which torch's
    exporter has no form for (spectral_norm's power iteration reads weight_mat.H). ONNX holds no complex tensors."""
    rank = symbolic_helper._get_tensor_rank(x)
    return g.op("Transpose", x, perm_i=[*range(rank - 2), rank - 1, rank - 2])


SYMBOLICS = {
    "index": index,
    "matrix_H": matrix_H,
    "mH": matrix_H,
    "index_put": index_put,
    "index_add": index_add,
    "scatter_add": scatter_add,
    "repeat_interleave": repeat_interleave,
    "one_hot": one_hot,
    "split": split,
    "embedding": embedding,
    "embedding_bag": embedding_bag,
    "channel_shuffle": channel_shuffle,
    "diagonal": diagonal,
    "diag": diag,
}
