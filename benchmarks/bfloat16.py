"""Step time of torch and orttrainer, float32 and bfloat16 mixed precision (issue 45), on one workload.

    PYTHONPATH=$PWD python benchmarks/bfloat16.py [--rounds 5] [--steps 3] [--workload "HF GPT-2 ..."] [--out PATH]

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
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench  # noqa: E402

BFLOAT16 = {"mixed_precision": {"enabled": True, "dtype": torch.bfloat16}}
CONTENDERS = {  # label: (bench.py's contender, orttrainer options)
    "torch float32": ("torch eager", None),
    "torch autocast bfloat16": ("torch autocast bfloat16", None),
    "orttrainer float32": ("orttrainer", None),
    "orttrainer bfloat16, products emulated in float32": ("orttrainer", {**BFLOAT16, "utils": {"bfloat16_matmul_kernels": "onnxruntime"}}),
    "orttrainer bfloat16, products on torch": ("orttrainer", {**BFLOAT16, "utils": {"bfloat16_matmul_kernels": "torch"}}),
}  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="HF GPT-2 6x d512 vocab 8000 seq 128 (8)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", help="a JSON file to write the medians and every step time to")
    arguments = parser.parse_args()
    workloads = bench._workloads("full")
    (index,) = [index for index, workload in enumerate(workloads) if arguments.workload.lower() in workload.name.lower()]
    results = bench.measure(index, workloads[index], arguments.rounds, arguments.steps, warmup=2, suite="full", env={},
                            contenders=CONTENDERS)  # fmt: skip
    print(f"{workloads[index].name}, {torch.get_num_threads()} threads, {arguments.rounds} rounds x {arguments.steps} steps")
    print("| contender | median step (s) | peak RSS (MB) |\n|---|---|---|")
    for name, result in results.items():
        if "error" in result:
            print(f"| {name} | {result['error']} | |")
        else:
            print(f"| {name} | {statistics.median(result['durations']):.3f} | {result['peak_rss_mb']:.0f} |")
    if arguments.out:
        Path(arguments.out).write_text(json.dumps({"workload": workloads[index].name, "results": results}, indent=1))


if __name__ == "__main__":
    main()
