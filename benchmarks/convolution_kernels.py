"""Where a CNN's convolutions should run: torch eager against orttrainer with each `utils.convolution_kernels`.

    python benchmarks/convolution_kernels.py [--only resnet,lenet] [--rounds 6]

Each contender in its own process, rounds interleaved (bench.measure), tuned malloc. Prints
ms per train step (median [min]) and the speed relative to eager; NOTES.md §18 holds the runs.
"""

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench import TUNED_MALLOC, measure  # noqa: E402
from workloads import WORKLOADS  # noqa: E402

CNNS = ["LeNet", "ResNet", "MobileNet"]
CHOICES = ["onnxruntime", "torch", "auto"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(CNNS), help="comma-separated substrings of the workload names")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10, help="steps per round")
    args = parser.parse_args()
    chosen = [name.strip().lower() for name in args.only.split(",") if name.strip()]
    contenders = {"torch eager": ("torch eager", None)}
    contenders |= {f"orttrainer, {choice}": ("orttrainer", {"utils": {"convolution_kernels": choice}}) for choice in CHOICES}
    for index, workload in enumerate(WORKLOADS):
        if not any(name in workload.name.lower() for name in chosen):
            continue
        results = measure(index, workload, args.rounds, args.steps, 5, "full", TUNED_MALLOC, contenders)
        eager = statistics.median(results["torch eager"]["durations"])
        print(workload.name)
        for label, result in results.items():
            if "error" in result:
                print(f"  {label:26s} fails: {result['error']}")
                continue
            median = statistics.median(result["durations"])
            print(f"  {label:26s} {median * 1e3:7.1f} ms [{min(result['durations']) * 1e3:.1f}]  speed {eager / median:.2f}x eager, "
                  f"peak RSS {result['peak_rss_mb']:.0f} MB")


if __name__ == "__main__":
    main()
