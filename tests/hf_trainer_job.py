"""A transformers.Trainer or orttrainer.hf.Trainer run of tiny GPT-2 (test_hf_trainer.py), as torchrun launches it:
``hf_trainer_job.py {torch|float64|orttrainer} OUT.npz``. Writes the final weights and the logged losses."""

import os
import sys

import numpy as np
import torch
import transformers
from test_hf_models import causal_lm_batch, gpt2_lm
from test_hf_trainer import _arguments, _rows

import orttrainer.hf


def main(contender, out):
    torch.manual_seed(0)
    model = gpt2_lm().double() if contender == "float64" else gpt2_lm()
    trainer_class = orttrainer.hf.Trainer if contender == "orttrainer" else transformers.Trainer
    arguments = _arguments(out + ".run", gradient_accumulation_steps=2, max_grad_norm=0.5, weight_decay=0.1)
    trainer = trainer_class(model=model, args=arguments, train_dataset=_rows(causal_lm_batch, 8))
    trainer.train()
    if trainer.args.process_index == 0:
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        weights = {key: value.numpy() for key, value in model.state_dict().items()}
        np.savez(out, losses=np.array(losses), world=trainer.args.world_size, **weights)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank is done with the process group
    sys.stdout.flush()
    sys.stderr.flush()
    # Not through the destructors: freeing DistributedDataParallel's Reducer joins gloo's run-loop thread while holding
    # the GIL, which that thread needs to free a finished all-gather's tensors (a deadlock, seen 2 of 3 runs on a
    # loaded host); gloo's threads left to the interpreter's exit abort it now and then ("terminate called without an
    # active exception", exit -6).
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
