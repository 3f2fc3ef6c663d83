"""Step time of torch and orttrainer, float32 and bfloat16 mixed precision (issue 45), on one workload.

    PYTHONPATH=$PWD python benchmarks/bfloat16.py [--rounds 5] [--steps 3] [--workload "HF GPT-2 ..."]

The four contenders live in one process and take turns (``--steps`` steps each per round, ``--rounds`` rounds), so a
busy host slows them alike; each reports the median of its step times. torch's bfloat16 is torch.autocast("cpu",
dtype=torch.bfloat16); orttrainer's the option mixed_precision.dtype torch.bfloat16 (graph/bfloat16.py).
"""

import argparse
import copy
import statistics
import time

import torch

from orttrainer import ORTTrainer, ORTTrainerOptions, optim
from workloads import train_on, workload_named

LR = 1e-3


def torch_step(model, loss_fn, autocast: bool):
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def step(batch):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = loss_fn(model(*batch[:-1]), batch[-1])
        loss.backward()
        optimizer.step()
        return loss.item()

    return step


def orttrainer_step(model, loss_fn, bfloat16: bool):
    options = {"device": {"id": "cpu"}}
    if bfloat16:
        options["mixed_precision"] = {"enabled": True, "dtype": torch.bfloat16}
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=LR), loss_fn=loss_fn, options=ORTTrainerOptions(options))
    return lambda batch: float(train_on(trainer, batch)[0])


CONTENDERS = {
    "torch float32": lambda model, loss_fn: torch_step(model, loss_fn, autocast=False),
    "torch autocast bfloat16": lambda model, loss_fn: torch_step(model, loss_fn, autocast=True),
    "orttrainer float32": lambda model, loss_fn: orttrainer_step(model, loss_fn, bfloat16=False),
    "orttrainer bfloat16": lambda model, loss_fn: orttrainer_step(model, loss_fn, bfloat16=True),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="HF GPT-2 6x d512 vocab 8000 seq 128 (8)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    arguments = parser.parse_args()
    workload = workload_named(arguments.workload)
    torch.manual_seed(0)
    model = workload.make_model()
    batch = workload.make_batch(torch.Generator().manual_seed(0))
    steps = {name: make(copy.deepcopy(model), workload.loss_fn) for name, make in CONTENDERS.items()}
    first_losses = {name: step(batch) for name, step in steps.items()}  # builds, first-step checks: not timed
    times = {name: [] for name in steps}
    for _ in range(arguments.rounds):
        for name, step in steps.items():
            for _ in range(arguments.steps):
                start = time.perf_counter()
                step(batch)
                times[name].append(time.perf_counter() - start)
    print(f"{workload.name}, {torch.get_num_threads()} threads, {arguments.rounds} rounds x {arguments.steps} steps")
    print("| contender | median step (s) | first loss |\n|---|---|---|")
    for name, measured in times.items():
        print(f"| {name} | {statistics.median(measured):.3f} | {first_losses[name]:.4f} |")


if __name__ == "__main__":
    main()
