"""Train-step speed and memory: orttrainer against the other ways to train the same model.

Contenders (same model definition, initial weights, batches and AdamW hyper-parameters):
torch eager, torch.compile, orttrainer, ONNX Runtime's on-device training API, ORTModule.
Each contender runs in its own worker process (so its peak RSS is its own); the parent
interleaves timing rounds across workers so that machine noise hits all alike. Warm-up
includes backward. A GEMM ceiling measured in the same run puts GFLOP/s in context.

    python benchmarks/bench.py            # full run, writes benchmarks/results/bench.{json,md,png}
    python benchmarks/bench.py --quick    # seconds; what CI runs (checks it works, not timings)
    python benchmarks/bench.py --only resnet,gpt --rounds 3   # some workloads, fewer rounds
    python benchmarks/bench.py --zoo      # the test zoo's models, eager and orttrainer: results/zoo.{json,md,png}
"""

import argparse
import json
import multiprocessing
import os
import platform
import resource
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from on_device import on_device_training  # noqa: E402
from workloads import BFLOAT16_WORKLOADS, WORKLOADS, Workload, train_on, zoo_workloads  # noqa: E402

CONTENDERS = ["torch eager", "torch.compile", "orttrainer", "on-device ORT API", "ORTModule"]
ADAMW = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
TUNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "1073741824"}
RESULTS = Path(__file__).parent / "results"


def _tiny_workload():
    import torch.nn as nn
    import torch.nn.functional as F

    return Workload("1-element model (overhead)", lambda: nn.Linear(1, 1), F.mse_loss,
                    lambda g: (torch.randn(1, 1, generator=g), torch.randn(1, 1, generator=g)))


# ------------------------------------------------------------------------ contenders
class _Timed:
    """Wraps a callable and keeps the durations of its calls."""

    def __init__(self, function):
        self.function, self.durations = function, []

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        result = self.function(*args, **kwargs)
        self.durations.append(time.perf_counter() - start)
        return result


def _loss(forward, workload, batch):
    """The workload's loss of ``batch``: its loss_fn on the output, or, for a batch of keywords
    (a Hugging Face model's, labels included), the loss the model returns."""
    if isinstance(batch, dict):
        return forward(**batch).loss
    return workload.loss_fn(forward(*batch[:-1]), batch[-1])


def _torch_step(model, workload, compiled, autocast=False):
    """``autocast``: forward and loss under torch.autocast("cpu", dtype=torch.bfloat16)."""
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    forward = torch.compile(model) if compiled else model
    timed_update = _Timed(optimizer.step)

    def step(batch):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = _loss(forward, workload, batch)
        loss.backward()
        timed_update()

    return step, timed_update


def _orttrainer_step(model, workload, options=None):
    """``options``: orttrainer options on top of the benchmark's (e.g. {"utils": {"convolution_kernels": ...}})."""
    from orttrainer import ORTTrainer, ORTTrainerOptions, optim

    config = optim.AdamConfig(lr=ADAMW["lr"], alpha=ADAMW["betas"][0], beta=ADAMW["betas"][1], epsilon=ADAMW["eps"],
                              lambda_coef=ADAMW["weight_decay"])
    given = options or {}
    settings = {**given, "device": {"id": "cpu"}, "utils": {"grad_norm_clip": False, **given.get("utils", {})}}
    trainer = ORTTrainer(model, None, config, loss_fn=workload.loss_fn, options=ORTTrainerOptions(settings))
    timed = {}

    def step(batch):
        train_on(trainer, batch)
        if not timed:  # the optimizer exists after the first step
            timed["update"] = trainer._optimizer.step = _Timed(trainer._optimizer.step)

    class _Update:
        @property
        def durations(self):
            return timed["update"].durations if timed else []

    return step, _Update()


def _on_device_step(model, workload, batch):
    """ONNX Runtime's on-device training API with its own loss block (as its users would)."""
    import io

    import onnx
    from onnxruntime.training import artifacts

    class TwoDimensional(torch.nn.Module):
        """The on-device loss blocks take [N, C] logits (and [N] labels)."""

        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *inputs):
            output = self.model(*inputs)
            return output.reshape(-1, output.shape[-1])

    classification = workload.loss_fn is not torch.nn.functional.mse_loss
    buffer = io.BytesIO()
    torch.onnx.export(TwoDimensional(), tuple(batch[:-1]), buffer, dynamo=False, opset_version=17,
                      do_constant_folding=False, training=torch.onnx.TrainingMode.TRAINING,
                      input_names=[f"input{i}" for i in range(len(batch) - 1)], output_names=["output"])
    exported = onnx.load_from_string(buffer.getvalue())
    names = {init.name for init in exported.graph.initializer}
    requires_grad = [f"model.{name}" for name, _ in model.named_parameters() if f"model.{name}" in names]
    loss = artifacts.LossType.CrossEntropyLoss if classification else artifacts.LossType.MSELoss
    module, optimizer = on_device_training(exported, requires_grad, loss)
    optimizer.set_learning_rate(ADAMW["lr"])
    timed_update = _Timed(optimizer.step)

    def step(batch):
        *inputs, label = (tensor.numpy() for tensor in batch)
        module(*inputs, label.reshape(-1) if classification else label)
        timed_update()
        module.lazy_reset_grad()

    return step, timed_update


def _ortmodule_step(model, workload):
    from onnxruntime.training.ortmodule import ORTModule  # fails with torch 2.13: reported as such

    return _torch_step(ORTModule(model), workload, compiled=False)


def _make_step(contender, workload, batch, options=None):
    torch.manual_seed(0)
    model = workload.make_model()
    if contender == "torch eager":
        return _torch_step(model, workload, compiled=False)
    if contender == "torch.compile":
        return _torch_step(model, workload, compiled=True)
    if contender == "torch autocast bfloat16":
        return _torch_step(model, workload, compiled=False, autocast=True)
    if contender == "orttrainer":
        return _orttrainer_step(model, workload, options)
    if contender == "on-device ORT API":
        return _on_device_step(model, workload, batch)
    return _ortmodule_step(model, workload)


# ---------------------------------------------------------------------------- worker
def _worker(connection, workload_index, contender, warmup, suite, options=None):
    """Build one contender, warm it up, then time rounds on request; report peak RSS last."""
    import warnings

    # the contenders' import and export notices (TorchScript exporter deprecation, ONNX Runtime's
    # training-API notices) would interleave with the timing table; orttrainer's own export still
    # turns the warnings that matter into errors
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    import onnxruntime

    onnxruntime.set_default_logger_severity(3)
    workload = _workloads(suite)[workload_index]
    generator = torch.Generator().manual_seed(0)
    batches = [workload.make_batch(generator) for _ in range(4)]
    stderr = os.dup(2)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # graph builders log every transformer at INFO level
    try:
        step, update = _make_step(contender, workload, batches[0], options)
        for index in range(warmup):
            step(batches[index % len(batches)])
    except Exception as error:  # a contender that cannot run this model is reported, not fatal
        connection.send({"error": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"})
        return
    finally:
        os.dup2(stderr, 2)
    connection.send({"ready": True})
    index = 0
    while True:
        request = connection.recv()
        if request == "done":
            break
        durations, updates_before = [], len(update.durations)
        for _ in range(request):
            start = time.perf_counter()
            step(batches[index % len(batches)])
            durations.append(time.perf_counter() - start)
            index += 1
        connection.send({"durations": durations, "updates": update.durations[updates_before:]})
    connection.send({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})


SUITES = ("full", "quick", "zoo", "bfloat16")


def _workloads(suite):
    """The workloads of a suite: "full" (workloads.py and the 1-element model), "quick" (two of
    them, for CI), "zoo" (the test zoo's models), "bfloat16" (benchmarks/bfloat16.py's)."""
    if suite == "quick":
        return [WORKLOADS[1], _tiny_workload()]
    if suite == "zoo":
        return zoo_workloads()
    if suite == "bfloat16":
        return BFLOAT16_WORKLOADS
    return WORKLOADS + [_tiny_workload()]


# ---------------------------------------------------------------------------- parent
def gemm_ceiling_gflops(size=1024, trials=7, repeats=5):
    """The best rate of a square float32 GEMM, (torch's, ONNX Runtime's), over a few trials after a warm-up."""
    from onnx import TensorProto, helper

    from orttrainer.runtime.session import TorchBoundSession, session_options

    a, b, c = torch.randn(size, size), torch.randn(size, size), torch.empty(size, size)
    square = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [size, size]) for name in "abc"]
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "gemm", square[:2], square[2:])
    session = TorchBoundSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
                                torch.device("cpu"), [("CPUExecutionProvider", {})], session_options())  # fmt: skip
    session.bind_input("a", a)
    session.bind_input("b", b)
    session.bind_output("c", c)
    rates = []
    for run in (lambda: torch.mm(a, b, out=c), session.run):
        run()
        fastest = min(_seconds(run, repeats) for _ in range(trials))
        rates.append(2 * size**3 / fastest / 1e9)
    return tuple(rates)


def _seconds(run, repeats) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - start) / repeats


def step_gflop(workload_index, suite):
    """FLOPs of one forward + backward, counted by torch on the eager model, in a process of its own:
    a spawned worker starts with the peak RSS of its parent, so the parent must stay small."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_step_gflop, (workload_index, suite))


def _step_gflop(workload_index, suite):
    from torch.utils.flop_counter import FlopCounterMode

    workload = _workloads(suite)[workload_index]
    torch.manual_seed(0)
    model = workload.make_model()
    batch = workload.make_batch(torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        _loss(model, workload, batch).backward()
    return counter.get_total_flops() / 1e9


def measure(workload_index, workload, rounds, steps, warmup, suite, env, contenders=None):
    """{label: result} for one workload of ``suite``, rounds interleaved across the workers. ``contenders``:
    {label: (contender, orttrainer options or None)}, by default every one of CONTENDERS."""
    contenders = contenders or {name: (name, None) for name in CONTENDERS if not (suite == "quick" and name == "torch.compile")}
    context = multiprocessing.get_context("spawn")
    saved = dict(os.environ)
    os.environ.update(env)
    workers = {}
    try:
        for label, (contender, options) in contenders.items():
            parent, child = context.Pipe()
            process = context.Process(target=_worker, args=(child, workload_index, contender, warmup, suite, options),
                                      daemon=True)  # fmt: skip
            process.start()
            workers[label] = (parent, process)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    results = {}
    for contender, (connection, _) in workers.items():
        message = connection.recv()
        results[contender] = {"error": message["error"]} if "error" in message else {"durations": [], "updates": []}
    for _ in range(rounds):
        for contender, (connection, _) in workers.items():
            if "error" not in results[contender]:
                connection.send(steps)
                message = connection.recv()
                results[contender]["durations"] += message["durations"]
                results[contender]["updates"] += message["updates"]
    for contender, (connection, process) in workers.items():
        if "error" not in results[contender]:
            connection.send("done")
            results[contender]["peak_rss_mb"] = connection.recv()["peak_rss_mb"]
        process.join(timeout=60)
    return results


def summarize(results, gflop):
    eager = results.get("torch eager", {})
    eager_median = statistics.median(eager["durations"]) if eager.get("durations") else None
    summary = {}
    for contender, result in results.items():
        if "error" in result:
            summary[contender] = {"error": result["error"]}
            continue
        times = [duration * 1e3 for duration in result["durations"]]
        median = statistics.median(times)
        entry = {"median_ms": median, "min_ms": min(times), "max_ms": max(times), "peak_rss_mb": result["peak_rss_mb"],
                 "gflops": gflop / (median / 1e3) if gflop else None}
        if eager_median:
            entry["vs_eager"] = median / (eager_median * 1e3)
        if result["updates"]:
            entry["optimizer_ms"] = statistics.median(result["updates"]) * 1e3
        summary[contender] = entry
    return summary


def _contenders_in(report):
    """The CONTENDERS measured in ``report``, in CONTENDERS' order."""
    measured = {contender for workloads in report["variants"].values() for summary in workloads.values() for contender in summary}
    return [contender for contender in CONTENDERS if contender in measured]


def markdown(report):
    torch_gemm, onnxruntime_gemm = report["gemm_gflops"]
    contenders = _contenders_in(report)
    lines = [f"Measured {report['date']} on {report['machine']}, {report['threads']} torch threads; "
             f"GEMM ceiling (1024x1024x1024 float32, best of 7) torch {torch_gemm:.0f}, ONNX Runtime "
             f"{onnxruntime_gemm:.0f} GFLOP/s. ms per train step (forward, backward, AdamW): "
             "median [min-max], ratio to eager, optimizer ms, peak RSS MB, achieved GFLOP/s."]
    for variant, workloads in report["variants"].items():
        lines += ["", f"**{variant}**", "", "| workload | " + " | ".join(contenders) + " |", "|---" * (len(contenders) + 1) + "|"]
        for workload, summary in workloads.items():
            cells = []
            for contender in contenders:
                entry = summary.get(contender)
                if entry is None:
                    cells.append("not run")
                elif "error" in entry:
                    cells.append("fails: " + entry["error"].split(":")[0])
                else:
                    ratio = f" ({entry['vs_eager']:.2f}x)" if "vs_eager" in entry else ""
                    optimizer = f", opt {entry['optimizer_ms']:.1f}" if "optimizer_ms" in entry else ""
                    gflops = f", {entry['gflops']:.0f} GF/s" if entry.get("gflops") else ""
                    cells.append(f"{entry['median_ms']:.2f} [{entry['min_ms']:.1f}-{entry['max_ms']:.1f}]{ratio}{optimizer}, "
                                 f"{entry['peak_rss_mb']:.0f} MB{gflops}")
            lines.append(f"| {workload} | " + " | ".join(cells) + " |")
    errors = {entry["error"] for workloads in report["variants"].values() for summary in workloads.values()
              for entry in summary.values() if "error" in entry}
    if errors:
        lines += ["", "Failures: " + "; ".join(sorted(errors))]
    return "\n".join(lines)


_CHART_LIMIT = 3.0  # ratios to eager drawn up to this; longer bars are cut and labelled


def bar_chart(report, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # the tuned allocator's run where there is one: the default one's eager steps swing with page faults
    variant = next((name for name in report["variants"] if name.startswith("tuned")), next(iter(report["variants"])))
    workloads = report["variants"][variant]
    names = [name for name in workloads if "overhead" not in name]
    contenders = _contenders_in(report)
    figure, axes = plt.subplots(figsize=(9, 1.5 + 0.3 * len(names) * max(1, len(contenders) / 2)))
    height = 0.8 / len(contenders)
    for index, contender in enumerate(contenders):
        ratios = [workloads[name].get(contender, {}).get("vs_eager", 0) for name in names]
        positions = [i + index * height for i in range(len(names))]
        axes.barh(positions, [min(ratio, _CHART_LIMIT) for ratio in ratios], height, label=contender)
        for position, ratio in zip(positions, ratios):
            if ratio > _CHART_LIMIT:  # a bar cut at the limit says how long it is
                axes.text(_CHART_LIMIT, position, f" {ratio:.1f}x", va="center", fontsize=7)
    axes.axvline(1.0, color="gray", linestyle="--")
    axes.set_xlim(0, _CHART_LIMIT * 1.1)
    axes.set_yticks([i + 0.4 - height / 2 for i in range(len(names))], names, fontsize=8)
    axes.invert_yaxis()  # the table's order, top to bottom
    axes.set_xlabel("step time / torch eager (lower is faster)")
    axes.set_title(variant.split(" (")[0])  # the malloc settings are in the table
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _cpu_model():
    """The CPU's model name (the two kinds of host this runs on differ), else the architecture."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small workloads, few steps, no torch.compile (for CI)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="steps per round")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--only", default="", help="comma-separated substrings of the workload names to run (default: all)")
    parser.add_argument("--zoo", action="store_true", help="the test zoo's models, torch eager against orttrainer, tuned malloc")
    args = parser.parse_args()
    chosen = [name.strip().lower() for name in args.only.split(",") if name.strip()]
    suite = "quick" if args.quick else "zoo" if args.zoo else "full"
    rounds, steps, warmup = (2, 3, 2) if args.quick else (args.rounds, args.steps, 5)
    tuned = {"tuned malloc (" + " ".join(f"{k}={v}" for k, v in TUNED_MALLOC.items()) + ")": TUNED_MALLOC}
    variants = {"quick": {"default malloc": {}}, "zoo": tuned, "full": {"default malloc": {}, **tuned}}[suite]
    contenders = {name: (name, None) for name in ("torch eager", "orttrainer")} if args.zoo else None
    report = {"date": date.today().isoformat(), "machine": f"{_cpu_model()}, {os.cpu_count()} cores",
              "threads": torch.get_num_threads(), "gemm_gflops": gemm_ceiling_gflops(), "variants": {}}
    for variant, env in variants.items():
        report["variants"][variant] = {}
        for index, workload in enumerate(_workloads(suite)):
            if chosen and not any(name in workload.name.lower() for name in chosen):
                continue
            print(f"{variant}: {workload.name} ...", flush=True)
            results = measure(index, workload, rounds, steps, warmup, suite, env, contenders)
            report["variants"][variant][workload.name] = summarize(results, step_gflop(index, suite))
    table = markdown(report)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "zoo" if args.zoo else "bench"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    (args.out / f"{stem}.md").write_text(table + "\n")
    bar_chart(report, args.out / f"{stem}.png")


if __name__ == "__main__":
    main()
