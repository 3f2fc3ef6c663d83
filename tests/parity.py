"""Train the same model with orttrainer and with a plain torch loop and compare step by step."""

import copy

import torch

from orttrainer import ORTTrainer, ORTTrainerOptions


def cpu_options(extra=None):
    options = {"device": {"id": "cpu"}}
    for key, value in (extra or {}).items():
        options[key] = value
    return ORTTrainerOptions(options)


def assert_close_state(trainer, reference: torch.nn.Module, atol=1e-5, rtol=1e-5, step=None):
    """The trainer's state_dict has exactly the torch module's keys, every value equal (NaN where torch's is)."""
    trained = trainer.state_dict(pytorch_format=True)
    expected = reference.state_dict()
    assert set(trained) == set(expected), f"missing {set(expected) - set(trained)}, unexpected {set(trained) - set(expected)}"
    for name, tensor in trained.items():
        torch.testing.assert_close(
            tensor, expected[name], atol=atol, rtol=rtol, equal_nan=True, msg=lambda m: f"step {step}, '{name}': {m}"
        )


def run_parity(model, batches, optim_config, torch_optimizer, loss_fn=None, options=None, model_desc=None,
               reference_loss=None, atol=1e-5):
    """Train ``model`` with ORTTrainer and a deep copy with ``torch_optimizer``; compare every step (a NaN
    loss or weight must be NaN on both sides).

    ``reference_loss(module, batch)`` computes the torch loss (default: loss_fn on the output).
    Returns the trainer and the reference module.
    """
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, model_desc, optim_config, loss_fn=loss_fn, options=options or cpu_options())
    optimizer = torch_optimizer(reference.parameters())
    for step, batch in enumerate(batches, 1):
        step_both(trainer, reference, optimizer, batch, step, loss_fn, reference_loss, atol)
    return trainer, reference


def step_both(trainer, reference, optimizer, batch, step, loss_fn, reference_loss=None, atol=1e-5):
    """One train_step, and one step of a torch loop with ``optimizer`` over ``reference``, on ``batch``: the same loss
    and state_dict after it."""
    outputs = trainer.train_step(*batch)
    ort_loss = outputs[0] if isinstance(outputs, list) else outputs
    optimizer.zero_grad()
    loss = loss_fn(reference(*batch[:-1]), batch[-1]) if reference_loss is None else reference_loss(reference, batch)
    loss.backward()
    optimizer.step()
    torch.testing.assert_close(ort_loss, loss.detach(), atol=atol, rtol=1e-5, equal_nan=True,
                               msg=lambda m: f"loss at step {step}: {m}")  # fmt: skip
    assert_close_state(trainer, reference, atol=atol, step=step)
