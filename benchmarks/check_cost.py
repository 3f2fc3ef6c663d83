"""Cost of the built-in check against torch (debug.check_against_torch) on step one.

For each workload, in a fresh process per (workload, mode): the wall time of the first
train_step (export + graph build + sessions + the step; with the check also the extra
ONNX Runtime run and torch's forward/backward) and the process's peak RSS after it, with
the check on ("error", the default) and off. Writes benchmarks/results/check_cost.md.

    python benchmarks/check_cost.py [--repeats 3]
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent


def measure(workload_index: int, mode: str) -> dict:
    """Run in a child process: the first step of one workload with the check in ``mode``."""
    import torch

    from orttrainer import ORTTrainer, ORTTrainerOptions, optim
    from workloads import WORKLOADS, train_on

    torch.manual_seed(0)
    workload = WORKLOADS[workload_index]
    batch = workload.make_batch(torch.Generator().manual_seed(0))
    options = ORTTrainerOptions({"device": {"id": "cpu"}, "debug": {"check_against_torch": mode}})
    trainer = ORTTrainer(workload.make_model(), None, optim.AdamConfig(lr=1e-3), loss_fn=workload.loss_fn, options=options)
    start = time.perf_counter()
    train_on(trainer, batch)
    first = time.perf_counter() - start
    start = time.perf_counter()
    train_on(trainer, batch)
    second = time.perf_counter() - start
    return {"first_step_s": first, "second_step_s": second, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_child(workload_index: int, mode: str) -> dict:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)])}
    output = subprocess.run([sys.executable, __file__, "--child", str(workload_index), mode], env=environment,
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    return json.loads(output.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(int(args.child[0]), args.child[1])))
        return
    sys.path.insert(0, str(HERE))
    from workloads import WORKLOADS

    rows = ["| workload | first step, check off (s) | first step, check on (s) | extra | peak RSS off / on (MB) |",
            "|---|---|---|---|---|"]  # fmt: skip
    for index, workload in enumerate(WORKLOADS):
        results = {mode: [run_child(index, mode) for _ in range(args.repeats)] for mode in ("off", "error")}
        first = {mode: statistics.median(r["first_step_s"] for r in runs) for mode, runs in results.items()}
        rss = {mode: statistics.median(r["peak_rss_mb"] for r in runs) for mode, runs in results.items()}
        rows.append(f"| {workload.name} | {first['off']:.2f} | {first['error']:.2f} | +{first['error'] - first['off']:.2f} s "
                    f"| {rss['off']:.0f} / {rss['error']:.0f} |")  # fmt: skip
        print(rows[-1], flush=True)
    machine = f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}, median of {args.repeats} processes each"
    (HERE / "results" / "check_cost.md").write_text("\n".join([f"Cost of the built-in check on step one ({machine}).", "", *rows, ""]))


if __name__ == "__main__":
    main()
