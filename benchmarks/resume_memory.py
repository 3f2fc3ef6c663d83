"""Peak memory of resuming from a checkpoint against that of training (issue 47 §2).

Rows: MLPs of N x nn.Linear(4096, 4096) (no activation), MSE loss against a random target, batch 8 float32,
optim.AdamConfig (lr 1e-4), default options (the first-step check on). Each contender runs in a fresh process of
its own and reports its peak RSS (getrusage ru_maxrss, model construction included):

- train: build the model, 3 steps, save_checkpoint, then one more step (the loss the resumes must reproduce);
- resume: a new process builds the same model, 1 step, load_checkpoint, 1 more step;
- resume before first step: a new process builds the model, load_checkpoint, 1 step;
- held state_dict: a new process builds the model, 1 step, reads the checkpoint whole (checkpoint.load: the state
  a user holds), load_state_dict, 1 step: its peak should exceed train's by that dict alone ('excess' column).

The goal: a resume's peak within 1.10x of train's. Each resume's step after the load must give train's 4th loss
exactly (a resume is bit-exact on the CPU). ``--tree`` runs another copy of the code (a directory holding
orttrainer/, put first on PYTHONPATH) and ``--label`` names the run in the results, so that the code before and
after a change can be compared; results/resume_memory.json keeps the runs of other labels.

    python benchmarks/resume_memory.py                                   # mlp-201m, label 'current'
    python benchmarks/resume_memory.py --tree /tmp/head --label before   # the same with another copy of the code
    python benchmarks/resume_memory.py --rows mlp-1.07b --contenders train,resume,"resume before first step"
    python benchmarks/resume_memory.py --quick                           # a 4 x Linear(256) row, to a temp dir

Time on the 2-core machine: mlp-201m ~4 min; mlp-1.07b ~15 min (16 GiB of training state, a 12 GiB checkpoint: put
--checkpoints on a disk with room, and leave out 'held state_dict', which holds both, on a 24 GiB machine).
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from children import child_result

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
ROWS = {"mlp-201m": (12, 4096), "mlp-1.07b": (64, 4096)}  # name: (layers, width)
QUICK = {"mlp-tiny": (4, 256)}
BATCH, LR, GOAL = 8, 1e-4, 1.10
CONTENDERS = ("train", "resume", "resume before first step", "held state_dict")


# ----------------------------------------------------------------------------- child
def child(row, contender, path):
    """Run ``contender`` on ``row`` with the checkpoint at ``path``; print one JSON line."""
    import warnings

    import onnxruntime
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from orttrainer import ORTTrainer, ORTTrainerOptions, checkpoint, optim

    warnings.filterwarnings("ignore")
    onnxruntime.set_default_logger_severity(3)
    layers, width = {**ROWS, **QUICK}[row]

    def batch(index):
        generator = torch.Generator().manual_seed(index)
        return torch.randn(BATCH, width, generator=generator), torch.randn(BATCH, width, generator=generator)

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    trainer = ORTTrainer(model, None, optim.AdamConfig(lr=LR), loss_fn=F.mse_loss,
                         options=ORTTrainerOptions({"device": {"id": "cpu"}}))  # fmt: skip
    result = {"params": sum(parameter.numel() for parameter in model.parameters())}
    try:
        if contender == "train":
            for index in range(3):
                trainer.train_step(*batch(index))
            start = time.perf_counter()
            trainer.save_checkpoint(path, overwrite=True)
            result["save_s"] = time.perf_counter() - start
            result["checkpoint_gib"] = os.path.getsize(path) / 2**30
        elif contender == "held state_dict":
            trainer.train_step(*batch(0))
            state = checkpoint.load(path)
            start = time.perf_counter()
            trainer.load_state_dict(state)
            result["load_s"] = time.perf_counter() - start
            del state
        else:
            if contender == "resume":
                trainer.train_step(*batch(0))
            start = time.perf_counter()
            trainer.load_checkpoint(path)
            result["load_s"] = time.perf_counter() - start
        result["loss_after"] = float(trainer.train_step(*batch(3))[0])  # train's 4th step, each resume's next
    except Exception as error:  # reported in the table, not a crash of the benchmark
        lines = str(error).strip().splitlines() or [""]
        result["error"] = f"{type(error).__name__}: {lines[0][:200]}"
    result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(json.dumps(result), flush=True)


# ---------------------------------------------------------------------------- parent
def run_child(row, contender, path, tree):
    """The child's JSON result, or {"error": ...} when it died without one (killed for memory, say)."""
    environment = dict(os.environ)
    if tree:
        environment["PYTHONPATH"] = os.pathsep.join([str(tree), environment.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", row, contender, str(path)],
                          capture_output=True, text=True, env=environment)  # fmt: skip
    result = child_result(done)
    result["wall_s"] = time.perf_counter() - start
    return result


def measure(row, label, tree, directory, contenders):
    """The ``contenders`` of ``row`` in turn (train first: it writes the checkpoint the others load)."""
    entry = {"row": row, "label": label, "layers_width": list({**ROWS, **QUICK}[row]), "measured": date.today().isoformat()}
    path = Path(directory) / f"{row}.ortcp"
    try:
        for contender in contenders:
            print(f"{row} [{label}]: {contender} ...", end=" ", flush=True)
            result = entry[contender] = run_child(row, contender, path, tree)
            print(result.get("error") or f"peak {result['peak_rss_gib']:.2f} GiB, {result['wall_s']:.0f} s", flush=True)
    finally:
        path.unlink(missing_ok=True)
    train = entry["train"]
    for contender in contenders[1:]:
        result = entry[contender]
        if "error" not in train and "error" not in result:
            result["ratio"] = result["peak_rss_gib"] / train["peak_rss_gib"]
            result["excess_gib"] = result["peak_rss_gib"] - train["peak_rss_gib"] - train["checkpoint_gib"]
            result["same_loss"] = result["loss_after"] == train["loss_after"]
    return entry


def _cell(result, key, form):
    if "error" in result:
        return "fails"
    return "-" if result.get(key) is None else format(result[key], form)


def markdown(report):
    lines = [f"Peak RSS (GiB) of a fresh process per contender, {BATCH} x float32 batches, Adam, default options; "
             f"goal: a resume within {GOAL:.2f}x of train; 'excess': held state_dict's peak over train's plus the "
             f"dict. 'same loss': the step after the load gives train's 4th loss exactly. Machine: {report['machine']}.", "",
             "| row | code | parameters | checkpoint GiB | train peak | resume peak | ratio | resume before first step "
             "peak | ratio | held state_dict peak | excess | save s | load s (resume / before first step / held) "
             "| same loss | measured |", "|---" * 15 + "|"]
    failures = []
    for entry in report["runs"]:
        train, resume, early, held = (entry.get(contender, {}) for contender in CONTENDERS)  # {}: not run
        failures += [f"- {entry['row']} [{entry['label']}], {contender}: {entry[contender]['error']}"
                     for contender in CONTENDERS if "error" in entry.get(contender, {})]  # fmt: skip
        params = next((result["params"] for result in (train, resume, early, held) if "params" in result), None)
        layers, width = entry["layers_width"]
        same = [result.get("same_loss") for result in (resume, early, held) if result]
        lines.append("| " + " | ".join([
            f"{entry['row']} ({layers} x Linear({width}, {width}))", entry["label"],
            f"{params / 1e6:,.1f}M" if params else "-", _cell(train, "checkpoint_gib", ".2f"),
            _cell(train, "peak_rss_gib", ".2f"), _cell(resume, "peak_rss_gib", ".2f"), _cell(resume, "ratio", ".2f"),
            _cell(early, "peak_rss_gib", ".2f"), _cell(early, "ratio", ".2f"), _cell(held, "peak_rss_gib", ".2f"),
            _cell(held, "excess_gib", "+.2f"), _cell(train, "save_s", ".1f"),
            " / ".join(_cell(result, "load_s", ".1f") for result in (resume, early, held)),
            "-" if None in same else "yes" if all(same) else "**no**", entry["measured"],
        ]) + " |")  # fmt: skip
    if failures:
        lines += ["", "Failures:", *failures]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="mlp-201m", help=f"comma-separated rows: {', '.join(ROWS)}")
    parser.add_argument("--quick", action="store_true", help=f"only the row {', '.join(QUICK)} (a smoke run)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated, train first (default: all)")
    parser.add_argument("--tree", default="", help="a copy of the code to run (a directory holding orttrainer/)")
    parser.add_argument("--label", default="current", help="names the code measured in the results")
    parser.add_argument("--checkpoints", default=None, help="where the checkpoints are written (default: a temporary "
                                                            "directory)")
    parser.add_argument("--out", type=Path, default=None, help=f"where the results go (default {RESULTS}; --quick: a "
                                                               "temporary directory)")
    parser.add_argument("--child", nargs=3, metavar=("ROW", "CONTENDER", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="resume_memory-quick-")) if args.quick else RESULTS
    elif args.quick and args.out.resolve() == RESULTS:
        parser.error(f"--quick does not write to {RESULTS}: its numbers are a smoke run's")
    rows = list(QUICK) if args.quick else [row.strip() for row in args.rows.split(",") if row.strip()]
    unknown = [row for row in rows if row not in ROWS and row not in QUICK]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {', '.join([*ROWS, *QUICK])}")
    contenders = [contender.strip() for contender in args.contenders.split(",") if contender.strip()]
    if contenders[:1] != ["train"] or not set(contenders) <= set(CONTENDERS):
        parser.error(f"--contenders: 'train' first, then any of {', '.join(CONTENDERS[1:])}")
    with tempfile.TemporaryDirectory(dir=args.checkpoints) as directory:
        new = [measure(row, args.label, args.tree, directory, contenders) for row in rows]
    sys.path.insert(0, str(HERE))
    from bench import _cpu_model  # imports torch: only after the children

    report = {"machine": f"{_cpu_model()}, {os.cpu_count()} cores", "runs": new}
    results = args.out / "resume_memory.json"
    if results.exists():  # the runs of other rows and labels stay; this run replaces its own
        measured = {(entry["row"], entry["label"]) for entry in new}
        kept = [entry for entry in json.loads(results.read_text())["runs"] if (entry["row"], entry["label"]) not in measured]
        report["runs"] = sorted(kept + new, key=lambda entry: ([*ROWS, *QUICK].index(entry["row"]), entry["measured"]))
    table = markdown(report)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "resume_memory.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
