"""A training job for the exact-resume test: run in its own process.

    python resume_job.py --start 0 --stop 5 --save ckpt.h5 --out w.npz
    python resume_job.py --start 5 --stop 9 --load ckpt.h5 --out w.npz

Encoder with dropout, Adam, gradient accumulation 2 and a warmup schedule; batch k is
always the same tensors, whatever process draws it.
"""

import argparse

import numpy as np
import torch
from models import Encoder, lm_loss, token_batch

from orttrainer import ORTTrainer, ORTTrainerOptions, optim


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--start", type=int, required=True)
    parser.add_argument("--stop", type=int, required=True)
    parser.add_argument("--load")
    parser.add_argument("--save")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.manual_seed(0)
    options = ORTTrainerOptions({
        "device": {"id": "cpu"},
        "batch": {"gradient_accumulation_steps": 2},
        "lr_scheduler": optim.LinearWarmupLRScheduler(20, warmup=0.2),
    })
    trainer = ORTTrainer(Encoder(dropout=0.2), None, optim.AdamConfig(lr=1e-2), loss_fn=lm_loss, options=options)
    if args.load:
        assert trainer.load_checkpoint(args.load) == {"finished_steps": args.start}
    losses = []
    for step in range(args.start, args.stop):
        losses.append(trainer.train_step(*token_batch(generator=torch.Generator().manual_seed(step)))[0].item())
    if args.save:
        trainer.save_checkpoint(args.save, user_dict={"finished_steps": args.stop})
    state = trainer.state_dict()
    arrays = {f"weight/{k}": v for k, v in state["model"]["full_precision"].items()}
    arrays.update({f"moment/{k}/{m}": v for k, e in state["optimizer"].items() for m, v in e.items()})
    np.savez(args.out, losses=np.array(losses), step=state["train_step_info"]["step"], **arrays)


if __name__ == "__main__":
    main()
