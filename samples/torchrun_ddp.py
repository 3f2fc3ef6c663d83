"""Data-parallel training with torchrun: the digits CNN on 2 processes (gloo on the CPU).

    torchrun --standalone --nproc_per_node=2 samples/torchrun_ddp.py [--zero] [--epochs 20]

Each rank trains on its share of every batch; gradients are averaged across ranks once per
update; with --zero each rank keeps only its part of Adam's state (ZeRO stage 1). Rank 0
prints progress and writes one consolidated checkpoint at the end.
"""

import argparse
import os

import torch
import torch.nn.functional as F
from digits_classifier import DigitsCNN, accuracy, load_split

from orttrainer import ORTTrainer, ORTTrainerOptions, optim


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=64, help="samples per step over all ranks")
    parser.add_argument("--zero", action="store_true", help="shard Adam's state across ranks (ZeRO-1)")
    parser.add_argument("--checkpoint", default="runs/ddp/digits.ortcp")
    args = parser.parse_args()

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    (train_x, train_y), (test_x, test_y) = load_split()
    torch.manual_seed(0)
    options = ORTTrainerOptions({
        "device": {"id": "cpu"},
        "distributed": {"deepspeed_zero_optimization": {"stage": 1 if args.zero else 0}},
    })
    trainer = ORTTrainer(DigitsCNN(), None, optim.AdamConfig(lr=3e-3), loss_fn=F.cross_entropy, options=options)
    share = args.global_batch // world
    generator = torch.Generator().manual_seed(0)  # the same shuffle on every rank
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(train_y), generator=generator)
        for start in range(0, len(order) - args.global_batch + 1, args.global_batch):
            mine = order[start + rank * share : start + (rank + 1) * share]
            loss = trainer.train_step(train_x[mine], train_y[mine])[0].item()
        if rank == 0 and (epoch % 5 == 0 or epoch == args.epochs):
            print(f"epoch {epoch}: rank 0 loss {loss:.3f}, test accuracy {accuracy(trainer, test_x, test_y):.2%}", flush=True)
    os.makedirs(os.path.dirname(args.checkpoint) or ".", exist_ok=True)
    trainer.save_checkpoint(args.checkpoint, consolidate=True, overwrite=True)
    if rank == 0:
        print(f"{world} ranks; consolidated checkpoint: {args.checkpoint}")


if __name__ == "__main__":
    main()
