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
