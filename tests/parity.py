"""Train the same model with orttrainer and with a plain torch loop and compare step by step."""

import copy
from collections.abc import Mapping

import torch

from orttrainer import ORTTrainer, ORTTrainerOptions
from orttrainer.optim import SGDConfig

# Against a float64 torch run: orttrainer's value may lie K times as far from it as float32 torch's, plus a floor of
# FLOOR_ATOL + FLOOR_RTOL * |value| (a few float32 ulps, below the fixed 1e-5 of the direct comparison).
K, FLOOR_ATOL, FLOOR_RTOL = 8, 1e-6, 1e-6


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


def assert_within_float32_error(ours, torch32, float64, what):
    """``ours`` is as close to the float64 value as float32 torch is, up to a factor and a floor, element by element:
    |ours - float64| <= K * max|torch32 - float64| + FLOOR_ATOL + FLOOR_RTOL * |float64| (the maximum over the tensor:
    its elements come from one computation). NaN and infinities where torch32 has them, integers equal.

    A fixed tolerance against float32 torch holds on the CPU it was tuned on: where a computation cancels (cdist's
    product form, a variance, a norm, layer norm of shifted rows) torch's own float32 rounding moves with the kernels
    (AVX2 or AVX-512, Intel or AMD), and so does ONNX Runtime's. The float64 run measures that rounding."""
    ours, torch32, float64 = (torch.as_tensor(value).detach() for value in (ours, torch32, float64))
    if not torch32.is_floating_point():
        torch.testing.assert_close(ours, torch32, atol=0, rtol=0, msg=lambda m: f"{what}: {m}")
        return
    assert ours.shape == torch32.shape == float64.shape, f"{what}: shapes {ours.shape}, {torch32.shape}, {float64.shape}"
    ours, torch32, float64 = ours.double(), torch32.double(), float64.double()
    same = (ours.isnan() == torch32.isnan()) & (ours.isinf() == torch32.isinf()) & (~torch32.isinf() | (ours == torch32))
    assert same.all(), (f"{what}: NaN or infinity at {(~same).nonzero().tolist()} on one side only (orttrainer "
                        f"{ours[~same].tolist()}, torch {torch32[~same].tolist()})")  # fmt: skip
    finite = ours.isfinite() & torch32.isfinite() & float64.isfinite()
    ours, torch32, float64 = ours[finite], torch32[finite], float64[finite]
    if not float64.numel():
        return
    torch_error = (torch32 - float64).abs().max()
    allowed = K * torch_error + FLOOR_ATOL + FLOOR_RTOL * float64.abs()
    error = (ours - float64).abs()
    if (error <= allowed).all():
        return
    worst = int((error - allowed).argmax())
    raise AssertionError(
        f"{what}: {int((error > allowed).sum())} of {error.numel()} values further from the float64 run than allowed; "
        f"worst: {ours[worst].item()!r} against float64 {float64[worst].item()!r} (float32 torch "
        f"{torch32[worst].item()!r}): off by {error[worst].item():.3g}, allowed {allowed[worst].item():.3g} = {K} x "
        f"{torch_error.item():.3g} (float32 torch's largest distance) + {FLOOR_ATOL:g} + {FLOOR_RTOL:g} x |float64|"
    )


def assert_outputs_within_float32_error(outputs, expected, expected64, where):
    """``outputs`` has ``expected``'s class and fields, each tensor as close to ``expected64``'s as ``expected``'s is
    (assert_within_float32_error): a tuple of tensors a tuple again, a ModelOutput inside the ModelOutput (CLIP's
    text_model_output) its own class again."""
    assert type(outputs) is type(expected), f"{where} is {type(outputs).__name__}, not {type(expected).__name__}"
    if isinstance(expected, Mapping):
        assert list(outputs.keys()) == list(expected.keys()), f"{where}: fields {list(outputs.keys())}"
        for key in expected.keys():
            assert_outputs_within_float32_error(outputs[key], expected[key], expected64[key], f"{where}.{key}")
    elif isinstance(expected, tuple):
        assert len(outputs) == len(expected), f"{where}: {len(outputs)} tensors, not {len(expected)}"
        for index, (mine, theirs, theirs64) in enumerate(zip(outputs, expected, expected64)):
            assert_within_float32_error(mine, theirs, theirs64, f"{where}.{index}")
    else:
        assert_within_float32_error(outputs, expected, expected64, where)


def float64_batch(batch):
    """``batch`` (a tuple or a dict) with its floating tensors in float64, for the float64 reference."""
    if isinstance(batch, dict):
        return {key: value for key, value in zip(batch, float64_batch(tuple(batch.values())))}
    return tuple(value.double() if torch.is_tensor(value) and value.is_floating_point() else value for value in batch)


def float64_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A float64 deep copy of ``model``, for the float64 reference. transformers' default experts implementation,
    "grouped_mm", has no float64 kernel on the CPU: the copy computes the same experts in transformers' "eager" loop."""
    copied = copy.deepcopy(model).double()
    for layer in copied.modules():
        chosen = getattr(layer, "get_experts_implementation", lambda: {})()
        if "grouped_mm" in chosen.values():
            layer.set_experts_implementation({key: "eager" if value == "grouped_mm" else value
                                              for key, value in chosen.items()})  # fmt: skip
    return copied


def run_parity(model, batches, optim_config, torch_optimizer, loss_fn=None, options=None, model_desc=None,
               reference_loss=None, atol=1e-5, float64=False):
    """Train ``model`` with ORTTrainer and a deep copy with ``torch_optimizer``; compare every step (a NaN
    loss or weight must be NaN on both sides).

    ``reference_loss(module, batch)`` computes the torch loss (default: loss_fn on the output). ``float64``: the
    comparison of a computation that can be ill-conditioned, against a float64 copy trained on the same batches too
    (step_against_float64) instead of within ``atol`` of the float32 loop.
    Returns the trainer and the reference module; with ``float64``, the float64 one too.
    """
    reference = copy.deepcopy(model)
    reference64 = float64_copy(model) if float64 else None
    trainer = ORTTrainer(model, model_desc, optim_config, loss_fn=loss_fn, options=options or cpu_options())
    optimizer = torch_optimizer(reference.parameters())
    optimizer64 = torch_optimizer(reference64.parameters()) if float64 else None
    for step, batch in enumerate(batches, 1):
        if float64:
            step_against_float64(trainer, (reference, optimizer), (reference64, optimizer64), batch, step, loss_fn,
                                 reference_loss)  # fmt: skip
        else:
            step_both(trainer, reference, optimizer, batch, step, loss_fn, reference_loss, atol)
    return (trainer, reference, reference64) if float64 else (trainer, reference)


def _torch_step(reference, optimizer, batch, loss_fn, reference_loss):
    optimizer.zero_grad()
    loss = loss_fn(reference(*batch[:-1]), batch[-1]) if reference_loss is None else reference_loss(reference, batch)
    loss.backward()
    optimizer.step()
    return loss.detach()


def _ort_step(trainer, batch):
    outputs = trainer.train_step(*batch)
    return outputs[0] if isinstance(outputs, list) else outputs


def step_both(trainer, reference, optimizer, batch, step, loss_fn, reference_loss=None, atol=1e-5):
    """One train_step, and one step of a torch loop with ``optimizer`` over ``reference``, on ``batch``: the same loss
    and state_dict after it."""
    ort_loss = _ort_step(trainer, batch)
    loss = _torch_step(reference, optimizer, batch, loss_fn, reference_loss)
    torch.testing.assert_close(ort_loss, loss, atol=atol, rtol=1e-5, equal_nan=True,
                               msg=lambda m: f"loss at step {step}: {m}")  # fmt: skip
    assert_close_state(trainer, reference, atol=atol, step=step)


def step_against_float64(trainer, float32, float64, batch, step, loss_fn, reference_loss=None):
    """One train_step, and one step of the float32 torch loop ``float32`` and of the float64 one ``float64`` (each a
    (module, optimizer) pair) on ``batch``: the loss and every state_dict value after it within float32 torch's own
    distance from float64 (assert_within_float32_error)."""
    ort_loss = _ort_step(trainer, batch)
    loss32 = _torch_step(*float32, batch, loss_fn, reference_loss)
    loss64 = _torch_step(*float64, float64_batch(batch), loss_fn, reference_loss)
    assert_within_float32_error(ort_loss, loss32, loss64, f"loss at step {step}")
    assert_state_within_float32_error(trainer, float32[0], float64[0], step)


def train_keywords_like_torch(trainer, reference, reference64, batches, lr, compare_outputs):
    """The Hugging Face user's loop, ``trainer.train_step(**batch)`` with the model's own loss, against
    ``model(**batch).loss.backward()`` and torch SGD (``lr``) on ``reference`` and its float64 copy ``reference64``:
    ``compare_outputs(outputs, expected, expected64, where)`` at every step, then every state_dict key."""
    optimizers = [torch.optim.SGD(module.parameters(), lr=lr) for module in (reference, reference64)]
    for step, batch in enumerate(batches, 1):
        outputs = trainer.train_step(**batch)
        expected, expected64 = reference(**batch), reference64(**float64_batch(batch))
        for result, optimizer in zip((expected, expected64), optimizers):
            result.loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        compare_outputs(outputs, expected, expected64, f"train_step {step}")
        assert_state_within_float32_error(trainer, reference, reference64, step=step)


def keywords_trained_and_evaluated_like_torch(model, batches, eval_batch, lr):
    """``train_keywords_like_torch`` with SGD (``lr``) on a trainer over ``model`` (on the CPU) and on its float32 and
    float64 copies, then ``trainer.eval_step(**eval_batch)`` against both copies in eval mode: (the trainer,
    eval_step's outputs, torch's float32 outputs, float64 outputs, the float32 copy, the float64 copy)."""
    reference, reference64 = copy.deepcopy(model), float64_copy(model)
    trainer = ORTTrainer(model, None, SGDConfig(lr=lr), options=cpu_options())
    train_keywords_like_torch(trainer, reference, reference64, batches, lr, assert_outputs_within_float32_error)
    reference.eval()
    reference64.eval()
    with torch.no_grad():
        expected, expected64 = reference(**eval_batch), reference64(**float64_batch(eval_batch))
    outputs = trainer.eval_step(**eval_batch)
    assert_outputs_within_float32_error(outputs, expected, expected64, "eval_step")
    return trainer, outputs, expected, expected64, reference, reference64


def assert_state_within_float32_error(trainer, reference, reference64, step=None):
    """The trainer's state_dict has exactly the torch module's keys, every value within float32 torch's distance from
    the float64 module's (assert_within_float32_error)."""
    trained, expected, expected64 = trainer.state_dict(pytorch_format=True), reference.state_dict(), reference64.state_dict()
    assert set(trained) == set(expected), f"missing {set(expected) - set(trained)}, unexpected {set(trained) - set(expected)}"
    for name, tensor in trained.items():
        assert_within_float32_error(tensor, expected[name], expected64[name], f"step {step}, '{name}'")
