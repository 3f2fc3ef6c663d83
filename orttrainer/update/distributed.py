"""Data parallelism on torch.distributed: world info, gradient all-reduce, ZeRO-1 ownership.

Works under ``torchrun`` (RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT in
the environment) or with ranks given in ``options.distributed``. The process group is
initialised here unless the user already did (gloo on the CPU, NCCL on CUDA), with a
collective timeout so that a dead peer ends the job instead of hanging it; a group
created here is destroyed when the process exits.
"""

import atexit
import hashlib
import os
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = timedelta(minutes=5)


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_distributed(self) -> bool:
        return self.size > 1


def world_from(options) -> World:
    """Ranks from torchrun's environment and/or ``options.distributed``; they must agree."""
    given = options._original_opts.get("distributed", {})
    world = {}
    for key, env_name, option_name in (
        ("rank", "RANK", "world_rank"),
        ("size", "WORLD_SIZE", "world_size"),
        ("local_rank", "LOCAL_RANK", "local_rank"),
    ):
        from_env = int(os.environ[env_name]) if env_name in os.environ else None
        from_options = given.get(option_name)
        if from_env is not None and from_options is not None and from_env != from_options:
            raise ValueError(
                f"options distributed.{option_name} is {from_options} but the environment says {env_name}={from_env}"
            )
        world[key] = from_options if from_options is not None else from_env if from_env is not None else World.__dataclass_fields__[key].default
    if not 0 <= world["rank"] < world["size"]:
        raise ValueError(f"distributed.world_rank {world['rank']} is outside 0..{world['size'] - 1}")
    return World(**world)


def ensure_process_group(world: World, device: torch.device) -> None:
    """Join the process group (env:// rendezvous), unless the user already did.

    On CUDA the rank's GPU becomes torch's current device first: NCCL binds each rank's
    communicator to the current device, and without it every rank would claim GPU 0.
    """
    if dist.is_initialized():
        if dist.get_world_size() != world.size or dist.get_rank() != world.rank:
            raise ValueError(
                f"the existing process group is rank {dist.get_rank()} of {dist.get_world_size()}, "
                f"but the options say rank {world.rank} of {world.size}"
            )
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    _warn_if_restarts_share_the_agent_store()
    dist.init_process_group(backend, rank=world.rank, world_size=world.size, timeout=COLLECTIVE_TIMEOUT)
    atexit.register(_destroy_process_group)


def _warn_if_restarts_share_the_agent_store() -> None:
    """Warn of a torchrun job that may restart while its workers use the store of torchrun's agent.

    That store outlives an attempt, so a restarted attempt can read the dead one's addresses and fail
    to connect (pytorch#135712). No key prefix can set attempts apart from here: torchrun gives its
    workers no attempt number that all nodes share (TORCHELASTIC_RESTART_COUNT is each agent's own).
    """
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        warnings.warn(
            f"torchrun may restart this job (--max-restarts={restarts}) and its workers share the agent's store, "
            "where a restarted attempt can read the dead attempt's addresses and fail to connect (pytorch#135712): "
            "set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun on every node"
        )


def _destroy_process_group() -> None:
    """At exit, release the group this module created (NCCL warns about, and may hang on, a group left alive)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def join(world: World, settings, device: torch.device) -> "DataParallel":
    """Join the process group and record the world in ``settings`` (options.distributed), as the legacy trainer did."""
    settings.world_rank, settings.world_size, settings.local_rank = world.rank, world.size, world.local_rank
    settings.data_parallel_size = world.size // settings.horizontal_parallel_size
    ensure_process_group(world, device)
    return DataParallel(world, settings.deepspeed_zero_optimization.stage)


def broadcast(tensors, source: int = 0) -> None:
    for tensor in tensors:
        dist.broadcast(tensor, source)


def all_reduce_sum(tensor: torch.Tensor) -> None:
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)


def check_same_on_all_ranks(world: World, description: str, blob: bytes) -> None:
    """Fail on every rank if ``blob`` (e.g. the weights' shapes + options) differs anywhere."""
    digests = gather_objects(world, hashlib.sha256(blob).hexdigest())
    differing = [rank for rank, other in enumerate(digests) if other != digests[0]]
    if differing:
        raise RuntimeError(f"{description} differ between rank 0 and rank(s) {differing}: every rank must build the same model")


def gather_objects(world: World, value):
    gathered = [None] * world.size
    dist.all_gather_object(gathered, value)
    return gathered


class RankWriteError(OSError):
    """Writing a file failed on some rank(s); raised alike on every rank so that all stop together."""


def run_on_every_rank(world: World, action, fingerprint=None):
    """Run this rank's ``action`` (None: nothing to do here) and share how it went, in one collective.

    Returns its result, the exception it raised (or None) and, per rank, (cause or None, fingerprint of
    the result or None): a failure then ends every rank at once with its cause, instead of leaving
    the others waiting at their next collective until it times out.
    """
    result, error = None, None
    if action is not None:
        try:
            result = action()
        except Exception as caught:  # any failure: shared with the other ranks, raised by the caller
            error = caught
    if error is not None:
        outcome = (f"{type(error).__name__}: {error}", None)
    else:
        outcome = (None, None if fingerprint is None else fingerprint(result))
    return result, error, gather_objects(world, outcome)


def failed_ranks(outcomes) -> str:
    """'rank r: cause; ...' of the ranks whose action failed in ``run_on_every_rank``'s outcomes ('' if none)."""
    return "; ".join(f"rank {rank}: {cause}" for rank, (cause, _) in enumerate(outcomes) if cause is not None)


def run_together(world: World, action, what: str, error_class: type) -> None:
    """Run this rank's ``action`` (None: nothing to do here), then raise ``error_class`` on every rank if any rank's failed."""
    _, error, outcomes = run_on_every_rank(world, action)
    failed = failed_ranks(outcomes)
    if failed:
        raise error_class(f"{what} failed on {failed}") from error


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` is set on any rank: one all-reduce of one number."""
    count = torch.tensor([float(flag)], device=device)
    all_reduce_sum(count)
    return bool(count.item())


def owners(sizes: dict, world_size: int) -> dict:
    """ZeRO-1 ownership: each weight to one rank, balancing element counts (largest first)."""
    load = [0] * world_size
    owner = {}
    for name in sorted(sizes, key=lambda name: (-sizes[name], name)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[name] = rank
        load[rank] += sizes[name]
    return owner


class DataParallel:
    """What a training step does differently on several ranks.

    Gradients are summed over ranks in one all-reduce per flat buffer (the trainer divides
    by N·D). With ZeRO stage 1 each weight's optimizer state lives on its owner only; the
    owner updates it and broadcasts the new values.
    """

    def __init__(self, world: World, zero_stage: int):
        self.world = world
        self.zero_stage = zero_stage
        self.owner = {}

    def start(self, weights: dict, trainable, description: bytes) -> list:
        """Check every rank built the same thing, start from rank 0's weights; return owned names."""
        check_same_on_all_ranks(self.world, "the model's weights (names, shapes, dtypes, which train) or the options", description)
        broadcast(weights.values(), 0)
        if self.zero_stage == 0:
            return list(trainable)
        self.owner = owners({name: weights[name].numel() for name in trainable}, self.world.size)
        return [name for name in trainable if self.owner[name] == self.world.rank]

    def reduce_gradients(self, flat_buffers) -> None:
        for flat in flat_buffers:
            all_reduce_sum(flat)

    def share_updated_weights(self, weights: dict) -> None:
        for name, rank in self.owner.items():
            dist.broadcast(weights[name], rank)

    def share_buffers(self, buffers) -> None:
        """Keep BatchNorm statistics equal on all ranks: rank 0's win (torch DDP's default)."""
        broadcast(buffers, 0)
