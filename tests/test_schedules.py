"""Learning-rate schedulers: legacy values, positional order, and their effect through train_step."""

import copy

import pytest
import torch
import torch.nn.functional as F
from models import MLP, mlp_batch
from parity import assert_close_state, cpu_options

from orttrainer import ORTTrainer, TrainStepInfo, optim

# Values of the legacy upstream tests: T=10, base lr 1, optimization_step 0..9.
LEGACY_VALUES = [
    (lambda: optim.ConstantWarmupLRScheduler(10, warmup=0.5), [0, 0.2, 0.4, 0.6, 0.8, 1, 1, 1, 1, 1]),
    (lambda: optim.LinearWarmupLRScheduler(10, warmup=0.5), [0, 0.2, 0.4, 0.6, 0.8, 1, 0.8, 0.6, 0.4, 0.2]),
    (lambda: optim.CosineWarmupLRScheduler(10, warmup=0.5),
     [0, 0.2, 0.4, 0.6, 0.8, 1, 0.9045084971874737, 0.6545084971874737, 0.34549150281252633, 0.09549150281252633]),
    (lambda: optim.PolyWarmupLRScheduler(10, warmup=0.5),
     [0, 0.2, 0.4, 0.6, 0.8, 1, 0.80000002, 0.60000004, 0.40000006, 0.20000008]),
    (lambda: optim.ConstantWarmupLRScheduler(10, 0.5), [0, 0.2, 0.4, 0.6, 0.8, 1, 1, 1, 1, 1]),
    (lambda: optim.LinearWarmupLRScheduler(10, 0.5), [0, 0.2, 0.4, 0.6, 0.8, 1, 0.8, 0.6, 0.4, 0.2]),
    # positional: cosine's second argument is cycles, poly's is lr_end (warmup stays 0.002)
    (lambda: optim.CosineWarmupLRScheduler(10, 0.5), [0, 0.9763960957919413, 0.9059835861602854, 0.7956724530494731]),
    (lambda: optim.PolyWarmupLRScheduler(10, 0.5), [0, 0.9509018036072144, 0.9008016032064128, 0.8507014028056112]),
]


@pytest.mark.parametrize("make, expected", LEGACY_VALUES)
def test_legacy_values_at_every_step(make, expected):
    scheduler = make()
    config = optim.SGDConfig(lr=1.0)
    for step, value in enumerate(expected):
        lr = scheduler._step(TrainStepInfo(config, optimization_step=step))
        assert lr == pytest.approx([value], rel=1e-6, abs=1e-7), f"step {step}"
        assert scheduler.get_last_lr() == lr


def test_poly_after_total_steps_is_lr_end():
    scheduler = optim.PolyWarmupLRScheduler(10, lr_end=0.1, power=2.0, warmup=0.2)
    assert scheduler._step(TrainStepInfo(optim.SGDConfig(lr=0.5), optimization_step=12)) == pytest.approx([0.1])


@pytest.mark.parametrize(
    "build, error, message",
    [
        (lambda: optim.LinearWarmupLRScheduler(0), ValueError,
         r"'total_steps' must be a strict positive number, got int 0\. Pass the number of optimizer updates to LinearWarmupLRScheduler"),
        (lambda: optim.ConstantWarmupLRScheduler(100.0), TypeError, r"'total_steps' must be a strict positive number, got float 100.0"),
        (lambda: optim.LinearWarmupLRScheduler(10, 1), TypeError,
         r"'warmup' must be a float between \[0, 1\), got int 1\. Pass the warmup as a fraction of total_steps"),
        (lambda: optim.LinearWarmupLRScheduler(10, 1.0), ValueError, r"'warmup' must be a float between \[0, 1\), got float 1.0"),
        (lambda: optim.CosineWarmupLRScheduler(10, cycles=-1.0), ValueError, r"'cycles' must be a positive float, got float -1.0\. Pass"),
        (lambda: optim.CosineWarmupLRScheduler(10, cycles=1), TypeError, r"'cycles' must be a positive float, got int 1"),
        (lambda: optim.PolyWarmupLRScheduler(10, power=-1.0), ValueError, r"'power' must be a float >= 0, got float -1.0\. Pass the decay"),
        (lambda: optim.PolyWarmupLRScheduler(10, lr_end=0), TypeError,
         r"'lr_end' must be a float >= 0, got int 0\. Pass the final learning rate as a float"),
    ],
)
def test_argument_checks(build, error, message):
    with pytest.raises(error, match=message):
        build()


def test_poly_lr_end_above_the_base_lr_is_a_value_error():
    scheduler = optim.PolyWarmupLRScheduler(10, lr_end=0.5)
    with pytest.raises(ValueError, match=r"lr_end \(0.5\) must be smaller than the base lr \(0.1\).* Pass a smaller lr_end"):
        scheduler._step(TrainStepInfo(optim.SGDConfig(lr=0.1)))


class HalvingScheduler(optim._LRScheduler):
    """A custom schedule: halve the base lr after every update."""

    def get_lr(self, train_step_info):
        return [train_step_info.optimizer_config.lr * 0.5**train_step_info.optimization_step]


@pytest.mark.parametrize(
    "scheduler, expected",
    [
        (optim.LinearWarmupLRScheduler(8, warmup=0.25), [0, 0.05, 0.1, 0.0833333, 0.0666667, 0.05, 0.0333333, 0.0166667]),
        (HalvingScheduler(), [0.1 * 0.5**step for step in range(8)]),
    ],
)
def test_schedule_drives_train_step_like_a_torch_loop(scheduler, expected):
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy,
                         options=cpu_options({"lr_scheduler": scheduler}))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(0)
    for step, lr in enumerate(expected):
        batch = mlp_batch(generator=generator)
        trainer.train_step(*batch)
        assert scheduler.get_last_lr() == pytest.approx([lr], rel=1e-5, abs=1e-7)
        optimizer.param_groups[0]["lr"] = lr
        optimizer.zero_grad()
        F.cross_entropy(reference(batch[0]), batch[1]).backward()
        optimizer.step()
        assert_close_state(trainer, reference, step=step)
