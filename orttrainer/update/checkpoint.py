"""Checkpoints: the state_dict schema, HDF5 storage, and aggregation of per-rank files.

Layout (the legacy one): ``/model/full_precision/<weight>``, ``/optimizer/<weight>/{Moment_1,
Moment_2,Update_Count}``, ``/optimizer/shared_optimizer_state/Step``, ``/trainer_options/*``,
``/train_step_info/*``, optional ``/partition_info/<weight>/*`` and ``/user_dict``.

Values are stored natively (no pickle): dicts become groups, arrays/tensors/numbers/strings
datasets, lists and None carry a marker attribute so they come back as written. Writes go
to a temporary file beside the target that is flushed, synced and renamed, so ``path``
never holds a half-written checkpoint.
"""

import contextlib
import os
import pickle
import tempfile

import h5py
import numpy as np
import torch

_KIND = "orttrainer_kind"  # attribute marking values HDF5 has no type for
_CHECKPOINT_GROUPS = ("model", "optimizer", "train_step_info", "trainer_options")


class CheckpointError(ValueError):
    """A file that is not a complete checkpoint, or a value that cannot be stored."""


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
    elif isinstance(value, torch.Tensor):
        if value.dtype == torch.bfloat16:
            raise CheckpointError(f"{where}: bfloat16 tensors have no HDF5 type; convert to float32 first")
        group.create_dataset(key, data=value.detach().cpu().numpy())
    elif isinstance(value, (np.ndarray, np.generic, bool, int, float)):
        group.create_dataset(key, data=value)
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


def _read(node):
    kind = node.attrs.get(_KIND)
    if isinstance(node, h5py.Group):
        if kind == "list":
            return [_read(node[str(index)]) for index in range(len(node))]
        return {name: _read(child) for name, child in node.items()}
    if kind == "none":
        return None
    value = node[()]
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.ndarray) and value.dtype.kind == "O":
        return value.astype(str)
    return value


def load(path, key=None):
    """Read a checkpoint (or the sub-tree at ``key``) into nested dicts of numpy values.

    A missing file, a file that is not HDF5, or a truncated one raises a clear error;
    nothing is returned half-read.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if not h5py.is_hdf5(path):
        raise CheckpointError(f"{path} is not an HDF5 file (not a checkpoint)")
    try:
        with h5py.File(path, "r") as file:
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
