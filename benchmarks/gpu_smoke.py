"""GPU smoke test: orttrainer and torch side by side on a CUDA GPU (docs/gpu.md).

Trains tests/models.py's MLP, transformer encoder and CNN (with BatchNorm) a few AdamW
steps with orttrainer and with plain torch, from the same weights on the same batches:

- fp32 (TF32 off on both sides): every step's loss and every final weight must match;
- AMP float16 with dynamic loss scaling: the same within a looser tolerance (orttrainer
  runs the whole graph in float16 with float32 master weights, torch's autocast only
  the ops it picks);

and prints ms/step and peak GPU memory for both. Exits 1 on any mismatch or error (a
session that fell back to the CPU is an error), 0 otherwise; on a machine without a CUDA
GPU it says so and exits 0.

    python benchmarks/gpu_smoke.py [--steps 10]
"""

import argparse
import copy
import gc
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from models import CNN, MLP, SEQ, VOCAB, Encoder, lm_loss  # noqa: E402

LR, WEIGHT_DECAY, INITIAL_LOSS_SCALE = 1e-3, 0.01, 2.0**10  # a scale that does not overflow these models' float16 gradients
# Adam turns any gradient into a step of about LR, also the rounding noise of gradients that are zero in exact
# arithmetic (a bias before BatchNorm, attention's key bias), where two correct implementations then differ by LR
# per step. An epsilon above that noise keeps such steps small; the update is still Adam's fused kernel.
EPSILON = 1e-3
WARMUP_STEPS = 2  # orttrainer's first step exports the model and builds the sessions


@dataclass(frozen=True)
class Tolerance:
    """How far orttrainer may be from torch at one precision."""

    loss: float  # relative, every step
    change: float  # L2 norm of (orttrainer's weight - torch's), relative to torch's change of that weight
    floor: float  # ... plus this RMS per element: weights whose gradient is zero in exact arithmetic hardly move


TOLERANCE = {"fp32": Tolerance(loss=1e-3, change=1e-2, floor=1e-5), "amp fp16": Tolerance(loss=1e-2, change=5e-2, floor=1e-4)}


@dataclass
class Case:
    name: str
    make_model: Callable
    loss_fn: Callable
    make_batch: Callable  # generator -> (inputs..., label), on the CPU


CASES = [
    Case("MLP 32-64-64-10 (64)", MLP, F.cross_entropy,
         lambda g: (torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,), generator=g))),
    Case(f"encoder d32 seq{SEQ} (16)", Encoder, lm_loss,
         lambda g: (torch.randint(0, VOCAB, (16, SEQ), generator=g), torch.randint(0, VOCAB, (16, SEQ), generator=g))),
    Case("CNN+BatchNorm 1x16x16 (32)", CNN, F.cross_entropy,
         lambda g: (torch.randn(32, 1, 16, 16, generator=g), torch.randint(0, 10, (32,), generator=g))),
]  # fmt: skip


@dataclass
class Run:
    losses: list = field(default_factory=list)
    state: dict = field(default_factory=dict)
    ms_per_step: float = math.nan
    peak_mb: float = math.nan
    error: str = ""


def device_memory_used() -> int:
    """Bytes in use on the GPU as the driver sees them: torch's caching allocator and ONNX Runtime's arena alike."""
    free, total = torch.cuda.mem_get_info()
    return total - free


def run_steps(step, batches, timed_steps: int, baseline: int, run: Run) -> None:
    """Call ``step`` on every batch; time the last ``timed_steps``; peak memory above ``baseline``."""
    peak = baseline
    for index, batch in enumerate(batches):
        if index == len(batches) - timed_steps:
            torch.cuda.synchronize()
            start = time.perf_counter()
        run.losses.append(step(batch))
        peak = max(peak, device_memory_used())
    torch.cuda.synchronize()
    run.ms_per_step = (time.perf_counter() - start) * 1000 / timed_steps
    run.peak_mb = (peak - baseline) / 2**20
    run.losses = [float(loss) for loss in run.losses]


def fresh_baseline() -> int:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    return device_memory_used()


def train_torch(model, case: Case, amp: bool, batches, timed_steps: int) -> Run:
    """The reference: torch AdamW, autocast float16 + GradScaler for AMP."""
    run, baseline = Run(), fresh_baseline()
    model = copy.deepcopy(model).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, eps=EPSILON)
    scaler = torch.amp.GradScaler("cuda", init_scale=INITIAL_LOSS_SCALE, enabled=amp)

    def step(batch):
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            loss = case.loss_fn(model(*batch[:-1]), batch[-1])
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    run_steps(step, batches, timed_steps, baseline, run)
    run.state = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    return run


def train_orttrainer(model, case: Case, amp: bool, batches, timed_steps: int) -> Run:
    """orttrainer with the same AdamW; fp32 with ONNX Runtime's TF32 off, like torch's."""
    from orttrainer import ORTTrainer, ORTTrainerOptions
    from orttrainer import amp as ort_amp
    from orttrainer import optim

    run, baseline = Run(), fresh_baseline()
    device = torch.cuda.current_device()
    options = {"device": {"id": f"cuda:{device}"}, "utils": {"grad_norm_clip": False}}
    if amp:
        options["mixed_precision"] = {"enabled": True, "loss_scaler": ort_amp.DynamicLossScaler(loss_scale=INITIAL_LOSS_SCALE)}
    else:
        options["provider_options"] = {"CUDAExecutionProvider": {"device_id": str(device), "use_tf32": "0"}}
    config = optim.AdamConfig(lr=LR, lambda_coef=WEIGHT_DECAY, epsilon=EPSILON)
    trainer = ORTTrainer(copy.deepcopy(model), None, config, loss_fn=case.loss_fn, options=ORTTrainerOptions(options))

    def step(batch):
        outputs = trainer.train_step(*batch)
        return outputs[0] if isinstance(outputs, list) else outputs

    run_steps(step, batches, timed_steps, baseline, run)
    run.state = trainer.state_dict(pytorch_format=True)
    return run


def loss_mismatches(reference: Run, candidate: Run, tolerance: Tolerance) -> list:
    found = []
    for step, (expected, actual) in enumerate(zip(reference.losses, candidate.losses), 1):
        if not math.isfinite(actual) or abs(actual - expected) > tolerance.loss * abs(expected):
            found.append(f"loss at step {step}: orttrainer {actual:.6g}, torch {expected:.6g}")
    return found


def state_mismatches(reference: Run, candidate: Run, initial: dict, tolerance: Tolerance) -> list:
    """Weights and buffers whose change from ``initial`` differs from torch's change.

    Measured against the change, not the weight: a few steps move weights little, so a
    wrong update (a missed step, a 10% wrong learning rate) would hide in the weight itself.
    """
    found = []
    for name, expected in reference.state.items():
        actual = candidate.state.get(name)
        if actual is None:
            found.append(f"{name}: missing from orttrainer's state_dict")
            continue
        expected, actual = expected.double(), actual.double()
        moved = (expected - initial[name].double()).norm()
        difference = (actual - expected).norm()
        if not difference <= tolerance.change * moved + tolerance.floor * math.sqrt(expected.numel()):
            found.append(f"{name}: differs from torch's by {float(difference / moved.clamp_min(1e-30)):.1e} of torch's change")
    return found


def attempt(train, *args) -> Run:
    """``train(*args)``, or a Run holding the error (e.g. orttrainer's ProviderFallbackError on a CPU fallback)."""
    try:
        return train(*args)
    except Exception as error:  # any failure is reported in the table and fails the smoke test
        return Run(error=f"{type(error).__name__}: {error}")


def compare(case: Case, precision: str, steps: int) -> dict:
    torch.manual_seed(0)
    model = case.make_model()
    initial = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    generator = torch.Generator().manual_seed(1)
    batches = [tuple(t.cuda() for t in case.make_batch(generator)) for _ in range(WARMUP_STEPS + steps)]
    amp = precision != "fp32"
    reference = attempt(train_torch, model, case, amp, batches, steps)
    candidate = attempt(train_orttrainer, model, case, amp, batches, steps)
    problems = [f"{who}: {run.error}" for who, run in (("torch", reference), ("orttrainer", candidate)) if run.error]
    if not problems:
        tolerance = TOLERANCE[precision]
        problems = loss_mismatches(reference, candidate, tolerance) + state_mismatches(reference, candidate, initial, tolerance)
    return {"case": case.name, "precision": precision, "torch": reference, "orttrainer": candidate, "problems": problems}


def report(results) -> None:
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__} (CUDA {torch.version.cuda})")
    print("| workload | precision | torch ms/step | orttrainer ms/step | torch peak MB | orttrainer peak MB | parity |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        parity = "ok" if not r["problems"] else f"FAIL ({len(r['problems'])})"
        print(f"| {r['case']} | {r['precision']} | {r['torch'].ms_per_step:.2f} | {r['orttrainer'].ms_per_step:.2f} | "
              f"{r['torch'].peak_mb:.0f} | {r['orttrainer'].peak_mb:.0f} | {parity} |")  # fmt: skip
    for r in results:
        for problem in r["problems"][:10]:
            print(f"{r['case']}, {r['precision']}: {problem}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run (after the warm-up steps)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"no CUDA GPU visible to torch {torch.__version__} (CUDA build: {torch.version.cuda}): nothing to check")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 parity; orttrainer's: use_tf32=0
    results = [compare(case, precision, args.steps) for case in CASES for precision in TOLERANCE]
    report(results)
    return 1 if any(r["problems"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
