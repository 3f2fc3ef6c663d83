"""A data-parallel training job for the distributed tests (run under torchrun, or alone).

Step k's global batch is always the same tensors; rank r of R trains on rows [r*G/R, (r+1)*G/R).
With ``--uneven`` the model is a sequence-first encoder (a graph per shape) and step k has two
parts of different sequence lengths and batch sizes: rank r trains part r; run alone (with
``--accumulation 2``), the job trains both parts one after the other.
"""

import argparse
import os

import numpy as np
import torch
from models import VOCAB, Encoder, SeqFirstEncoder, lm_loss, token_batch

from orttrainer import ORTTrainer, ORTTrainerOptions, optim


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--first-step", type=int, default=0)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--zero", action="store_true")
    parser.add_argument("--clip", action="store_true")
    parser.add_argument("--save-at", type=int, default=-1, help="save a checkpoint after this many steps")
    parser.add_argument("--checkpoint", help="its path, with {rank} for per-rank (ZeRO) checkpoints")
    parser.add_argument("--consolidate", action="store_true", help="ZeRO: save one merged checkpoint")
    parser.add_argument("--load", nargs="*", default=[])
    parser.add_argument("--load-on-rank-1", nargs="*", help="what rank 1 loads instead (a node with other files)")
    parser.add_argument("--crash-at", type=int, default=-1, help="rank 1 raises at this step")
    parser.add_argument("--uneven", action="store_true", help="ranks train batches of different shapes")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.manual_seed(rank)  # different initial weights on purpose: rank 0's must win
    options = ORTTrainerOptions({
        "device": {"id": "cpu"},
        "batch": {"gradient_accumulation_steps": args.accumulation},
        "utils": {"grad_norm_clip": args.clip},
        "distributed": {"deepspeed_zero_optimization": {"stage": 1 if args.zero else 0}},
    })
    config = optim.AdamConfig(lr=2e-3, lambda_coef=0.01, epsilon=1e-4, max_norm_clip=0.2)
    model = SeqFirstEncoder() if args.uneven else Encoder(dropout=0.0)
    trainer = ORTTrainer(model, None, config, loss_fn=lm_loss, options=options)
    load = args.load_on_rank_1 if rank == 1 and args.load_on_rank_1 is not None else args.load
    if load:
        trainer.load_checkpoint(*load)
    share = args.global_batch // world
    for step in range(args.first_step, args.steps):
        if step == args.crash_at and rank == 1:
            raise RuntimeError("rank 1 fails on purpose")
        if args.uneven:
            parts = uneven_parts(step)
            for part in parts if world == 1 else [parts[rank]]:
                trainer.train_step(*part)
        else:
            tokens, labels = token_batch(batch=args.global_batch, generator=torch.Generator().manual_seed(step))
            trainer.train_step(tokens[rank * share : (rank + 1) * share], labels[rank * share : (rank + 1) * share])
        if step + 1 == args.save_at:
            trainer.save_checkpoint(args.checkpoint, consolidate=args.consolidate)
    trained = trainer.state_dict(pytorch_format=True)  # every rank trained its module in place
    stale = [name for name, tensor in model.state_dict().items() if not torch.equal(tensor, trained[name])]
    if stale:
        raise RuntimeError(f"rank {rank}: the module does not hold the trained {stale}")
    state = trainer.state_dict()
    if rank == 0:
        np.savez(args.out, **{f"weight/{k}": v for k, v in state["model"]["full_precision"].items()})


def uneven_parts(step):
    """Step ``step``'s two parts: (tokens, labels) of shape (sequence, batch), (12, 5) / (7, 3) and so on."""
    generator = torch.Generator().manual_seed(step)
    shapes = [([12, 7, 9][(step + part) % 3], [5, 3][part]) for part in (0, 1)]
    return [tuple(torch.randint(0, VOCAB, shape, generator=generator) for _ in range(2)) for shape in shapes]


if __name__ == "__main__":
    main()
