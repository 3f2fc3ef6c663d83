"""Checkpoints: the state_dict schema, HDF5 storage, and aggregation of per-rank files.

Layout (the legacy one): ``/model/full_precision/<weight>``, ``/optimizer/<weight>/{Moment_1,
Moment_2,Update_Count}``, ``/optimizer/shared_optimizer_state/Step``, ``/trainer_options/*``,
``/train_step_info/*``, optional ``/partition_info/<weight>/*`` and ``/user_dict``.

Values are stored natively (no pickle): dicts become groups, arrays/tensors/numbers/strings
datasets, lists and None carry a marker attribute so they come back as written; a numeric
dataset carries the CRC-32 of its data, checked whenever it is read. Writes go to a temporary
file beside the target that is flushed, synced and renamed, so ``path`` never holds a
half-written checkpoint.

``load`` reads a file whole; ``load(path, lazily=True)`` leaves the tensors a trainer loads in the
file (``StoredTensor``), to be read one by one straight into the trainer's own tensors.
"""

import contextlib
import math
import os
import pickle
import tempfile
import zlib

import h5py
import numpy as np
import torch

_KIND = "orttrainer_kind"  # attribute marking values HDF5 has no type for
_CHECKSUM = "orttrainer_crc32"  # attribute: the CRC-32 of a numeric dataset's data, as written
_NUMERIC = "biufc"  # numpy dtype kinds that carry a checksum and can be StoredTensors
_CHECKPOINT_GROUPS = ("model", "optimizer", "train_step_info", "trainer_options")
_TENSOR_GROUPS = ("model", "optimizer", "gradient_accumulation")  # what a trainer copies into its own tensors
_BLOCK_BYTES = 64 << 20  # how much of a dataset ``_verify`` reads at once


class CheckpointError(ValueError):
    """A file that is not a complete checkpoint, or a value that cannot be stored."""


def _checksum(array: np.ndarray, running: int = 0) -> int:
    """CRC-32 of ``array``'s bytes; ``running``: that of the blocks before it, for a dataset read in blocks."""
    return zlib.crc32(np.ascontiguousarray(array).reshape(-1).view(np.uint8), running)


class StoredTensor:
    """A numeric dataset of a checkpoint opened by ``load(path, lazily=True)``: ``shape`` and ``dtype`` (torch's)
    from the file's metadata, ``checksum`` of its data (from the check when it was opened); the data is read by
    ``read_into`` straight into a tensor, or whole by ``np.asarray``. It keeps its file open."""

    def __init__(self, dataset):
        self._dataset = dataset
        self.shape = tuple(dataset.shape)
        self.dtype = torch.from_numpy(np.empty(0, dataset.dtype.newbyteorder("="))).dtype
        self.checksum = None

    def __repr__(self):
        return f"StoredTensor({_where(self._dataset)}, shape={list(self.shape)}, dtype={self.dtype})"

    def read_into(self, tensor: torch.Tensor) -> None:
        """Copy the data into ``tensor`` (same shape and dtype): into its own memory when it is a contiguous CPU
        tensor, else through one CPU copy of this tensor alone."""
        target = tensor.detach()
        if target.device.type == "cpu" and target.is_contiguous():
            self._dataset.read_direct(target.numpy())
        else:
            target.copy_(torch.from_numpy(np.asarray(self)))

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self._dataset[()], dtype=self._dataset.dtype.newbyteorder("=") if dtype is None else dtype)


def _write(group, key, value, path):
    where = f"{path}/{key}"
    if not isinstance(key, str) or not key or "/" in key:
        raise CheckpointError(f"checkpoint key {where!r} must be a non-empty string without '/'")
    if isinstance(value, dict):
        child = group.create_group(key)
        for name, item in value.items():
            _write(child, name, item, where)
    elif isinstance(value, (list, tuple)):
        child = group.create_group(key)
        child.attrs[_KIND] = "list"
        for index, item in enumerate(value):
            _write(child, str(index), item, where)
    elif value is None:
        group.create_dataset(key, data=h5py.Empty("f")).attrs[_KIND] = "none"
    elif isinstance(value, str):
        group.create_dataset(key, data=value, dtype=h5py.string_dtype("utf-8"))
    elif isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16:
        raise CheckpointError(f"{where}: bfloat16 tensors have no HDF5 type; convert to float32 first")
    elif isinstance(value, (torch.Tensor, StoredTensor, np.ndarray, np.generic, bool, int, float)):
        array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
        dataset = group.create_dataset(key, data=array)
        if array.dtype.kind in _NUMERIC:
            dataset.attrs[_CHECKSUM] = _checksum(array)
    else:
        raise CheckpointError(f"{where}: cannot store {type(value).__name__} (dicts, lists, arrays, tensors, numbers, strings, None)")


def _current_umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def save(state: dict, path, overwrite: bool = False) -> None:
    """Write ``state`` to ``path`` atomically; refuse to replace an existing file unless ``overwrite``."""
    if not isinstance(state, dict):
        raise CheckpointError("Object to be saved must be a dictionary")
    path = os.fspath(path)
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
    with written_whole(path, overwrite) as temporary, h5py.File(temporary, "w") as file:
        for key, value in state.items():
            _write(file, key, value, "")


@contextlib.contextmanager
def written_whole(path: str, overwrite: bool = True):
    """A temporary path beside ``path`` for the block to write; when the block ends without error the file is
    synced and renamed to ``path`` (without ``overwrite``, linked: an existing file is never replaced), so ``path``
    is the old file or the whole new one, never a part; on an error it is removed."""
    directory = os.path.dirname(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        yield temporary
        os.fsync(handle)  # the writer closed and flushed the file; make it durable before the rename
        os.fchmod(handle, 0o666 & ~_current_umask())  # mkstemp's 0600 would outlive the rename
        os.close(handle)
        handle = None
        if overwrite:
            os.replace(temporary, path)
        else:
            os.link(temporary, path)  # fails if path appeared meanwhile: never clobber
            os.unlink(temporary)
    except BaseException:
        if handle is not None:
            os.close(handle)
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
    directory_handle = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(directory_handle)
    finally:
        os.close(directory_handle)


def _read(node, lazily=False):
    """The value of ``node``; ``lazily``, its numeric datasets as StoredTensors."""
    kind = node.attrs.get(_KIND)
    if isinstance(node, h5py.Group):
        if kind == "list":
            return [_read(node[str(index)], lazily) for index in range(len(node))]
        return {name: _read(child, lazily) for name, child in node.items()}
    if kind == "none":
        return None
    if lazily and node.dtype.kind in _NUMERIC:
        return StoredTensor(node)
    value = node[()]
    if _CHECKSUM in node.attrs and _checksum(np.asarray(value)) != node.attrs[_CHECKSUM]:
        raise _corrupt(node)
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.ndarray) and value.dtype.kind == "O":
        return value.astype(str)
    return value


def _where(dataset) -> str:
    """'file:/path/in/the/file' of a dataset, as errors name it."""
    return f"{dataset.file.filename}:{dataset.name}"


def _corrupt(dataset) -> CheckpointError:
    return CheckpointError(f"{_where(dataset)} is corrupt: its data does not match the checksum saved with it")


def _stored_tensors(tree) -> list:
    """The StoredTensors of a nested dict, in order."""
    if isinstance(tree, StoredTensor):
        return [tree]
    if isinstance(tree, dict):
        return [stored for value in tree.values() for stored in _stored_tensors(value)]
    return []


def _blocks(dataset) -> list:
    """(selection, shape) of the blocks ``_verify`` reads ``dataset`` in: runs of whole rows of at most
    ``_BLOCK_BYTES`` (or one longer row)."""
    if dataset.ndim == 0:
        return [(None, ())]
    if not dataset.size:
        return []
    rows, row_shape = dataset.shape[0], dataset.shape[1:]
    step = max(1, _BLOCK_BYTES // (dataset.dtype.itemsize * math.prod(row_shape)))
    return [(np.s_[start : start + step], (min(step, rows - start), *row_shape)) for start in range(0, rows, step)]


def _verify(tree) -> None:
    """Read every StoredTensor's data once, block by block through one buffer, to set its ``checksum`` and compare
    it with the one saved: a file truncated or corrupt anywhere fails here, before any of it reaches a trainer."""
    stored = [(entry, _blocks(entry._dataset)) for entry in _stored_tensors(tree)]
    buffer = np.empty(max((math.prod(shape) * entry._dataset.dtype.itemsize for entry, blocks in stored
                           for _, shape in blocks), default=0), np.uint8)  # fmt: skip
    for entry, blocks in stored:
        dataset, checksum = entry._dataset, 0
        for selection, shape in blocks:
            block = buffer[: math.prod(shape) * dataset.dtype.itemsize].view(dataset.dtype).reshape(shape)
            dataset.read_direct(block, source_sel=selection)
            checksum = _checksum(block, checksum)
        if _CHECKSUM in dataset.attrs and checksum != dataset.attrs[_CHECKSUM]:
            raise _corrupt(dataset)
        entry.checksum = checksum


def _opened_lazily(file) -> dict:
    """The tree of the open ``file``, the numeric datasets of ``_TENSOR_GROUPS`` as verified StoredTensors;
    the file is closed if that fails."""
    try:
        tree = {name: _read(child, name in _TENSOR_GROUPS) for name, child in file.items()}
        _verify(tree)
        return tree
    except BaseException:
        file.close()
        raise


def load(path, key=None, lazily=False):
    """Read a checkpoint (or the sub-tree at ``key``) into nested dicts of numpy values.

    With ``lazily`` (the whole file), the numeric datasets of the groups a trainer copies into its
    own tensors (model, optimizer, gradient_accumulation) stay in the file, kept open, as
    StoredTensors; each is read once here (``_verify``) to check it, without keeping its data.
    A missing file, a file that is not HDF5, a truncated one or data that does not match its
    checksum raises a clear error; nothing is returned half-read.
    """
    if lazily and key is not None:
        raise ValueError(f"checkpoint.load(key={key!r}, lazily=True): lazily opens the whole file (the groups a trainer "
                         "loads); pass key=None, or lazily=False to read the entry at key")
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if not h5py.is_hdf5(path):
        raise CheckpointError(f"{path} is not an HDF5 file (not a checkpoint)")
    try:
        file = h5py.File(path, "r")
        if lazily:
            return _opened_lazily(file)
        with file:
            if key is None:
                return _read(file)
            if key not in file:
                raise CheckpointError(f"{path} has no entry {key!r}")
            return _read(file[key])
    except (OSError, RuntimeError, KeyError) as error:
        raise CheckpointError(f"{path} is truncated or corrupt: {error}") from error


def check_is_checkpoint(state: dict, path) -> None:
    """Refuse HDF5 files that hold none of a trainer checkpoint's groups."""
    if not any(group in state for group in _CHECKPOINT_GROUPS):
        raise CheckpointError(
            f"{path} is not an ORTTrainer checkpoint: it has none of the groups {list(_CHECKPOINT_GROUPS)} "
            f"(found {sorted(state)})"
        )


def user_dict_from(state: dict, path, allow_pickle: bool) -> dict:
    """Take ``user_dict`` out of a loaded checkpoint; legacy pickled ones need ``allow_pickle``."""
    user_dict = state.pop("user_dict", {})
    if not isinstance(user_dict, str):
        return user_dict
    if not allow_pickle:
        raise CheckpointError(
            f"{path} stores user_dict as a pickle (legacy ORTTrainer format); unpickling can run arbitrary code, "
            "so pass allow_pickle=True only for files you trust"
        )
    return pickle.loads(bytes.fromhex(user_dict))


def compare_keys(expected, given, where: str, allow_unexpected: bool = False) -> None:
    """Strict key check: raise RuntimeError listing missing and unexpected keys of ``where``."""
    missing = sorted(set(expected) - set(given))
    unexpected = [] if allow_unexpected else sorted(set(given) - set(expected))
    problems = []
    if missing:
        problems.append(f"Missing keys: {missing} in {where}")
    if unexpected:
        problems.append(f"Unexpected keys: {unexpected} in {where}")
    if problems:
        raise RuntimeError("; ".join(problems))


def check_not_mid_window(state: dict, where: str) -> None:
    """Refuse a multi-rank state taken inside a gradient-accumulation window.

    There each rank holds only its own un-reduced partial gradient sum (``gradient_accumulation``):
    rank 0's alone is not the run's state, and how the ranks' sums make one depends on the loss.
    """
    if "gradient_accumulation" not in state:
        return
    options = state["trainer_options"]
    if int(options["world_size"]) > 1:
        raise CheckpointError(
            f"{where}: step {int(state['train_step_info']['step'])} of rank {int(options['world_rank'])} "
            f"(of {int(options['world_size'])}) is inside a gradient-accumulation window, where every rank holds "
            "only its own un-reduced partial gradients; with several ranks, checkpoint only after a step that "
            "completes a window (a multiple of batch.gradient_accumulation_steps)"
        )


def _check_same(values, what):
    """``values`` (one per rank, in rank order) must be equal; returns rank 0's."""
    first = values[0]
    for rank, value in enumerate(values[1:], start=1):
        if not np.array_equal(np.asarray(first), np.asarray(value)):
            raise CheckpointError(f"{what} differs between the checkpoints of rank 0 and rank {rank}")
    return first


def _check_same_entries(states, group, keys=None):
    """The entries ``keys`` of ``group`` (all of them by default) must be equal on every rank."""
    entries = [state.get(group, {}) for state in states]
    for key in sorted({key for entry in entries for key in entry}) if keys is None else keys:
        _check_same([entry.get(key) for entry in entries], f"{group}/{key}")


def aggregate_checkpoints(paths, pytorch_format=True):
    """Merge per-rank ZeRO-1 checkpoints into one single-process checkpoint.

    Files are ordered by their stored ``world_rank``. A weight whose optimizer state only
    one rank holds (orttrainer's ZeRO) is taken from that rank; legacy flat shards (listed
    in ``partition_info``, held by every rank) are concatenated in rank order and reshaped
    to ``original_dim``; everything else must agree across ranks (see ``merge_rank_states``).
    With ``pytorch_format`` only the flat {weight: tensor} dict is returned.
    """
    states = [load(path) for path in paths]
    for path, state in zip(paths, states):
        for group in ("trainer_options", "partition_info", "model"):
            if group not in state:
                raise CheckpointError(f"{path} has no '{group}' group: not a per-rank sharded checkpoint")
    options = [state["trainer_options"] for state in states]
    if int(options[0]["horizontal_parallel_size"]) > 1:
        raise NotImplementedError("aggregating Megatron (horizontal_parallel_size > 1) checkpoints is not implemented")
    ranks = [int(option["world_rank"]) for option in options]
    if sorted(ranks) != list(range(len(paths))) or int(options[0]["world_size"]) != len(paths):
        raise CheckpointError(f"expected one checkpoint per rank 0..{int(options[0]['world_size']) - 1}, got ranks {ranks}")
    merged = merge_rank_states([state for _, state in sorted(zip(ranks, states), key=lambda pair: pair[0])])
    if pytorch_format:
        return {name: torch.from_numpy(np.asarray(value)) for name, value in merged["model"]["full_precision"].items()}
    return merged


def merge_rank_states(states):
    """One single-process state from the per-rank states of a ZeRO-1 run, in rank order.

    What a single-process checkpoint holds survives: step counters and loss scaler (equal on
    every rank), rank 0's dropout seed and user_dict. States from inside an accumulation
    window are refused (``check_not_mid_window``).
    """
    for rank, state in enumerate(states):
        check_not_mid_window(state, f"cannot merge the checkpoint of rank {rank}")
    _check_same_entries(states, "trainer_options", ("mixed_precision", "world_size", "zero_stage", "optimizer_name"))
    _check_same_entries(states, "train_step_info", ("step", "optimization_step"))
    _check_same_entries(states, "loss_scaler")
    partitions = states[0].get("partition_info", {})

    def merge(name, key, values):
        if "owner_rank" not in partitions.get(name, {"owner_rank": 0}) and key in ("Moment_1", "Moment_2"):
            return np.concatenate([np.asarray(value).reshape(-1) for value in values]).reshape(
                [int(dim) for dim in partitions[name]["original_dim"]]
            )
        return _check_same(values, f"{name}/{key}")

    weights = {name: _check_same([s["model"]["full_precision"][name] for s in states], name)
               for name in states[0]["model"]["full_precision"]}  # fmt: skip
    optimizer = {}
    for name in dict.fromkeys(name for state in states for name in state.get("optimizer", {})):
        holders = [state["optimizer"][name] for state in states if name in state.get("optimizer", {})]
        optimizer[name] = {key: merge(name, key, [holder[key] for holder in holders]) for key in holders[0]}
    first = states[0]["trainer_options"]
    merged = {
        "model": {"full_precision": weights},
        **({"optimizer": optimizer} if any("optimizer" in state for state in states) else {}),
        "trainer_options": {
            "mixed_precision": bool(first["mixed_precision"]),
            "zero_stage": 0,
            "world_rank": 0,
            "world_size": 1,
            "optimizer_name": first["optimizer_name"],
            "data_parallel_size": 1,
            "horizontal_parallel_size": 1,
        },
    }
    for key in ("train_step_info", "loss_scaler", "gradient_accumulation", "user_dict"):
        if key in states[0]:
            merged[key] = states[0][key]
    return merged
