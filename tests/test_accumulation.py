"""Gradient accumulation: N micro-batches equal one step on their concatenation; legacy counters."""

import copy

import pytest
import torch
import torch.nn.functional as F
from models import MLP, Encoder, lm_loss, mlp_batch, token_batch
from parity import assert_close_state, cpu_options

from orttrainer import ORTTrainer, optim

N = 4


@pytest.mark.parametrize("model_name", ["mlp", "transformer"])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_accumulated_micro_batches_equal_one_big_batch(model_name, kind):
    make, loss_fn, make_batch, batch_size = {
        "mlp": (MLP, F.cross_entropy, mlp_batch, 4),
        "transformer": (lambda: Encoder(dropout=0.0), lm_loss, token_batch, 2),
    }[model_name]
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    if kind == "sgd":
        config, optimizer = optim.SGDConfig(lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    else:
        config = optim.AdamConfig(lr=1e-3, epsilon=1e-4)
        optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-4, weight_decay=0.0)
    options = cpu_options({"batch": {"gradient_accumulation_steps": N}, "utils": {"grad_norm_clip": False}})
    trainer = ORTTrainer(model, None, config, loss_fn=loss_fn, options=options)
    generator = torch.Generator().manual_seed(3)
    info = trainer._train_step_info
    for window in range(3):
        micro_batches = [make_batch(batch=batch_size, generator=generator) for _ in range(N)]
        for index, micro in enumerate(micro_batches, 1):
            loss = trainer.train_step(*micro)[0]
            with torch.no_grad():
                own_loss = loss_fn(reference(micro[0]), micro[1])
            if index < N:  # before the update the reference still has this window's weights
                torch.testing.assert_close(loss, own_loss, atol=1e-5, rtol=1e-5)
            assert (info.step, info.optimization_step) == (window * N + index, window + (index == N))
        inputs, labels = (torch.cat(parts) for parts in zip(*micro_batches))
        optimizer.zero_grad()
        loss_fn(reference(inputs), labels).backward()
        optimizer.step()
        assert_close_state(trainer, reference, step=window)


def test_weights_do_not_move_until_the_window_closes():
    torch.manual_seed(0)
    trainer = ORTTrainer(MLP(), None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy,
                         options=cpu_options({"batch": {"gradient_accumulation_steps": 3}}))
    trainer.train_step(*mlp_batch())
    first = trainer.state_dict(pytorch_format=True)
    trainer.train_step(*mlp_batch())
    for name, tensor in trainer.state_dict(pytorch_format=True).items():
        assert torch.equal(tensor, first[name])
    trainer.train_step(*mlp_batch())
    assert not torch.equal(trainer.state_dict(pytorch_format=True)["fc1.weight"], first["fc1.weight"])


def test_warmup_schedule_counts_completed_updates():
    """With accumulation, lr is computed from optimization_step: 0 until the first update lands."""
    scheduler = optim.LinearWarmupLRScheduler(10, warmup=0.5)
    trainer = ORTTrainer(MLP(), None, optim.SGDConfig(lr=1.0), loss_fn=F.cross_entropy,
                         options=cpu_options({"batch": {"gradient_accumulation_steps": 2}, "lr_scheduler": scheduler}))
    seen = []
    for _ in range(6):
        trainer.train_step(*mlp_batch())
        seen.append(scheduler.get_last_lr()[0])
    assert seen == pytest.approx([0, 0, 0.2, 0.2, 0.4, 0.4])


def test_accumulation_steps_changed_inside_a_window_is_refused_and_changed_where_windows_meet_trains_like_torch():
    """Windows are the steps' multiples of gradient_accumulation_steps; changed elsewhere (2 -> 4 after step 2), the
    new window re-summed the gradients of the update already applied, without a word. Changed after step 4, a multiple
    of both, the next window is 4 micro-batches, as a torch loop that changes its window there."""
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy,
                         options=cpu_options({"batch": {"gradient_accumulation_steps": 2}}))  # fmt: skip
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(0)
    batches = [mlp_batch(generator=generator) for _ in range(8)]
    for step, (x, label) in enumerate(batches, 1):
        if step == 3:
            trainer.options.batch.gradient_accumulation_steps = 4
            with pytest.raises(ValueError, match=r"changed from 2 to 4 at train_step 3: .* \(the next: step 4\)"):
                trainer.train_step(x, label)
            trainer.options.batch.gradient_accumulation_steps = 2
        if step == 5:
            trainer.options.batch.gradient_accumulation_steps = 4
        window = 2 if step <= 4 else 4
        trainer.train_step(x, label)
        (F.cross_entropy(reference(x), label) / window).backward()
        if step % window == 0:
            optimizer.step()
            optimizer.zero_grad()
    assert trainer._train_step_info.optimization_step == 3
    assert_close_state(trainer, reference)
