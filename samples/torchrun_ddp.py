"""Data-parallel training with torchrun: the digits CNN on 2 processes (gloo on the CPU).

    torchrun --standalone --nproc_per_node=2 samples/torchrun_ddp.py [--zero] [--epochs 20]
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=2 --max-restarts=3 \
        samples/torchrun_ddp.py --checkpoint-every 40 --resume

Each rank trains on its share of every batch; gradients are averaged across ranks once per
update; with --zero each rank keeps only its part of Adam's state (ZeRO stage 1). Rank 0
prints progress and writes one consolidated checkpoint at the end. With --checkpoint-every K
a consolidated checkpoint is also written every K steps (the last 2 kept); with --resume the
job starts from the newest of them that loads, so a job torchrun restarts after a crash ends
with the weights an uninterrupted run would have.
"""

import argparse
import os
import re

import torch
import torch.nn.functional as F
from digits_classifier import DigitsCNN, accuracy, load_split

from orttrainer import CheckpointError, ORTTrainer, ORTTrainerOptions, optim

# what --checkpoint-every writes; not the temporary file of a write cut short (.step-000040.ortcp.*.tmp)
PERIODIC = re.compile(r"step-(\d+)\.ortcp")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=64, help="samples per step over all ranks")
    parser.add_argument("--zero", action="store_true", help="shard Adam's state across ranks (ZeRO-1)")
    parser.add_argument("--checkpoint", default="runs/ddp/digits.ortcp")
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="K", help="also save every K steps")
    parser.add_argument("--checkpoint-dir", default="runs/ddp/steps", help="where those go and --resume looks")
    parser.add_argument("--resume", action="store_true", help="start from the newest of them that loads")
    args = parser.parse_args()

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    (train_x, train_y), (test_x, test_y) = load_split()
    torch.manual_seed(0)
    options = ORTTrainerOptions({
        "device": {"id": "cpu"},
        "distributed": {"deepspeed_zero_optimization": {"stage": 1 if args.zero else 0}},
    })
    trainer = ORTTrainer(DigitsCNN(), None, optim.AdamConfig(lr=3e-3), loss_fn=F.cross_entropy, options=options)
    first = resume(trainer, args.checkpoint_dir, rank) if args.resume else 0
    share = args.global_batch // world
    steps_per_epoch = len(train_y) // args.global_batch
    for step, (epoch, batch) in enumerate(schedule(len(train_y), args.global_batch, args.epochs)):
        if step < first:  # trained before the restart (the generator still draws every epoch's order)
            continue
        mine = batch[rank * share : (rank + 1) * share]
        loss = trainer.train_step(train_x[mine], train_y[mine])[0].item()
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            save_periodic(trainer, args.checkpoint_dir, step + 1, rank)
        if rank == 0 and (step + 1) % steps_per_epoch == 0 and (epoch % 5 == 0 or epoch == args.epochs):
            print(f"epoch {epoch}: rank 0 loss {loss:.3f}, test accuracy {accuracy(trainer, test_x, test_y):.2%}", flush=True)
    os.makedirs(os.path.dirname(args.checkpoint) or ".", exist_ok=True)
    trainer.save_checkpoint(args.checkpoint, consolidate=True, overwrite=True)
    if rank == 0:
        print(f"{world} ranks; consolidated checkpoint: {args.checkpoint}")


def schedule(samples, global_batch, epochs):
    """(epoch, the global batch's sample indices) of every step in order: the same shuffle on every rank and
    in every attempt of a restarted job."""
    generator = torch.Generator().manual_seed(0)
    for epoch in range(1, epochs + 1):
        order = torch.randperm(samples, generator=generator)
        for start in range(0, samples - global_batch + 1, global_batch):
            yield epoch, order[start : start + global_batch]


def periodic_checkpoints(directory):
    """(step, path) of the checkpoints --checkpoint-every wrote to ``directory``, newest first."""
    matches = [PERIODIC.fullmatch(name) for name in (os.listdir(directory) if os.path.isdir(directory) else [])]
    return sorted(((int(match[1]), os.path.join(directory, match[0])) for match in matches if match), reverse=True)


def save_periodic(trainer, directory, step, rank):
    """Save step ``step``'s consolidated checkpoint, then (rank 0) delete all but the newest 2. A file of this step
    already there is one a previous attempt could not load (a newer, loadable one would have been resumed): replaced."""
    os.makedirs(directory, exist_ok=True)
    trainer.save_checkpoint(os.path.join(directory, f"step-{step:06d}.ortcp"), consolidate=True, overwrite=True)
    if rank == 0:
        for _, path in periodic_checkpoints(directory)[2:]:
            os.remove(path)


def resume(trainer, directory, rank):
    """Load the newest checkpoint in ``directory`` that loads and return its step (0 if none does).

    Every rank tries the same files in the same order, and load_checkpoint makes the ranks agree: a file
    that is truncated or corrupt (or missing) on any rank raises CheckpointError on every rank, which
    then all try the next older one.
    """
    for step, path in periodic_checkpoints(directory):
        try:
            trainer.load_checkpoint(path)
        except CheckpointError as error:
            if rank == 0:
                print(f"skipping {path}: {error}", flush=True)
            continue
        if rank == 0:
            print(f"resuming from {path} (step {step})", flush=True)
        return step
    return 0


if __name__ == "__main__":
    main()
