"""orttrainer.hf.Trainer against transformers.Trainer itself: the same model, data, arguments and seed (dropout
off), the losses in log_history and every final weight within float32 torch's distance from a float64
transformers.Trainer run; evaluate/predict, callbacks, a saved model that reloads, an exact resume, refusals.
"""

import copy
import json
from pathlib import Path

import numpy
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="orttrainer.hf needs transformers (the hf extra)")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (the hf extra)")

from parity import assert_within_float32_error  # noqa: E402
from test_distributed import launch  # noqa: E402
from test_hf_models import BATCH, _bert_config, bert_classifier, classification_batch, gpt2_lm, causal_lm_batch  # noqa: E402

import orttrainer.hf  # noqa: E402

ROWS = 4  # per_device_train_batch_size
HERE = Path(__file__).parent


def _rows(make_batch, batches):
    """A dataset of single rows (what a Trainer's dataset yields) cut from ``batches`` batches of ``make_batch``."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(batches):
        batch = make_batch(generator)
        rows += [{key: value[row] for key, value in batch.items()} for row in range(BATCH)]
    return rows


def _bert_returning_tuples():  # forward returns (loss, logits)
    return transformers.BertForSequenceClassification(_bert_config(num_labels=3, return_dict=False))


MODELS = {"bert-classification": (bert_classifier, classification_batch), "gpt2-lm": (gpt2_lm, causal_lm_batch),
          "bert-tuples": (_bert_returning_tuples, classification_batch)}
SCHEDULES = {
    "plain": {},
    "accumulation-warmup-clip-decay": {"gradient_accumulation_steps": 2, "warmup_steps": 2, "max_grad_norm": 0.5,
                                       "weight_decay": 0.1, "lr_scheduler_type": "cosine"},  # fmt: skip
}


def _arguments(directory, **extra):
    settings = {"per_device_train_batch_size": ROWS, "per_device_eval_batch_size": ROWS, "max_steps": 4,
                "logging_steps": 1, "learning_rate": 3e-3, "report_to": [], "seed": 0, "save_strategy": "no",
                "disable_tqdm": True, "use_cpu": True, "dataloader_drop_last": True}  # fmt: skip
    return transformers.TrainingArguments(str(directory), **{**settings, **extra})


def _train(trainer_class, model, directory, rows, **extra):
    trainer = trainer_class(model=model, args=_arguments(directory, **extra), train_dataset=rows)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry], model.state_dict()


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("model_name", MODELS)
def test_trains_like_transformers_trainer(tmp_path, model_name, schedule):
    _assert_trains_like_transformers_trainer(tmp_path, model_name, SCHEDULES[schedule])


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("model_name", ["bert-classification", "gpt2-lm"])
def test_bf16_trains_like_transformers_trainer_bf16(tmp_path, model_name, schedule):
    """bf16=True (Trainer's forward under torch.autocast with bfloat16, which orttrainer follows): losses and weights
    within K times transformers.Trainer(bf16=True)'s distance from the float64 run; sdpa attention with masks."""
    _assert_trains_like_transformers_trainer(tmp_path, model_name, {**SCHEDULES[schedule], "bf16": True})


def _assert_trains_like_transformers_trainer(tmp_path, model_name, settings):
    """orttrainer.hf.Trainer and transformers.Trainer with ``settings``, against a float64 transformers.Trainer run
    with the same settings but mixed precision: the logged losses and every final weight."""
    make_model, make_batch = MODELS[model_name]
    torch.manual_seed(0)
    model = make_model()
    rows = _rows(make_batch, 8)
    float64_settings = {key: value for key, value in settings.items() if key != "bf16"}
    runs = {}
    for name, trainer_class, copy_of, chosen in (
            ("torch", transformers.Trainer, lambda m: copy.deepcopy(m), settings),
            ("float64", transformers.Trainer, lambda m: copy.deepcopy(m).double(), float64_settings),
            ("orttrainer", orttrainer.hf.Trainer, lambda m: copy.deepcopy(m), settings)):  # fmt: skip
        runs[name] = _train(trainer_class, copy_of(model), tmp_path / name, rows, **chosen)
    (losses, state), (losses32, state32), (losses64, state64) = runs["orttrainer"], runs["torch"], runs["float64"]
    assert len(losses) == len(losses32) == 4
    assert_within_float32_error(torch.tensor(losses), torch.tensor(losses32), torch.tensor(losses64), "logged losses")
    assert state.keys() == state32.keys()
    for key in state32:
        assert_within_float32_error(state[key], state32[key], state64[key], f"weight {key}")


def test_gradients_reach_grad_as_torch_backward_does(tmp_path):
    """After training_step, each parameter's .grad is torch's (the graph's gradients handed to autograd), and a
    second training_step adds to it as a second loss.backward() would."""
    torch.manual_seed(0)
    model = gpt2_lm()
    reference = copy.deepcopy(model)
    batch = causal_lm_batch(torch.Generator().manual_seed(1))
    trainer = orttrainer.hf.Trainer(model=model, args=_arguments(tmp_path))
    trainer.current_gradient_accumulation_steps = 1  # what train() sets before its steps
    for _ in range(2):
        trainer.training_step(model, dict(batch))
        reference(**batch).loss.backward()
    for name, parameter in reference.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, parameter.grad, atol=1e-5, rtol=1e-4,
                                   msg=lambda m: f"{name}.grad: {m}")  # fmt: skip


@pytest.mark.slow
def test_under_torchrun_like_transformers_trainer_under_torchrun(tmp_path):
    """Two processes under torchrun (gloo), as Trainer launches them: the ranks' gradients averaged as
    DistributedDataParallel averages them, with accumulation and clipping; losses and weights as transformers.Trainer's."""
    runs = {}
    for contender in ("orttrainer", "torch", "float64"):
        out = tmp_path / f"{contender}.npz"
        result = launch([HERE / "hf_trainer_job.py", contender, out], ranks=2, timeout=600)
        assert result.returncode == 0, result.stderr[-4000:]
        runs[contender] = numpy.load(out)
    ours, torch32, float64 = runs["orttrainer"], runs["torch"], runs["float64"]
    assert int(ours["world"]) == 2 and len(ours["losses"]) == 4
    for key in torch32.files:
        if key != "world":
            assert_within_float32_error(ours[key], torch32[key], float64[key], key)


def _accuracy(prediction):
    return {"accuracy": float((prediction.predictions[0].argmax(-1) == prediction.label_ids).mean())}


def test_evaluate_predict_callbacks_and_saved_model(tmp_path):
    """evaluate()/predict() with compute_metrics give transformers.Trainer's numbers on the trained module, a callback
    sees every logged loss, and save_model writes a model that from_pretrained loads with the trained weights."""
    torch.manual_seed(0)
    model = bert_classifier()
    reference = copy.deepcopy(model)
    rows = _rows(classification_batch, 4)
    logged = []

    class LossRecorder(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            logged.extend([logs["loss"]] if "loss" in logs else [])

    trainer = orttrainer.hf.Trainer(model=model, args=_arguments(tmp_path / "ort"), train_dataset=rows, eval_dataset=rows,
                                    compute_metrics=_accuracy, callbacks=[LossRecorder()])  # fmt: skip
    trainer.train()
    assert logged == [entry["loss"] for entry in trainer.state.log_history if "loss" in entry] and len(logged) == 4
    reference.load_state_dict(model.state_dict())
    torch_trainer = transformers.Trainer(model=reference, args=_arguments(tmp_path / "torch"), eval_dataset=rows,
                                         compute_metrics=_accuracy)  # fmt: skip
    ours, theirs = trainer.evaluate(), torch_trainer.evaluate()
    for key in ("eval_loss", "eval_accuracy"):
        assert ours[key] == theirs[key], key
    prediction, torch_prediction = trainer.predict(rows), torch_trainer.predict(rows)
    assert (prediction.predictions[0] == torch_prediction.predictions[0]).all()
    trainer.save_model(str(tmp_path / "saved"))
    reloaded = type(model).from_pretrained(str(tmp_path / "saved"))
    for key, value in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value), key


def test_resume_from_checkpoint_continues_exactly(tmp_path):
    """train(resume_from_checkpoint=) from step 2 of 4 (optimizer, scheduler, step, RNG) ends on the same weights and
    losses as the uninterrupted run."""
    torch.manual_seed(0)
    model = gpt2_lm()
    rows = _rows(causal_lm_batch, 8)
    settings = {"save_strategy": "steps", "save_steps": 2, "gradient_accumulation_steps": 2, "warmup_steps": 1,
                "weight_decay": 0.1}  # fmt: skip
    whole = copy.deepcopy(model)
    losses, state = _train(orttrainer.hf.Trainer, whole, tmp_path / "whole", rows, **settings)
    resumed = copy.deepcopy(model)
    trainer = orttrainer.hf.Trainer(model=resumed, args=_arguments(tmp_path / "whole", **settings), train_dataset=rows)
    trainer.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    resumed_losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert resumed_losses == losses
    for key, value in state.items():
        assert torch.equal(resumed.state_dict()[key], value), key


@pytest.mark.parametrize(
    "arguments, extra, named",
    [
        ({"fp16": True}, {}, "TrainingArguments.fp16=True"),
        ({"label_smoothing_factor": 0.1}, {}, "TrainingArguments.label_smoothing_factor=0.1"),
        ({}, {"compute_loss_func": lambda outputs, labels, num_items_in_batch=None: outputs.loss}, "compute_loss_func"),
        ({"optim": "lomo"}, {}, "TrainingArguments.optim="),
    ],
    ids=["fp16", "label_smoothing", "compute_loss_func", "lomo"],
)
def test_what_cannot_be_honoured_is_refused_by_argument_name(tmp_path, arguments, extra, named):
    torch.manual_seed(0)
    model = bert_classifier()
    before = copy.deepcopy(model.state_dict())
    try:
        args = _arguments(tmp_path, **arguments)
    except (ValueError, ImportError) as error:  # transformers refuses it itself on this machine
        pytest.skip(f"transformers refuses {arguments} itself here: {error}")
    with pytest.raises(ValueError, match=named.replace(".", r"\.").replace("(", r"\(")):
        orttrainer.hf.Trainer(model=model, args=args, train_dataset=_rows(classification_batch, 1), **extra)
    assert all(torch.equal(model.state_dict()[key], value) for key, value in before.items())


def test_the_hf_extra_lists_what_trainer_needs():
    """`pip install 'orttrainer[hf]'` brings transformers and accelerate; the core install has neither."""
    import configparser
    import pathlib

    config = configparser.ConfigParser()
    config.read(pathlib.Path(__file__).parents[1] / "setup.cfg")
    extra = config["options.extras_require"]["hf"]
    core = config["options"]["install_requires"]
    assert "transformers" in extra and "accelerate" in extra
    assert "transformers" not in core and "accelerate" not in core
    assert json.dumps(sorted(orttrainer.__all__)).count("hf") == 0  # the core namespace does not import it
