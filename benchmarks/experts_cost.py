"""What a mixture of experts costs to train: torch against orttrainer's traced experts (export/experts.py).

The zoo's Mixtral (tests/zoo.py: 2 layers, 4 heads) at hidden 256, intermediate 512, batches of 4 x 128 tokens, SGD
(lr 1e-3), default options (the first step checked against torch). Rows: the number of experts and experts per
token. Contenders, each in a worker process of its own (its peak RSS its own, getrusage ru_maxrss, the model's
construction, the export and the first step's check included):

- torch: a plain torch loop in transformers' default experts implementation ("grouped_mm");
- orttrainer every expert: this code, which traces every expert computing every token;
- orttrainer batched_mm: the code given by ``--before`` (a directory holding orttrainer/, put first on
  PYTHONPATH), which traced transformers' "batched_mm" (a copy of the chosen experts' weights per token).

The parent interleaves the timing: each round, every worker in turn times ``--steps`` steps, so that the busy
machine's noise hits all alike; after two steps of warm-up. Reported: the median and the fastest step, peak RSS.

    git archive 2e6e528 orttrainer | tar -x -C /tmp/before
    python benchmarks/experts_cost.py --before /tmp/before            # every row: results/experts_cost.{json,md}
    python benchmarks/experts_cost.py --before /tmp/before --rows 8x2 --rounds 4
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
ROWS = {"8x2": (8, 2), "16x1": (16, 1), "64x1": (64, 1)}  # name: (experts, experts per token)
SIZES = dict(hidden_size=256, intermediate_size=512, max_position_embeddings=128)
BATCH, LENGTH, LR, WARM_UP = 4, 128, 1e-3, 2
CONTENDERS = ("torch", "orttrainer every expert", "orttrainer batched_mm")


# ----------------------------------------------------------------------------- worker
def worker(row, contender):
    """Build ``contender`` on ``row``, then answer the parent's lines: a number n runs n timed steps and prints their
    durations; 'peak' prints the peak RSS (GiB)."""
    import warnings

    import onnxruntime
    import torch

    sys.path.insert(0, str(HERE.parent / "tests"))
    import zoo

    warnings.filterwarnings("ignore")
    onnxruntime.set_default_logger_severity(3)
    experts, top_k = ROWS[row]
    torch.manual_seed(0)
    model = zoo.mixtral_lm(**SIZES, num_local_experts=experts, num_experts_per_tok=top_k)
    batches = [zoo.causal_lm_batch(BATCH, LENGTH, generator=torch.Generator().manual_seed(index)) for index in range(4)]
    step = _torch_step(model) if contender == "torch" else _orttrainer_step(model)
    count = 0
    for line in sys.stdin:
        if line.strip() == "peak":
            print(json.dumps({"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}), flush=True)
            continue
        durations = []
        for _ in range(int(line)):
            start = time.perf_counter()
            step(batches[count % len(batches)])
            durations.append(time.perf_counter() - start)
            count += 1
        print(json.dumps({"durations": durations}), flush=True)


def _torch_step(model):
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def step(batch):
        optimizer.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        optimizer.step()

    return step


def _orttrainer_step(model):
    from orttrainer import ORTTrainer, ORTTrainerOptions, optim

    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=LR), options=ORTTrainerOptions({"device": {"id": "cpu"}}))
    return lambda batch: trainer.train_step(**batch)


# ----------------------------------------------------------------------------- parent
class _Worker:
    def __init__(self, row, contender, before):
        environment = dict(os.environ)
        if contender == "orttrainer batched_mm":
            paths = [str(before), environment.get("PYTHONPATH", "")]
            environment["PYTHONPATH"] = os.pathsep.join(paths).rstrip(os.pathsep)
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", row, contender]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        env=environment)  # fmt: skip

    def ask(self, line: str) -> dict:
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        if not answer:
            raise RuntimeError(f"worker exited with {self.process.wait()}")
        return json.loads(answer)

    def close(self):
        self.process.stdin.close()
        self.process.wait()


def measure(row, before, rounds, steps) -> dict:
    """Every contender on ``row``, timed in interleaved rounds."""
    workers = {contender: _Worker(row, contender, before) for contender in CONTENDERS}
    durations = {contender: [] for contender in CONTENDERS}
    try:
        for contender, running in workers.items():
            running.ask(str(WARM_UP))
        for index in range(rounds):
            for contender, running in workers.items():
                durations[contender] += running.ask(str(steps))["durations"]
            print(f"{row}: round {index + 1}/{rounds}", flush=True)
        peaks = {contender: running.ask("peak")["peak_rss_gib"] for contender, running in workers.items()}
    finally:
        for running in workers.values():
            running.close()
    return {contender: {"median_s": statistics.median(durations[contender]), "fastest_s": min(durations[contender]),
                        "peak_rss_gib": peaks[contender], "durations_s": durations[contender]}
            for contender in CONTENDERS}  # fmt: skip


def table(results: dict) -> str:
    lines = [f"Measured {date.today().isoformat()} on a busy 2-core host: zoo Mixtral, {SIZES['hidden_size']} hidden, "
             f"{SIZES['intermediate_size']} intermediate, {BATCH} x {LENGTH} tokens, SGD; seconds per step: median "
             "(fastest), peak RSS GiB.", "",
             "| experts x per token | " + " | ".join(CONTENDERS) + " |",
             "|---" * (len(CONTENDERS) + 1) + "|"]  # fmt: skip
    for row, measured in results.items():
        cells = [f"{measured[name]['median_s']:.2f} ({measured[name]['fastest_s']:.2f}), "
                 f"{measured[name]['peak_rss_gib']:.2f} GiB" for name in CONTENDERS]  # fmt: skip
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", nargs=2, metavar=("ROW", "CONTENDER"), help=argparse.SUPPRESS)
    parser.add_argument("--before", type=Path, help="a directory holding the orttrainer/ that traced batched_mm")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="steps per worker per round")
    arguments = parser.parse_args()
    if arguments.worker:
        worker(*arguments.worker)
        return
    if arguments.before is None or not (arguments.before / "orttrainer").is_dir():
        parser.error("--before must name a directory holding orttrainer/ (the code that traced batched_mm)")
    rows = arguments.rows.split(",")
    results = {row: measure(row, arguments.before, arguments.rounds, arguments.steps) for row in rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "experts_cost.json").write_text(json.dumps(results, indent=1) + "\n")
    (RESULTS / "experts_cost.md").write_text(table(results))
    print(table(results))


if __name__ == "__main__":
    main()
