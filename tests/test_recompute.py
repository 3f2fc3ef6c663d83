"""Recompute (orttrainer/graph/recompute.py): the legacy graph_transformer switches and activation-checkpointed modules
train as without recompute (against a torch loop, and bit for bit against orttrainer without it, dropout on),
their training graphs compute the chosen activations again, and the step's peak memory is smaller.

The models are tiny GPT-2 configs of transformers (2-3 layers, hidden 32); the memory test runs a larger one in
subprocesses (arena off, so that the process's resident memory follows the tensors ONNX Runtime holds).
"""

import collections
import copy
import json
import os
import subprocess
import sys
import warnings

import onnx
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from parity import assert_close_state, cpu_options

from orttrainer import ORTTrainer, optim

LR = 0.1
VOCAB, BATCH, LENGTH = 100, 2, 16
SWITCHES = {
    "gelu": {"gelu_recompute": True},
    "attention-dropout": {"attn_dropout_recompute": True},
    "layers": {"transformer_layer_recompute": True},
    "first-layer": {"transformer_layer_recompute": True, "number_recompute_layers": 1},
}


def _transformers():
    return pytest.importorskip("transformers", reason="the GPT-2 models need transformers (the test extra)")


def gpt2(dropout=0.0, layers=3, checkpointed=False):
    torch.manual_seed(0)
    config = _transformers().GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=layers, n_head=2, n_positions=64,
                                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)  # fmt: skip
    model = _transformers().GPT2LMHeadModel(config)
    if checkpointed:
        model.activation_checkpointing_enable()
    return model


def _batches(count=3):
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (BATCH, LENGTH), generator=generator) for _ in range(count)]


def _trainer(model, tmp_path, graph_transformer=None, name="train"):
    path = str(tmp_path / f"{name}.onnx")
    options = cpu_options({"graph_transformer": graph_transformer or {},
                           "debug": {"graph_save_paths": {"model_with_training_graph_path": path}}})  # fmt: skip
    return ORTTrainer(model, None, optim.SGDConfig(lr=LR), options=options), path


def _recomputed(path) -> collections.Counter:
    """Op types of the recompute nodes of the saved training graph."""
    return collections.Counter(node.op_type for node in onnx.load(path).graph.node if "recompute" in node.name)


@pytest.mark.parametrize("switches, checkpointed", [*[(value, False) for value in SWITCHES.values()], ({}, True)],
                         ids=[*SWITCHES, "activation-checkpointing"])  # fmt: skip
def test_trains_like_torch_and_recomputes(tmp_path, switches, checkpointed):
    """3 SGD steps equal a torch loop (loss, every state_dict key), with the recompute nodes in the training graph:
    one PassThrough per region (a layer, a Gelu), clones of the forward nodes behind it."""
    model = gpt2(layers=3, checkpointed=checkpointed)
    reference = copy.deepcopy(model)
    trainer, path = _trainer(model, tmp_path, switches)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    for step, ids in enumerate(_batches(), 1):
        loss = trainer.train_step(input_ids=ids, labels=ids).loss
        expected = reference(input_ids=ids, labels=ids).loss
        expected.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch.testing.assert_close(loss, expected.detach(), atol=1e-5, rtol=1e-5, msg=lambda m: f"loss at step {step}: {m}")
        assert_close_state(trainer, reference, step=step)
    recomputed = _recomputed(path)
    regions = {"gelu": 3, "layers": 2, "first-layer": 1}  # the last layer never: its activations are read at once
    if checkpointed:
        assert recomputed["PassThrough"] == 3, "every checkpointed GPT2Block, the last too (as torch)"
    elif switches == SWITCHES["attention-dropout"]:
        assert not recomputed, "no attention dropout in a model with attn_pdrop=0: nothing to recompute"
    else:
        name = next(key for key, value in SWITCHES.items() if value == switches)
        assert recomputed["PassThrough"] == regions[name]
    if switches == SWITCHES["gelu"]:
        assert recomputed["FastGelu"] == 3
    if switches.get("transformer_layer_recompute") or checkpointed:
        assert recomputed["Softmax"] == recomputed["PassThrough"] and recomputed["Gemm"] == 4 * recomputed["PassThrough"]


@pytest.mark.parametrize("switches, checkpointed", [(SWITCHES["attention-dropout"], False), (SWITCHES["layers"], False),
                                                    ({}, True)], ids=["attention-dropout", "layers", "checkpointed"])  # fmt: skip
def test_with_dropout_the_same_masks_and_weights_as_without_recompute(tmp_path, switches, checkpointed):
    """Dropout 0.1 everywhere: a recomputed Dropout uses the forward's mask, so losses and weights are bitwise those
    of orttrainer without recompute (transformers' checkpointing itself changes no value either)."""
    runs = []
    for name, graph_transformer in (("plain", {}), ("recomputed", switches)):
        torch.manual_seed(5)  # the trainer's dropout seed
        model = gpt2(dropout=0.1, layers=3, checkpointed=checkpointed and name == "recomputed")
        trainer, path = _trainer(model, tmp_path, graph_transformer, name)
        losses = [trainer.train_step(input_ids=ids, labels=ids).loss for ids in _batches()]
        runs.append((losses, model.state_dict(), _recomputed(path)))
    (plain, plain_state, _), (recomputed, state, nodes) = runs
    assert nodes["DropoutGrad"] > 0, "the recomputed dropouts apply the kept masks"
    assert all(torch.equal(a, b) for a, b in zip(plain, recomputed)), f"losses {plain} != {recomputed}"
    assert all(torch.equal(plain_state[key], state[key]) for key in plain_state)


class _CheckpointedBlocks(nn.Module):
    """torch.utils.checkpoint used directly: one block whole, another through a function calling two modules."""

    def __init__(self):
        super().__init__()
        self.first = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        x = x + torch.utils.checkpoint.checkpoint(self.first, x, use_reentrant=False)
        x = x + torch.utils.checkpoint.checkpoint(lambda h: self.down(self.up(h)), x, use_reentrant=False)
        return self.head(x)


def test_torch_utils_checkpoint_modules_are_recomputed(tmp_path):
    """The modules run under torch.utils.checkpoint are found (the checkpointed module, or the modules the
    checkpointed function calls) and recomputed; the steps equal a torch loop."""
    torch.manual_seed(0)
    model = _CheckpointedBlocks()
    reference = copy.deepcopy(model)
    path = str(tmp_path / "train.onnx")
    options = cpu_options({"debug": {"graph_save_paths": {"model_with_training_graph_path": path}}})
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=LR), loss_fn=F.mse_loss, options=options)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    generator = torch.Generator().manual_seed(0)
    for step in range(1, 4):
        x, y = torch.randn(16, 8, generator=generator), torch.randn(16, 2, generator=generator)
        loss = trainer.train_step(x, y)[0]
        expected = F.mse_loss(reference(x), y)
        expected.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch.testing.assert_close(loss, expected.detach(), atol=1e-5, rtol=1e-5)
        assert_close_state(trainer, reference, step=step)
    recomputed = _recomputed(path)
    # 'first' whole: its first Linear and GELU; the function's call: 'up' and 'down' as one region, 'up' inside it
    assert recomputed == {"PassThrough": 2, "Gemm": 2, "Gelu": 1}, recomputed


def _mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


@pytest.mark.parametrize("make, switches, message", [
    (_mlp, {"gelu_recompute": True}, r"graph_transformer\.gelu_recompute: nothing to recompute: the training graph has no GELU"),
    (gpt2, {"attn_dropout_recompute": True},
     r"graph_transformer\.attn_dropout_recompute: nothing to recompute: .*no dropout of a softmax's output"),
    (_mlp, {"transformer_layer_recompute": True},
     r"graph_transformer\.transformer_layer_recompute: nothing to recompute: the graph has no stack of two or more"),
    (gpt2, {"number_recompute_layers": 1},
     r"graph_transformer\.number_recompute_layers: has no effect: .*transformer_layer_recompute, which is off"),
    (gpt2, {"transformer_layer_recompute": True, "number_recompute_layers": 5},
     r"graph_transformer\.number_recompute_layers: 5 layers asked, the model has 3 and the last is never recomputed"),
], ids=["gelu-without-gelu", "attention-dropout-without-dropout", "layers-without-layers", "count-without-layers",
        "more-layers-than-the-model"])  # fmt: skip
def test_a_switch_that_cannot_be_honoured_says_so(make, switches, message):
    options = cpu_options({"graph_transformer": switches})
    if make is _mlp:
        trainer = ORTTrainer(_mlp(), None, optim.SGDConfig(lr=LR), loss_fn=F.mse_loss, options=options)
        args, kwargs = (torch.randn(3, 4), torch.randn(3, 1)), {}
    else:
        trainer = ORTTrainer(gpt2(), None, optim.SGDConfig(lr=LR), options=options)
        ids = _batches(1)[0]
        args, kwargs = (), {"input_ids": ids, "labels": ids}
    with pytest.warns(UserWarning, match=message):
        trainer.train_step(*args, **kwargs)


_MEASURE = """
import json, sys, warnings
import torch, transformers
from orttrainer import ORTTrainer, ORTTrainerOptions, optim
import onnxruntime
warnings.simplefilter("ignore")
transformers.logging.set_verbosity_error()
torch.manual_seed(0)
config = transformers.GPT2Config(vocab_size=500, n_embd=64, n_layer=4, n_head=4, n_positions=256, resid_pdrop=0.0,
                                 embd_pdrop=0.0, attn_pdrop=0.0)
model = transformers.GPT2LMHeadModel(config)
if sys.argv[1] == "checkpointed":
    model.activation_checkpointing_enable()
session_options = onnxruntime.SessionOptions()
session_options.enable_cpu_mem_arena = False
session_options.enable_mem_pattern = False
switches = {"layers": {"transformer_layer_recompute": True}}.get(sys.argv[1], {})
options = ORTTrainerOptions({"device": {"id": "cpu"}, "graph_transformer": switches, "session_options": session_options,
                             "debug": {"check_against_torch": "off"}})
trainer = ORTTrainer(model, None, optim.SGDConfig(lr=1e-3), options=options)
ids = torch.randint(0, 500, (4, 256), generator=torch.Generator().manual_seed(0))
losses = [trainer.train_step(input_ids=ids, labels=ids).loss.item()]
def status(key):
    return int(next(line for line in open("/proc/self/status") if line.startswith(key)).split()[1]) * 1024
before = status("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM from here on
losses.append(trainer.train_step(input_ids=ids, labels=ids).loss.item())
print(json.dumps({"step_peak": status("VmHWM:") - before, "losses": losses}))
"""


def _step_peak(mode):
    """The second step's peak resident memory above the memory before it, in a fresh process."""
    # fixed threshold: freed tensors go back to the system at once (glibc would raise it after the first frees)
    environment = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _MEASURE, mode], capture_output=True, text=True, env=environment,
                          timeout=600, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak from /proc/self/status (Linux)")
def test_recompute_lowers_the_steps_peak_memory():
    """GPT-2 with 4 layers at seq 256, batch 4 (attention activations dominate): the step's peak above its start
    is under 60% of the peak without recompute, with layer recompute and with activation checkpointing; same losses."""
    plain, layers, checkpointed = (_step_peak(mode) for mode in ("plain", "layers", "checkpointed"))
    assert layers["losses"] == plain["losses"] == checkpointed["losses"]
    for name, run in (("transformer_layer_recompute", layers), ("activation checkpointing", checkpointed)):
        assert run["step_peak"] < 0.6 * plain["step_peak"], (
            f"{name}: step peak {run['step_peak'] / 2**20:.1f} MiB, without recompute {plain['step_peak'] / 2**20:.1f} MiB")


def test_warnings_are_not_raised_for_a_model_recompute_fits(tmp_path):
    """The switches on a model that has what they recompute: no warning."""
    trainer, _ = _trainer(gpt2(dropout=0.1, layers=2), tmp_path, {**SWITCHES["gelu"], **SWITCHES["attention-dropout"],
                                                                  **SWITCHES["layers"]})  # fmt: skip
    ids = _batches(1)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.train_step(input_ids=ids, labels=ids)


def test_mixed_precision_recomputes_layers_and_keeps_float16_dropouts(tmp_path):
    """Under mixed precision (float16 compute) layers are recomputed with the same losses; a float16 Dropout is
    kept, not recomputed (ONNX Runtime's float16 DropoutGrad rounds otherwise than its Dropout), and the attention
    dropout switch says so."""
    runs = []
    for name, switches in (("plain", {}), ("recomputed", {**SWITCHES["layers"], **SWITCHES["attention-dropout"]})):
        torch.manual_seed(5)
        path = str(tmp_path / f"{name}.onnx")
        options = cpu_options({"mixed_precision": {"enabled": True}, "graph_transformer": switches,
                               "debug": {"check_against_torch": "off",
                                         "graph_save_paths": {"model_with_training_graph_path": path}}})  # fmt: skip
        model = gpt2(dropout=0.1, layers=3)
        trainer = ORTTrainer(model, None, optim.SGDConfig(lr=LR), options=options)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = [trainer.train_step(input_ids=ids, labels=ids).loss for ids in _batches()]
        runs.append((losses, model.state_dict(), _recomputed(path), [str(warning.message) for warning in caught]))
    (plain, plain_state, _, _), (losses, state, nodes, messages) = runs
    assert nodes["PassThrough"] == 2 and nodes["Softmax"] == 2 and not nodes["DropoutGrad"], nodes
    assert any(message.startswith("graph_transformer.attn_dropout_recompute: nothing recomputed under mixed precision")
               for message in messages), messages  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(plain, losses)), f"losses {plain} != {losses}"
    for key, value in plain_state.items():
        torch.testing.assert_close(state[key], value, atol=1e-5, rtol=1e-5, msg=lambda m: f"'{key}': {m}")
