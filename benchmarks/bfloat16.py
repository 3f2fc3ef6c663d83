"""Step time of torch and orttrainer, float32 and bfloat16 mixed precision (issue 45), on one workload.

    PYTHONPATH=$PWD python benchmarks/bfloat16.py [--rounds 5] [--steps 3] [--workload "GPT-2 small"] [--out PATH]

Workloads (workloads.BFLOAT16_WORKLOADS, a part of the name selects one): the 6-layer GPT-2 (the default), GPT-2
small (124M, batch 4, seq 128), a BERT-base-shaped classifier (batch 16, seq 128), the CIFAR ResNet (batch 32).

Each contender runs in a worker process of its own (benchmarks/bench.py's: built and warmed up, the first-step check
included, before the timed rounds), and the rounds are interleaved across them, so a busy host slows them alike; each
reports the median of its step times (AdamW, bench.py's settings). torch's bfloat16 is torch.autocast("cpu",
dtype=torch.bfloat16); orttrainer's the option mixed_precision.dtype torch.bfloat16 (graph/bfloat16.py), its matrix
products in ONNX Runtime as float32 ones between casts or on torch's bfloat16 kernels (utils.bfloat16_matmul_kernels,
runtime/torch_products.py).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench  # noqa: E402

BFLOAT16 = {"mixed_precision": {"enabled": True, "dtype": torch.bfloat16}}
CONTENDERS = {  # label: (bench.py's contender, orttrainer options)
    "torch float32": ("torch eager", None),
    "torch autocast bfloat16": ("torch autocast bfloat16", None),
    "orttrainer float32": ("orttrainer", None),
    "orttrainer bfloat16 (products emulated in float32)": ("orttrainer", {**BFLOAT16, "utils": {"bfloat16_matmul_kernels": "onnxruntime"}}),
    "orttrainer bfloat16 (products on torch)": ("orttrainer", {**BFLOAT16, "utils": {"bfloat16_matmul_kernels": "torch"}}),
}  # fmt: skip


RESULTS = Path(__file__).parent / "results" / "bfloat16"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="HF GPT-2 6x d512 vocab 8000 seq 128 (8)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--contenders", default="", help="comma-separated labels of CONTENDERS to run (default: all; "
                        "BERT-base's five workers do not fit 23 GiB together), merged into the workload's stored ones")
    parser.add_argument("--out", type=Path, default=RESULTS,
                        help="results stem: its .json keeps every workload measured, .md and .png are written from it")
    arguments = parser.parse_args()
    workloads = bench._workloads("bfloat16")
    (index,) = [index for index, workload in enumerate(workloads) if arguments.workload.lower() in workload.name.lower()]
    chosen = [label.strip() for label in arguments.contenders.split(",") if label.strip()] or list(CONTENDERS)
    unknown = [label for label in chosen if label not in CONTENDERS]
    if unknown:
        parser.error(f"--contenders: unknown {unknown}; choose from {list(CONTENDERS)}")
    results = bench.measure(index, workloads[index], arguments.rounds, arguments.steps, warmup=2, suite="bfloat16", env={},
                            contenders={label: CONTENDERS[label] for label in chosen})  # fmt: skip
    stored_at = arguments.out.with_suffix(".json")
    stored = json.loads(stored_at.read_text()) if stored_at.exists() else {}
    earlier = stored.get(workloads[index].name, {}).get("results", {}) if len(chosen) < len(CONTENDERS) else {}
    stored[workloads[index].name] = {"rounds": arguments.rounds, "steps": arguments.steps, "threads": torch.get_num_threads(),
                                     "measured": time.strftime("%Y-%m-%d %H:%M"), "results": {**earlier, **results},
                                     "runs": stored.get(workloads[index].name, {}).get("runs", 0) + 1 if earlier else 1}  # fmt: skip
    stored_at.write_text(json.dumps(stored, indent=1))
    table = report(stored)
    arguments.out.with_suffix(".md").write_text(table)
    bar_chart(stored, arguments.out.with_suffix(".png"))
    print(table)


def _medians(entry) -> dict:
    """{contender: median step in s, or None where it failed} of one workload's stored entry."""
    return {name: statistics.median(result["durations"]) if "durations" in result else None
            for name, result in entry["results"].items()}  # fmt: skip


def report(stored) -> str:
    """A markdown table per workload: median step, its ratio to torch.autocast's, peak RSS."""
    lines = ["# bfloat16 mixed precision: step time against torch.autocast (issue 45)", "",
             "`benchmarks/bfloat16.py`: each contender in a worker process of its own, built and warmed up (first-step "
             "check included) before the timed rounds, rounds interleaved; median step, AdamW. Ratio: step / torch "
             "autocast bfloat16's (< 1: faster than autocast).", ""]  # fmt: skip
    for name, entry in stored.items():
        medians = _medians(entry)
        autocast = medians.get("torch autocast bfloat16")
        runs = f", contenders measured in {entry['runs']} runs" if entry.get("runs", 1) > 1 else ""
        lines += [f"## {name}", "", f"{entry['measured']}, {entry['threads']} threads, {entry['rounds']} rounds x "
                  f"{entry['steps']} steps{runs}", "", "| contender | median step (s) | / autocast | peak RSS (MB) |",
                  "|---|---|---|---|"]  # fmt: skip
        for contender, result in entry["results"].items():
            if medians[contender] is None:
                lines.append(f"| {contender} | {result['error']} | | |")
                continue
            ratio = f"{medians[contender] / autocast:.2f}" if autocast else ""
            lines.append(f"| {contender} | {medians[contender]:.3f} | {ratio} | {result['peak_rss_mb']:.0f} |")
        lines.append("")
    return "\n".join(lines)


def bar_chart(stored, path) -> None:
    """Each workload's step times over torch.autocast's, one bar per contender."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, contenders = list(stored), list(CONTENDERS)
    figure, axes = plt.subplots(figsize=(9, 2.5 + 0.35 * len(names) * len(contenders) / 2))
    height = 0.8 / len(contenders)
    for index, contender in enumerate(contenders):
        ratios = []
        for name in names:
            medians = _medians(stored[name])
            autocast = medians.get("torch autocast bfloat16")
            ratios.append(medians[contender] / autocast if medians.get(contender) and autocast else 0)
        axes.barh([i + index * height for i in range(len(names))], ratios, height, label=contender)
    axes.axvline(1.0, color="gray", linestyle="--")
    axes.set_yticks([i + 0.4 - height / 2 for i in range(len(names))], names, fontsize=8)
    axes.invert_yaxis()
    axes.set_xlabel("step time / torch.autocast bfloat16's (lower is faster)")
    axes.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


if __name__ == "__main__":
    main()
