"""The first train_step's time, orttrainer against torch eager, phase by phase (issue 38 §4).

    python benchmarks/first_step.py                       # gpt2-small, 3 rounds, one thread
    python benchmarks/first_step.py --row mlp-201m --rounds 5
    python benchmarks/first_step.py --trees /tmp/A,/tmp/B # A/B of two copies of the code (each holds orttrainer/)
    python benchmarks/first_step.py --profile /tmp/first.prof --rounds 1   # cProfile of orttrainer's child

A row of benchmarks/scale.py (default gpt2-small: GPT-2 small's shape, seq 128, batch 4, dropout off), SGD, default
options (the first-step check on). Each contender runs in a fresh process of its own, in rounds that interleave the
contenders (and the code trees), so that a shared host's load falls on all of them alike. orttrainer's first step
counts from ORTTrainer(...) to the end of the first train_step; torch's is forward, backward and the SGD update.

Each run reports wall time and CPU time (the process's, all threads): on a busy host the CPU time moves far less
than the wall time, and with one thread (the default, OMP_NUM_THREADS=1) it is the wall time an idle host would
take. orttrainer's runs also report the phases ``progress.phase`` names (export, gradient build, sessions, check).
The table gives each contender's median over the rounds, and the issue's goal (3 x torch + 10 s) on the CPU times.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(row, contender, profile):
    """Build row ``row`` and take its first step with ``contender``; print one JSON line."""
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    sys.path.insert(0, str(HERE))
    import scale
    from workloads import train_on

    workload = scale.make_workload(row)
    batch = workload.make_batch(torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = workload.make_model()
    phases = []
    if contender == "torch eager":
        optimizer = torch.optim.SGD(model.parameters(), lr=scale.LR)

        def step():
            loss = model(**batch).loss if isinstance(batch, dict) else workload.loss_fn(model(*batch[:-1]), batch[-1])
            loss.backward()
            optimizer.step()
            return loss
    else:
        import contextlib

        import onnxruntime

        from orttrainer import ORTTrainer, ORTTrainerOptions, optim, progress

        onnxruntime.set_default_logger_severity(3)

        @contextlib.contextmanager
        def timed_phase(done):
            start, cpu = time.perf_counter(), time.process_time()
            yield
            phases.append((done.split(" (")[0][:60], time.perf_counter() - start, time.process_time() - cpu))

        progress.phase = timed_phase

        def step():
            trainer = ORTTrainer(model, None, optim.SGDConfig(lr=scale.LR), loss_fn=workload.loss_fn,
                                 options=ORTTrainerOptions({"device": {"id": "cpu"}}))  # fmt: skip
            outputs = train_on(trainer, batch)
            return outputs.loss if hasattr(outputs, "loss") else outputs[0] if isinstance(outputs, list) else outputs

    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    start, cpu = time.perf_counter(), time.process_time()
    loss = float(step())
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile)
    print(json.dumps({"wall": wall, "cpu": cpu, "loss": loss, "phases": phases}), flush=True)


def run(row, contender, tree, profile):
    environment = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if tree:
        environment["PYTHONPATH"] = os.pathsep.join([tree, environment.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    command = [sys.executable, str(Path(__file__).resolve()), "--child", contender, "--row", row]
    command += ["--profile", profile] if profile and contender == "orttrainer" else []
    done = subprocess.run(command, capture_output=True, text=True, env=environment)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        last = [line for line in done.stderr.splitlines() if line.strip()]
        return {"error": last[-1] if last else f"exit {done.returncode}"}
    return json.loads(lines[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", default="gpt2-small", help="a row of benchmarks/scale.py")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trees", default="", help="comma-separated code trees to compare (default: the installed)")
    parser.add_argument("--profile", default="", help="cProfile orttrainer's child into this file (the last round's)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.row, args.child, args.profile)
    trees = [tree for tree in args.trees.split(",") if tree] or [""]
    contenders = [("torch eager", "")] + [("orttrainer", tree) for tree in trees]
    results = {contender: [] for contender in contenders}
    for round_ in range(1, args.rounds + 1):
        for contender, tree in contenders:
            result = run(args.row, contender, tree, args.profile)
            results[(contender, tree)].append(result)
            load = os.getloadavg()[0]
            shown = result.get("error") or (f"wall {result['wall']:.1f} s, cpu {result['cpu']:.1f} s, "
                                            f"loss {result['loss']:.6f}")
            print(f"round {round_}, {contender} {tree}: {shown} (load {load:.1f})", flush=True)
            for name, wall, cpu in result.get("phases", []):
                print(f"    {name}: wall {wall:.1f} s, cpu {cpu:.1f} s")
    torch_cpu = statistics.median(r["cpu"] for r in results[("torch eager", "")] if "error" not in r)
    print("\n| contender | first step wall s (median) | cpu s (median) | goal 3 x torch + 10 s (cpu) |")
    print("|---|---|---|---|")
    for (contender, tree), runs in results.items():
        good = [r for r in runs if "error" not in r]
        if not good:
            print(f"| {contender} {tree} | fails: {runs[0]['error']} | | |")
            continue
        wall, cpu = statistics.median(r["wall"] for r in good), statistics.median(r["cpu"] for r in good)
        goal = "" if contender == "torch eager" else f"{cpu:.1f} vs {3 * torch_cpu + 10:.1f}"
        print(f"| {contender} {tree} | {wall:.1f} | {cpu:.1f} | {goal} |")


if __name__ == "__main__":
    main()
