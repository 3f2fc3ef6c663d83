"""What a trainer's checkpoint holds: capture in the legacy layout, check, restore; and its files.

``TrainerState.capture`` reads the live tensors into the legacy ``state_dict`` layout (numpy
arrays): ``model.full_precision`` (weights and buffers under their torch names),
``optimizer`` (the optimizer's own state_dict), ``trainer_options``, ``train_step_info``
(step counters and the dropout seed) and, when they apply, ``gradient_accumulation``
(gradients summed inside a window), ``partition_info`` (ZeRO-1 owners) and ``loss_scaler``
(the scaler's own state_dict). ``restore`` checks everything first (keys when strict,
shapes, dtypes, optimizer name) and only then copies into the live tensors, one tensor at a
time and without a second copy of the state, so that a bad dict leaves the trainer unchanged.
``write_checkpoint``/``read_checkpoint`` put a state in files on one or several ranks
(checkpoint.py stores it); a single file is read lazily: its tensors, checked when it is
opened, go from the file straight into the live tensors.
"""

import functools
import hashlib
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from . import amp, checkpoint, distributed


@dataclass
class TrainerState:
    """The live parts of a built trainer that its state_dict reads and load_state_dict writes."""

    runtime: object  # build.Runtime: weights, buffers, tied-weight aliases
    gradients: object  # gradients.Gradients
    optimizer: object
    options: object  # the trainer's ORTTrainerOptions
    optimizer_name: str
    data_parallel: object  # distributed.DataParallel, or None in one process
    world: object  # distributed.World
    info: object  # the trainer's TrainStepInfo
    seed: int  # the dropout seed

    def _live_model(self) -> dict:
        """{name: the trainer's own tensor} of every weight and buffer (tied weights under their first name only)."""
        runtime = self.runtime
        return {**runtime.weights, **runtime.batch_counters, **runtime.unexported_state}

    def model(self, copies: bool = True) -> dict:
        """{name: CPU copy} of every weight and buffer, named like torch's state_dict() (tied
        weights under their first name only); without ``copies``, the trainer's own CPU tensors."""
        return {name: _on_cpu(tensor, copies) for name, tensor in self._live_model().items()}

    def pytorch(self) -> dict:
        """Every name torch's state_dict() has: a tied weight under each of its names."""
        model_state = self.model()
        return {**model_state, **{alias: model_state[name] for alias, name in self.runtime.aliases.items()}}

    def capture(self, copies: bool = True) -> dict:
        """The legacy state_dict (see the module docstring). Without ``copies`` its arrays are views of the
        trainer's CPU tensors, for a checkpoint written at once (no second copy of a large model's state)."""
        settings = self.options.distributed
        inside_window = self.info.step % self.options.batch.gradient_accumulation_steps != 0
        return {
            "model": {"full_precision": {name: tensor.numpy() for name, tensor in self.model(copies).items()}},
            "optimizer": _to_numpy(self.optimizer.state_dict(), copies),
            "trainer_options": {
                "mixed_precision": amp.scales_loss(self.options.mixed_precision),  # legacy: float16, loss scaled
                "zero_stage": settings.deepspeed_zero_optimization.stage,
                "world_rank": settings.world_rank,
                "world_size": settings.world_size,
                "optimizer_name": self.optimizer_name,
                "data_parallel_size": settings.data_parallel_size,
                "horizontal_parallel_size": settings.horizontal_parallel_size,
            },
            "train_step_info": {
                "optimization_step": self.info.optimization_step, "step": self.info.step, "dropout_seed": self.seed,
                "gradient_accumulation_steps": self.options.batch.gradient_accumulation_steps,
            },  # fmt: skip
            **self.gradients.accumulation_state(inside_window),
            **self._partition_state(),
            **self._loss_scaler_state(),
        }

    def _partition_state(self) -> dict:
        """ZeRO-1: which rank holds each weight's optimizer state (legacy key ``partition_info``)."""
        if not _optimizer_state_sharded(self.data_parallel):
            return {}
        return {
            "partition_info": {
                name: {"original_dim": np.array(self.runtime.weights[name].shape, dtype=np.int64), "owner_rank": np.int64(rank)}
                for name, rank in self.data_parallel.owner.items()
            }
        }

    def _loss_scaler_state(self) -> dict:
        mixed_precision = self.options.mixed_precision
        return {"loss_scaler": mixed_precision.loss_scaler.state_dict()} if amp.scales_loss(mixed_precision) else {}

    def restore(self, state: dict, strict: bool) -> int:
        """Check all of ``state`` against the trainer's, then apply it; return the dropout seed to use.

        The checks read only names, shapes and dtypes (of a StoredTensor: the file's metadata). Then each value is
        copied into its live tensor (a StoredTensor read into it), one at a time: no second copy of the state."""
        live_model = self._live_model()
        live_optimizer = self.optimizer.state_dict()  # its moments are the live tensors, its counters new ones
        refuse_torch_layout(state, {*live_model, *self.runtime.aliases})
        for group in ("model", "optimizer", "train_step_info"):
            if group not in state:
                warnings.warn(f"Missing key: {group} in state_dict")
        weights = self._checked_weights(state, live_model, strict)
        optimizer = self._checked_optimizer(state, live_optimizer, strict)
        accumulated = self._checked_accumulation(state)
        # everything is checked: apply
        for name, value in weights.items():
            _copy_into(live_model[name], value)
        for name, value in accumulated.items():
            _copy_into(self.gradients.sums[name], value)
        if optimizer is not None:
            for name, entry in optimizer.items():
                for key, value in entry.items():
                    _copy_into(live_optimizer[name][key], value)
            self.optimizer.load_state_dict(live_optimizer)  # the counters (a moment copied onto itself: a no-op)
        if state.get("loss_scaler") is not None and amp.scales_loss(self.options.mixed_precision):
            self.options.mixed_precision.loss_scaler.load_state_dict(state["loss_scaler"])
        return self._restore_step_info(state.get("train_step_info"))

    def _checked_weights(self, state, live_model, strict) -> dict:
        """{name: value} of the weights and buffers in ``state`` (tied aliases dropped: the same tensor)."""
        model = {precision: {name: value for name, value in values.items() if name not in self.runtime.aliases}
                 for precision, values in state.get("model", {}).items()}  # fmt: skip
        if strict and "model" in state:
            checkpoint.compare_keys({"full_precision": live_model}, model, "state_dict[model]")
        weights = {}
        for precision, values in model.items():
            if strict:
                checkpoint.compare_keys(live_model, values, f"state_dict[model][{precision}]")
            for name, value in values.items():
                if name in live_model:
                    weights[name] = _checked_tensor(value, live_model[name], f"state_dict[model][{precision}][{name}]")
                elif strict:
                    raise RuntimeError(f"Unexpected key: {name} in state_dict[model][{precision}]")
        return weights

    def _checked_optimizer(self, state, live, strict):
        """{weight: {key: value}} of the optimizer state in ``state``, or None when it has none."""
        optimizer = state.get("optimizer")
        if optimizer is None:
            return None
        given_name = state.get("trainer_options", {}).get("optimizer_name")
        if isinstance(given_name, bytes):
            given_name = given_name.decode()
        if given_name != self.optimizer_name:
            raise RuntimeError(f"Optimizer mismatch: expected {self.optimizer_name}, got {given_name}")
        if strict:  # a ZeRO rank holds part of the optimizer state: other ranks' entries are expected
            checkpoint.compare_keys(live, optimizer, "state_dict[optimizer]",
                                    allow_unexpected=_optimizer_state_sharded(self.data_parallel))  # fmt: skip
        return {
            name: {key: _checked_tensor(value, live[name][key], f"state_dict[optimizer][{name}][{key}]")
                   for key, value in entry.items() if key in live.get(name, {})}
            for name, entry in optimizer.items() if name in live
        }  # fmt: skip

    def _checked_accumulation(self, state) -> dict:
        """The partial gradient sums of a checkpoint taken inside an accumulation window (one process only)."""
        if "gradient_accumulation" in state and self.world.is_distributed:
            raise ValueError(
                "this checkpoint was taken inside a gradient-accumulation window; its partial gradient sum cannot be "
                f"split over {self.world.size} ranks (each would add all of it): resume it in one process, or save at a "
                "window boundary"
            )
        if "gradient_accumulation" in state:
            self._refuse_other_window(state)
        sums = self.gradients.sums
        accumulated = state.get("gradient_accumulation", {})
        unexpected = sorted(set(accumulated) - set(sums))
        if unexpected:
            raise RuntimeError(f"Unexpected keys: {unexpected} in state_dict[gradient_accumulation]: the trainer trains no "
                               "such weights")
        return {name: _checked_tensor(value, sums[name], f"state_dict[gradient_accumulation][{name}]")
                for name, value in accumulated.items()}  # fmt: skip

    def _refuse_other_window(self, state) -> None:
        """A partial gradient sum belongs to a window of the saving trainer's size and loss scaling: completed by a
        trainer of another size it would be divided by the wrong count, and a float16 trainer's sum is scaled by its
        loss scale."""
        saved_steps = state.get("train_step_info", {}).get("gradient_accumulation_steps")
        steps = self.options.batch.gradient_accumulation_steps
        saved_mixed = state.get("trainer_options", {}).get("mixed_precision")
        mixed = amp.scales_loss(self.options.mixed_precision)
        problems = []
        if saved_steps is not None and int(saved_steps) != steps:
            problems.append(f"batch.gradient_accumulation_steps was {int(saved_steps)} there, {steps} here")
        if saved_mixed is not None and bool(saved_mixed) != mixed:
            problems.append(f"mixed_precision.enabled was {bool(saved_mixed)} there (its sum is scaled by the loss scale "
                            f"when True), {mixed} here")
        if problems:
            raise ValueError(
                "this state_dict was taken inside a gradient-accumulation window of a trainer set up otherwise: "
                + "; ".join(problems) + ". Resume it with the same options, or save at a window boundary"
            )

    def _restore_step_info(self, info) -> int:
        if info is None:
            return self.seed
        self.info.step = int(info["step"])
        self.info.optimization_step = int(info["optimization_step"])
        return int(info["dropout_seed"]) if "dropout_seed" in info else self.seed


def refuse_torch_layout(state: dict, weight_names) -> None:
    """A torch module's state_dict ({weight name: tensor}, ``state_dict(pytorch_format=True)``) is not the trainer's
    layout: loaded as one, it loaded nothing (a warning per missing group, whatever ``strict``)."""
    flat = [name for name in state if name in weight_names]
    if flat:
        shown = ", ".join(repr(name) for name in flat[:3]) + (", ..." if len(flat) > 3 else "")
        raise ValueError(
            f"state_dict has weights at its top level ({shown}): it is a torch module's state_dict "
            "(state_dict(pytorch_format=True)), where load_state_dict takes the trainer's state_dict() layout; pass "
            "{'model': {'full_precision': that dict}} to load its weights, or load it into the module before the "
            "trainer's first step"
        )


def check_against_module(state: dict, module: torch.nn.Module, strict: bool) -> None:
    """Before the build: every weight in ``state`` must be a tensor of ``module`` with its shape and
    dtype (a missing weight can only be told once the graph says which weights the trainer holds)."""
    own = module.state_dict()
    refuse_torch_layout(state, own)
    for name, value in state.get("model", {}).get("full_precision", {}).items():
        if name in own:
            _checked_tensor(value, own[name], f"state_dict[model][full_precision][{name}]")
        elif strict:
            raise RuntimeError(f"Unexpected key: {name} in state_dict[model][full_precision]: {type(module).__name__} has no such "
                               "parameter or buffer")


def _optimizer_state_sharded(data_parallel) -> bool:
    """ZeRO-1 on several ranks: each holds the optimizer state of the weights it owns."""
    return data_parallel is not None and bool(data_parallel.owner)


def write_checkpoint(state: dict, path, world, data_parallel, step: int, overwrite=False, consolidate=False) -> None:
    """Write ``state`` (a state_dict, + user_dict) to ``path``: in one process directly; on several
    ranks rank 0 writes, or under ZeRO every rank its own ``{rank}`` file or, with ``consolidate``,
    rank 0 the merged parts. If any rank's write fails, every rank raises RankWriteError."""
    if data_parallel is None:
        checkpoint.save(state, path, overwrite=overwrite)
        return
    sharded = _optimizer_state_sharded(data_parallel)
    per_rank = sharded and not consolidate
    if per_rank and "{rank}" not in str(path):
        raise ValueError(f"ZeRO checkpoints are per rank: put '{{rank}}' in the path ({path}) or pass consolidate=True")
    checkpoint.check_not_mid_window(state, f"cannot save checkpoint {path}")
    if sharded and not per_rank:
        state = checkpoint.merge_rank_states(distributed.gather_objects(world, state))
    target = str(path).format(rank=world.rank) if per_rank else path
    writes_here = per_rank or world.rank == 0  # otherwise rank 0 writes the one file
    write = functools.partial(checkpoint.save, state, target, overwrite=overwrite) if writes_here else None
    distributed.run_together(world, write, f"saving checkpoint {path} at step {step}", distributed.RankWriteError)


def read_checkpoint(paths, world, allow_pickle: bool):
    """(state, user_dict) of a checkpoint written by ``write_checkpoint`` or the legacy ORTTrainer;
    per-rank ZeRO files (several paths, or one with ``{rank}``) are read whole and aggregated, one file
    is opened lazily (its tensors StoredTensors, checked here, read when the state is applied).

    On several ranks every rank reads, and one collective compares: if a rank's read failed, or
    read other values than rank 0's (another file, one only some nodes hold), every rank raises
    CheckpointError before any of them has loaded anything.
    """
    read = functools.partial(_read_checkpoint, paths, world.size, allow_pickle)
    if not world.is_distributed:
        return read()
    result, error, outcomes = distributed.run_on_every_rank(world, read, lambda result: _values_digest(result[0]))
    where = f"loading checkpoint {', '.join(map(str, paths))}"
    failed = distributed.failed_ranks(outcomes)
    if failed:
        raise checkpoint.CheckpointError(f"{where} failed on {failed}") from error
    differing = [rank for rank, (_, digest) in enumerate(outcomes) if digest != outcomes[0][1]]
    if differing:
        raise checkpoint.CheckpointError(f"{where}: rank(s) {differing} read other values than rank 0; every rank must "
                                         "load the same checkpoint (a copy on every node, or a shared file system)")  # fmt: skip
    return result


def _read_checkpoint(paths, world_size: int, allow_pickle: bool):
    if len(paths) == 1 and "{rank}" in str(paths[0]):
        paths = [str(paths[0]).format(rank=rank) for rank in range(world_size)]
    if len(paths) > 1:
        state = checkpoint.aggregate_checkpoints(list(paths), pytorch_format=False)
    else:
        state = checkpoint.load(paths[0], lazily=True)
    checkpoint.check_is_checkpoint(state, paths[0])
    return state, checkpoint.user_dict_from(state, paths[0], allow_pickle)


def _values_digest(state: dict) -> str:
    """sha256 of what loading ``state`` sets (not trainer_options, which name the rank that wrote the file); of a
    StoredTensor, the checksum its check computed from its data."""
    digest = hashlib.sha256()

    def add(key, value):
        digest.update(key.encode())
        if isinstance(value, checkpoint.StoredTensor):
            digest.update(f"{value.dtype}{value.shape}{value.checksum}".encode())
        elif isinstance(value, dict):
            for name in sorted(value):
                add(f"{key}/{name}", value[name])
        elif isinstance(value, list):
            for index, item in enumerate(value):
                add(f"{key}/{index}", item)
        else:
            array = np.asarray(value)
            digest.update(f"{array.dtype}{array.shape}".encode())
            digest.update(repr(value).encode() if array.dtype.kind == "O" else array.tobytes())

    for group in sorted(set(state) - {"trainer_options"}):
        add(group, state[group])
    return digest.hexdigest()


def _checked_tensor(value, live: torch.Tensor, where):
    """``value`` (a tensor, a StoredTensor, or what numpy takes, as a tensor sharing its memory) shaped and typed
    like ``live``; a clear error otherwise."""
    tensor = value if isinstance(value, (torch.Tensor, checkpoint.StoredTensor)) else torch.as_tensor(np.asarray(value))
    if tuple(tensor.shape) != tuple(live.shape):
        raise RuntimeError(f"{where} has shape {list(tensor.shape)}, the trainer's has {list(live.shape)}")
    if tensor.dtype != live.dtype:
        raise RuntimeError(f"{where} has dtype {tensor.dtype}, the trainer's has {live.dtype}")
    return tensor


def _copy_into(live: torch.Tensor, value) -> None:
    """Write a checked value into its live tensor: a StoredTensor straight from its file."""
    if isinstance(value, checkpoint.StoredTensor):
        value.read_into(live)
    else:
        live.copy_(value)


def _to_numpy(tree, copies: bool = True):
    """Every tensor of a nested dict as a CPU numpy array: a copy, or without ``copies`` a view of a CPU tensor."""
    if isinstance(tree, dict):
        return {key: _to_numpy(value, copies) for key, value in tree.items()}
    return _on_cpu(tree, copies).numpy()


def _on_cpu(tensor: torch.Tensor, copies: bool) -> torch.Tensor:
    """``tensor`` detached on the CPU: a copy, or without ``copies`` itself where it already is there."""
    on_cpu = tensor.detach().cpu()
    return on_cpu.clone() if copies and on_cpu.data_ptr() == tensor.data_ptr() else on_cpu
