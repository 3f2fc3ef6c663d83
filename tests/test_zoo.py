"""The model zoo (tests/zoo.py) trained through the public API only, as its users train it.

Each model, in one test: SGD steps over batches of two shapes (A, B, then A again) equal a
plain torch loop from the same weights (loss and every state_dict key, buffers included);
eval_step equals the torch module in eval mode; the trained state loads strictly into the
user's module; and save_as_onnx (with and without the loss) runs in a plain
onnxruntime.InferenceSession giving the module's eval outputs. "Equal": as close to a float64
torch loop over the same batches as the float32 one is (parity.assert_within_float32_error), for
the layer norms, softmaxes and variances of these models round differently on other CPUs.
"""

import functools
from collections.abc import Mapping

import onnxruntime
import pytest
import torch
import torch.nn.functional as F
import zoo
from parity import assert_within_float32_error, float64_batch, keywords_trained_and_evaluated_like_torch, run_parity

from orttrainer import optim

LR = 0.1


def _batches(make, shapes):
    """One batch per shape, then an evaluation batch of new data in the second shape."""
    generator = torch.Generator().manual_seed(1234)
    batches = [make(*shape, generator=generator) for shape in shapes]
    return batches, make(*shapes[1], generator=generator)


def _close(actual, expected, expected64, what):
    """``actual`` as close to the float64 run's ``expected64`` as float32 torch's ``expected`` is."""
    assert_within_float32_error(torch.as_tensor(actual), expected.detach(), expected64.detach(), what)


def _onnx_session(trainer, path, with_loss):
    if with_loss:
        trainer.save_as_onnx(str(path))  # the legacy call
    else:
        trainer.save_as_onnx(str(path), with_loss=False)
    return onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _loads_strictly(model, trainer, reference, reference64):
    """The trained state loads into the user's module with strict=True and equals torch's (as close to the float64
    module's as float32 torch's is: a running mean of values that nearly cancel, MobileViT's, is 2e-5 off in torch)."""
    model.load_state_dict(trainer.state_dict(pytorch_format=True), strict=True)
    loaded, expected64 = model.state_dict(), reference64.state_dict()
    for name, tensor in reference.state_dict().items():
        assert_within_float32_error(loaded[name], tensor, expected64[name], f"'{name}' loaded into the module")


# ------------------------------------------------------------------ models written in torch
def _check_module(tmp_path, model, loss_fn, batches, eval_batch):
    """Parity over ``batches``, then eval_step, strict load and both ONNX exports on ``eval_batch``. The model
    returns a tensor or a tuple of them."""
    sgd = functools.partial(torch.optim.SGD, lr=LR)
    trainer, reference, reference64 = run_parity(model, batches, optim.SGDConfig(lr=LR), sgd, loss_fn=loss_fn, float64=True)

    *inputs, label = eval_batch
    reference.eval()
    reference64.eval()
    with torch.no_grad():
        expected, expected64 = reference(*inputs), reference64(*float64_batch(inputs))
    expected_loss, expected_loss64 = loss_fn(expected, label), loss_fn(expected64, label)
    expected, expected64 = (value if isinstance(value, tuple) else (value,) for value in (expected, expected64))
    loss, *outputs = trainer.eval_step(*eval_batch)
    _close(loss, expected_loss, expected_loss64, "eval_step loss")
    assert len(outputs) == len(expected)
    for index, (output, wanted, wanted64) in enumerate(zip(outputs, expected, expected64)):
        _close(output, wanted, wanted64, f"eval_step output {index}")

    _loads_strictly(model, trainer, reference, reference64)

    for with_loss, feeds, wanted, wanted64 in ((True, eval_batch, [expected_loss, *expected], [expected_loss64, *expected64]),
                                               (False, inputs, expected, expected64)):  # fmt: skip
        session = _onnx_session(trainer, tmp_path / f"model_{with_loss}.onnx", with_loss)
        assert len(session.get_inputs()) == len(feeds), [i.name for i in session.get_inputs()]
        results = session.run(None, {entry.name: tensor.numpy() for entry, tensor in zip(session.get_inputs(), feeds)})
        assert len(results) == len(wanted)
        for index, (result, value, value64) in enumerate(zip(results, wanted, wanted64)):
            _close(result, value, value64, f"ONNX (with_loss={with_loss}) output {index}")


SHAPES = {"images": [(4,), (3,), (4,)], "tokens": [(4, 7), (3, 10), (4, 7)]}  # (batch,) / (batch, padded length)


@pytest.mark.parametrize("name", zoo.TORCH_MODELS)
def test_torch_model(tmp_path, name):
    make, make_batch, shape_kind = zoo.TORCH_MODELS[name]
    torch.manual_seed(0)
    batches, eval_batch = _batches(make_batch, SHAPES[shape_kind])
    _check_module(tmp_path, make(), F.cross_entropy, batches, eval_batch)


@pytest.mark.parametrize("name", zoo.AUTOENCODERS)
def test_autoencoder(tmp_path, name):
    """A VQ-VAE's straight-through codebook; VQ-VAE-2's codebook of buffers that training forward moves by moving
    averages, which eval_step and the ONNX files read as trained."""
    make, make_batch, shape_kind = zoo.AUTOENCODERS[name]
    torch.manual_seed(0)
    batches, eval_batch = _batches(make_batch, SHAPES[shape_kind])
    _check_module(tmp_path, make(), zoo.reconstruction_plus_own_loss, batches, eval_batch)


# ------------------------------------------------------------------ Hugging Face
def _graph_outputs(outputs, prefix="") -> dict:
    """{graph output name: tensor} of a ModelOutput: ``<field>``, ``<field>.<index>`` of a tuple,
    ``<field>.<subfield>`` of a nested ModelOutput."""
    named = {}
    for key, value in outputs.items():
        if isinstance(value, Mapping):
            named.update(_graph_outputs(value, f"{prefix}{key}."))
        elif isinstance(value, tuple):
            named.update({f"{prefix}{key}.{index}": tensor for index, tensor in enumerate(value)})
        else:
            named[prefix + key] = value
    return named


def _check_hugging_face(tmp_path, model, batches, eval_batch):
    """The HF user's loop: ``trainer.train_step(**batch)`` with labels (or return_loss=True) in the batch,
    the model's own loss, its ModelOutput back; against ``model(**batch).loss.backward()`` and torch SGD."""
    model.train()
    trainer, _, expected, expected64, reference, reference64 = keywords_trained_and_evaluated_like_torch(
        model, batches, eval_batch, LR)
    _loads_strictly(model, trainer, reference, reference64)

    for with_loss in (True, False):
        session = _onnx_session(trainer, tmp_path / f"model_{with_loss}.onnx", with_loss)
        wanted = {name: tensor for name, tensor in _graph_outputs(expected).items() if with_loss or name != "loss"}
        wanted64 = _graph_outputs(expected64)
        assert [entry.name for entry in session.get_outputs()] == list(wanted)
        feeds = {entry.name: eval_batch[entry.name].numpy() for entry in session.get_inputs()}  # not return_loss
        for name, result in zip(wanted, session.run(None, feeds)):
            _close(result, wanted[name], wanted64[name], f"ONNX (with_loss={with_loss}) {name}")


HUGGING_FACE_SHAPES = {"images": [(2,), (3,), (2,)], "image sizes": [(2, 16), (3, 24), (2, 16)], "audio": [(2,), (3,), (2,)],
                       "tokens": [(2, 8), (3, 12), (2, 8)], "short tokens": [(2, 8), (3, 12), (2, 8)]}  # fmt: skip


# the fast tier: an encoder, a causal LM and a vision transformer; the other architectures in the whole suite
FAST_HUGGING_FACE = ("bert-classifier", "gpt2-lm", "vit-image-classifier")


@pytest.mark.parametrize("name", [name if name in FAST_HUGGING_FACE else pytest.param(name, marks=pytest.mark.slow)
                                  for name in zoo.HUGGING_FACE_MODELS])  # fmt: skip
def test_hugging_face_model(tmp_path, name):
    pytest.importorskip("transformers", reason="the Hugging Face zoo needs transformers (the test extra)")
    make, make_batch, shape_kind = zoo.HUGGING_FACE_MODELS[name]
    torch.manual_seed(0)
    batches, eval_batch = _batches(make_batch, HUGGING_FACE_SHAPES[shape_kind])
    _check_hugging_face(tmp_path, make(), batches, eval_batch)


@pytest.mark.slow
def test_causal_lm_trains_as_torch_on_left_padded_batches(tmp_path):
    """Left padding leaves the padding's queries no key under the causal mask: torch's attention gives
    them 0 and no gradient, where the exporter's softmax gave every weight a NaN gradient
    (symbolics.layers.scaled_dot_product_attention)."""
    pytest.importorskip("transformers", reason="the Hugging Face zoo needs transformers (the test extra)")
    torch.manual_seed(0)
    batches, eval_batch = _batches(zoo.left_padded_causal_lm_batch, HUGGING_FACE_SHAPES["tokens"])
    assert all((batch["attention_mask"][:, 0] == 0).any() for batch in batches), "a batch without left padding"
    _check_hugging_face(tmp_path, zoo.llama_lm(), batches, eval_batch)
