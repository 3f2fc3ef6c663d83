"""How the cost of training grows with model size: orttrainer against torch eager (issue 38 §6).

Models: MLPs (N x Linear(H, H) + ReLU, then Linear(H, 10) and cross-entropy; batch 8) and Hugging Face
GPT2LMHeadModel shapes (random init from a GPT2Config, vocab 50257, dropout off, labels = input_ids),
from ~10M to over 1B parameters. Each contender trains each model in a fresh process of its own
(``scale.py --child``), with the same weights (torch.manual_seed(0)), the same batches and plain SGD
(lr 1e-3; torch: forward, loss.backward(), torch.optim.SGD step, zero_grad; orttrainer: default
options, the first-step check on, optim.SGDConfig, which never clips), and reports:
- peak RSS of the whole process (getrusage ru_maxrss, model construction included),
- the first step's time (orttrainer: ORTTrainer(...) + the first train_step; torch: the first step),
- the median of the next --steps steps,
- every step's loss: orttrainer's must equal torch's to rtol 1e-3.
A contender that fails (an exception, or killed for memory) is recorded with its error's first line.

    python benchmarks/scale.py                     # every row; writes benchmarks/results/scale.{json,md,png}
    python benchmarks/scale.py --quick             # two tiny rows, under a minute (checks it works)
    python benchmarks/scale.py --sizes mlp-201m,gpt2-small --steps 3 --out /tmp/scale
    python benchmarks/scale.py --sizes mlp-10m --add  # run one row again, keep the others of results/scale.json

Time on the 2-core machine: --quick ~1 min; the rows up to 201M 11 min (measured with other jobs running);
the whole set, with the >1B rows (8+ GB of RAM each), an hour or more (dominated by gpt2-large, gpt2-xl
and mlp-1.07b). Default malloc, as a new user runs it; one child at a time.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

from children import child_result, merged_rows

HERE = Path(__file__).resolve().parent
CONTENDERS = ("torch eager", "orttrainer")
LR, RTOL = 1e-3, 1e-3
GPT2_VOCAB = 50257

# name: (kind, shape, batch). mlp shape: (layers, width); gpt2 shape: (n_layer, n_embd, n_head, seq, vocab, positions)
ROWS = {
    "mlp-10m": ("mlp", (10, 1024), 8),
    "mlp-50m": ("mlp", (12, 2048), 8),
    "mlp-201m": ("mlp", (12, 4096), 8),
    "mlp-1.07b": ("mlp", (64, 4096), 8),
    "gpt2-10m": ("gpt2", (2, 192, 3, 128, GPT2_VOCAB, 1024), 4),
    "gpt2-small": ("gpt2", (12, 768, 12, 128, GPT2_VOCAB, 1024), 4),
    "gpt2-medium": ("gpt2", (24, 1024, 16, 128, GPT2_VOCAB, 1024), 4),
    "gpt2-large": ("gpt2", (36, 1280, 20, 64, GPT2_VOCAB, 1024), 2),
    "gpt2-xl": ("gpt2", (48, 1600, 25, 64, GPT2_VOCAB, 1024), 2),
}
QUICK = {"mlp-tiny": ("mlp", (4, 256), 8), "gpt2-tiny": ("gpt2", (2, 64, 2, 32, 1000, 64), 2)}


def describe(name):
    kind, shape, batch = {**ROWS, **QUICK}[name]
    if kind == "mlp":
        return f"{shape[0]} x Linear({shape[1]}, {shape[1]}) + ReLU, batch {batch}"
    layers, width, heads, seq, vocab, _ = shape
    return f"GPT-2 {layers} x {width}, {heads} heads, vocab {vocab}, seq {seq}, batch {batch}"


# ----------------------------------------------------------------------------- child
def make_workload(name):
    """The row's Workload (workloads.py): model, loss (None: the model returns its own), batches."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from workloads import Workload

    kind, shape, batch = {**ROWS, **QUICK}[name]
    if kind == "mlp":
        layers, width = shape

        def make_model():
            blocks = [module for _ in range(layers) for module in (nn.Linear(width, width), nn.ReLU())]
            return nn.Sequential(*blocks, nn.Linear(width, 10))

        return Workload(name, make_model, F.cross_entropy,
                        lambda g: (torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g)))
    layers, width, heads, seq, vocab, positions = shape

    def make_gpt2():
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=width, n_layer=layers, n_head=heads,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                            attn_implementation="eager")  # fmt: skip
        return GPT2LMHeadModel(config)

    def tokens(g):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        return {"input_ids": ids, "labels": ids}

    return Workload(name, make_gpt2, None, tokens)


def child(name, contender, steps):
    """Train row ``name`` with ``contender`` for 1 + ``steps`` steps; print one JSON line."""
    import resource
    import warnings

    import torch

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    sys.path.insert(0, str(HERE))
    from workloads import train_on

    workload = make_workload(name)
    generator = torch.Generator().manual_seed(0)
    batches = [workload.make_batch(generator) for _ in range(1 + steps)]
    torch.manual_seed(0)
    model = workload.make_model()
    result = {"params": sum(p.numel() for p in model.parameters()), "losses": [], "times": []}
    try:
        if contender == "torch eager":
            optimizer = torch.optim.SGD(model.parameters(), lr=LR)

            def step(batch):  # bench._loss's rule; bench is not imported here: it imports onnx (+17 MB of RSS)
                if isinstance(batch, dict):
                    loss = model(**batch).loss
                else:
                    loss = workload.loss_fn(model(*batch[:-1]), batch[-1])
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                return loss
        else:
            import onnxruntime

            from orttrainer import ORTTrainer, ORTTrainerOptions, optim

            onnxruntime.set_default_logger_severity(3)
            trainer = None

            def step(batch):
                nonlocal trainer
                if trainer is None:  # constructed inside the first step's time
                    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=LR), loss_fn=workload.loss_fn,
                                         options=ORTTrainerOptions({"device": {"id": "cpu"}}))  # fmt: skip
                outputs = train_on(trainer, batch)
                return outputs.loss if hasattr(outputs, "loss") else outputs[0] if isinstance(outputs, list) else outputs

        for batch in batches:
            start = time.perf_counter()
            loss = float(step(batch))
            result["times"].append(time.perf_counter() - start)
            result["losses"].append(loss)
    except Exception as error:  # reported in the table, not a crash of the benchmark
        lines = str(error).strip().splitlines() or [""]
        result["error"] = f"{type(error).__name__}: {lines[0][:200]}"
    result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(json.dumps(result), flush=True)


# ---------------------------------------------------------------------------- parent
def run_child(name, contender, steps):
    """The child's JSON result, or {"error": ...} when it died without one (killed for memory, say)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", name, contender, "--steps", str(steps)],
                          capture_output=True, text=True)  # fmt: skip
    result = child_result(done)
    result["wall_s"] = time.perf_counter() - start
    return result


def summarize(entry):
    """First-step and median steady time of a contender's result, and the loss comparison of the row."""
    for contender in CONTENDERS:
        result = entry[contender]
        times = result.get("times", [])
        if "error" not in result and times:
            result["first_step_s"] = times[0]
            result["step_s"] = statistics.median(times[1:]) if len(times) > 1 else None
    torch_losses, ours = entry["torch eager"].get("losses", []), entry["orttrainer"].get("losses", [])
    if "error" in entry["torch eager"] or "error" in entry["orttrainer"] or not ours:
        entry["loss_match"] = None
    else:
        entry["max_rel_diff"] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours, torch_losses))
        entry["loss_match"] = len(ours) == len(torch_losses) and all(
            math.isclose(a, b, rel_tol=RTOL) for a, b in zip(ours, torch_losses))


def _cell(value, form=".2f"):
    return "-" if value is None else format(value, form)


def _ratio(ours, theirs):
    return f"{ours / theirs:.2f}x" if ours and theirs else "-"


def markdown(report):
    lines = [f"Measured {report['date']} on {report['machine']}; SGD lr {LR}, {report['steps']} steps after the first "
             f"(median); peak RSS of the whole process in GiB; times in s. Losses compared step by step, rtol {RTOL}.",
             "", "| model | parameters | weights GiB | torch peak | ours peak | ratio | torch first step | ours first step "
             "| torch step | ours step | ratio | loss match |", "|---" * 12 + "|"]
    failures = []
    for entry in report["rows"]:
        torch_result, ours = entry["torch eager"], entry["orttrainer"]
        for contender in CONTENDERS:
            if "error" in entry[contender]:
                failures.append(f"- {entry['name']}, {contender}: {entry[contender]['error']}")
        params = entry.get("params")
        cells = [f"{entry['name']} ({entry['model']})", f"{params / 1e6:,.1f}M" if params else "-",
                 _cell(params * 4 / 2**30 if params else None)]

        def get(result, key):
            return None if "error" in result else result.get(key)

        for key in ("peak_rss_gib", "first_step_s", "step_s"):
            theirs, mine = get(torch_result, key), get(ours, key)
            form = ".2f" if key == "peak_rss_gib" else ".3g"
            cells += [_cell(theirs, form), "fails" if "error" in ours else _cell(mine, form)]
            if key != "first_step_s":
                cells.append(_ratio(mine, theirs))
        match = entry.get("loss_match")
        cells.append("-" if match is None else f"yes ({entry['max_rel_diff']:.1e})" if match
                     else f"**no** ({entry['max_rel_diff']:.1e})")
        lines.append("| " + " | ".join(cells) + " |")
    if failures:
        lines += ["", "Failures:", *failures]
    return "\n".join(lines)


def plot(report, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = (("peak_rss_gib", "peak RSS (GiB)"), ("first_step_s", "first step (s)"), ("step_s", "step (s)"))
    for axis, (key, label) in zip(axes, panels):
        for contender, color in zip(CONTENDERS, ("tab:blue", "tab:orange")):
            for kind, marker in (("mlp", "o"), ("gpt2", "s")):
                rows = [row for row in report["rows"] if row["kind"] == kind and row.get("params")
                        and "error" not in row[contender] and row[contender].get(key)]  # fmt: skip
                if rows:
                    axis.plot([row["params"] for row in rows], [row[contender][key] for row in rows], marker=marker,
                              color=color, linestyle="-" if kind == "mlp" else "--", label=f"{contender}, {kind}")
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("parameters")
        axis.set_title(label)
        axis.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="", help=f"comma-separated rows (default: all): {', '.join(ROWS)}")
    parser.add_argument("--quick", action="store_true", help=f"only the rows {', '.join(QUICK)} (a smoke run)")
    parser.add_argument("--steps", type=int, default=None, help="steps timed after the first (default 3; --quick 2)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--add", action="store_true", help="keep the other rows of --out's scale.json (a row run again "
                                                           "replaces its old one)")
    parser.add_argument("--child", nargs=2, metavar=("ROW", "CONTENDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    steps = args.steps if args.steps is not None else 2 if args.quick else 3
    if args.child:
        return child(*args.child, steps)
    names = list(QUICK) if args.quick else [name.strip() for name in args.sizes.split(",") if name.strip()] or list(ROWS)
    unknown = [name for name in names if name not in ROWS and name not in QUICK]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {', '.join([*ROWS, *QUICK])}")
    report = {"date": date.today().isoformat(), "steps": steps, "rows": []}
    for name in names:
        entry = {"name": name, "model": describe(name), "kind": {**ROWS, **QUICK}[name][0]}
        for contender in CONTENDERS:  # one child at a time: each its own process, its own peak RSS
            print(f"{name}: {contender} ...", end=" ", flush=True)
            entry[contender] = run_child(name, contender, steps)
            entry["params"] = entry.get("params") or entry[contender].get("params")
            print(entry[contender].get("error") or f"peak {entry[contender]['peak_rss_gib']:.2f} GiB, "
                  f"{entry[contender]['wall_s']:.0f} s", flush=True)
        summarize(entry)
        report["rows"].append(entry)
    sys.path.insert(0, str(HERE))
    from bench import _cpu_model  # imports torch: only after the children, whose peak RSS a big parent would inflate

    report["machine"] = f"{_cpu_model()}, {os.cpu_count()} cores"
    if args.add and (args.out / "scale.json").exists():
        report["rows"] = merged_rows(json.loads((args.out / "scale.json").read_text())["rows"], report["rows"], [*ROWS, *QUICK])
    table = markdown(report)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scale.json").write_text(json.dumps(report, indent=1))
    (args.out / "scale.md").write_text(table + "\n")
    plot(report, args.out / "scale.png")
    failed = [row["name"] for row in report["rows"] if row["loss_match"] is False]
    if failed:
        sys.exit(f"orttrainer's losses differ from torch's on {', '.join(failed)}")


if __name__ == "__main__":
    main()
