"""How to export models whose batches change shape, and Hugging Face models: two routes, measured.

Route A: the TorchScript exporter as orttrainer uses it now (``torch.onnx.export(dynamo=False,
training=PRESERVE, do_constant_folding=False, dynamic_axes=...)``, through ``ORTTrainer`` on a
small wrapper module, ``LossWrapper``), one graph per input-shape signature (export + build on
every new shape, weights carried over). orttrainer refuses every Hugging Face model here; route
A' is the same with that one refusal turned into orttrainer's hold-to-first-shapes check
(``_python_if_held_to_shape``, patched in this process only; nothing under orttrainer/ changes).
Route B: ``torch.onnx.export(dynamo=True, dynamic_shapes=..., optimize=False)`` (torch.export +
onnxscript) once; CastLike -> Cast (no gradient builder in onnxruntime-training 1.19), IR 10,
tied parameters renamed to their ``named_parameters()`` name, non-parameter float initializers
frozen; the ``onnx.ModelProto`` handed to ORTTrainer. Where the plain graph fails, the fix that
made it work is applied and both outcomes are reported (torch.export + run_decompositions()
before the ONNX exporter; SplitToSequence -> Slice; Where inputs expanded).

For every model and route: does the export work, its time, the build time (first train_step),
route A's cost of a new shape; whether training over several (batch, seq) shapes, a partial last
batch included, equals a torch SGD loop from the same weights step by step (loss and every
parameter); for route A also whether the graph traced at one shape gives the right answer, a
wrong one silently, or an error at other shapes; for route B whether every trainable parameter is
an initializer of the same name; steady-state ms per train_step on one shape for both routes.

    python benchmarks/export_routes.py                # all models (~4 min on 2 cores), writes results/export_routes.md
    python benchmarks/export_routes.py --only bert    # models whose name contains 'bert' (no file written)

Models are tiny and randomly initialised from configs (no download); dropout is 0 so that torch
and ONNX Runtime compute the same thing. Needs ``transformers`` and ``onnxscript``.
"""

import argparse
import contextlib
import copy
import gc
import inspect
import io
import logging
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.onnx import TrainingMode

import orttrainer.export
from orttrainer import ORTTrainer, ORTTrainerOptions, optim

logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)  # "torchvision is not installed"

RESULTS = Path(__file__).parent / "results"
LR = 0.05
RTOL, ATOL = 1e-4, 1e-5  # float32: per step, loss and every parameter against torch SGD
TIMED_STEPS, WARMUP_STEPS, ROUNDS = 30, 3, 15
OPTIONS = {"device": {"id": "cpu"}, "debug": {"check_against_torch": "off"}}  # the check costs time; we compare ourselves


# ----------------------------------------------------------------------------- models
@dataclass
class Case:
    name: str
    make: Callable  # () -> nn.Module, deterministic
    batch: Callable  # (batch, seq, torch.Generator) -> {input name: tensor}, labels included
    dims: dict  # input name -> {axis: "batch" | "seq" | "tgt"}
    loss: Callable  # (module, **batch) -> scalar loss
    # (batch, seq) in training order: the first is the export sample; then a batch-only change, shorter
    # and longer sequences, 3x16 (as many tokens as 4x12: a baked length might not fail on it), a shape
    # seen before (route A's cache hit, and A''s re-export with other values), and a partial last batch
    shapes: list = field(default_factory=lambda: [(4, 12), (3, 12), (4, 7), (4, 16), (3, 16), (4, 12), (3, 9)])
    time_shape: tuple = (8, 32)
    dim_min: dict = field(default_factory=dict)  # route B: smallest size of a dynamic axis (default 2)


def _hf_loss(model, **batch):
    return model(**batch).loss


def _padded_tokens(batch, seq, generator, vocab, pad, low=3):
    """Random token ids with trailing padding on some rows, and the attention mask."""
    ids = torch.randint(low, vocab, (batch, seq), generator=generator)
    lengths = torch.randint(max(2, seq // 2), seq + 1, (batch,), generator=generator)
    lengths[0] = seq
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, pad)
    return ids, mask


def _classification(vocab, pad, classes=2):
    def batch(b, s, g):
        ids, mask = _padded_tokens(b, s, g, vocab, pad)
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, classes, (b,), generator=g)}

    return batch


def _language_model(vocab, pad, masked):
    def batch(b, s, g):
        ids, mask = _padded_tokens(b, s, g, vocab, pad)
        labels = ids.masked_fill(mask == 0, -100)
        if masked:  # predict ~30% of the tokens, ignore the rest
            labels = labels.masked_fill(torch.rand(b, s, generator=g) > 0.3, -100)
            labels[:, 0] = ids[:, 0]
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return batch


def _seq2seq(vocab, pad):
    def batch(b, s, g):
        ids, mask = _padded_tokens(b, s, g, vocab, pad)
        target, target_mask = _padded_tokens(b, max(2, s // 2 + 1), g, vocab, pad)
        return {"input_ids": ids, "attention_mask": mask, "labels": target.masked_fill(target_mask == 0, -100)}

    return batch


TOKENS = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}


def _with_decoder_inputs(batch):
    """T5: also pass decoder_input_ids (labels shifted right, as T5's own _shift_right), built outside the model."""

    def made(b, s, g):
        data = batch(b, s, g)
        shifted = torch.zeros_like(data["labels"])
        shifted[:, 1:] = data["labels"][:, :-1]
        data["decoder_input_ids"] = shifted.masked_fill(shifted == -100, 0)
        return data

    return made


def _seeded(make):
    def made():
        torch.manual_seed(0)
        return make()

    return made


class SeqFirstEncoder(nn.Module):
    """nn.TransformerEncoder, sequence-first (batch_first=False), 2 layers, d 32, MSE to a target."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=False)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 32)

    def forward(self, x, target):
        return F.mse_loss(self.head(self.encoder(x)), target)


class PaddedEmbedding(nn.Module):
    """nn.Embedding(padding_idx=0) whose padding positions reach the loss: torch never trains row 0."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(50, 16, padding_idx=0)
        self.head = nn.Linear(16, 1)

    def forward(self, ids, target):
        return F.mse_loss(self.head(self.embedding(ids)).squeeze(-1), target)


def _embedding_batch(b, s, g):
    ids = torch.randint(1, 50, (b, s), generator=g)
    ids[:, -2:] = 0  # padding, not masked
    return {"ids": ids, "target": torch.randn(b, s, generator=g)}


def _encoder_batch(b, s, g):
    return {"x": torch.randn(s, b, 32, generator=g), "target": torch.randn(s, b, 32, generator=g)}


def make_cases():
    import transformers as T

    bert = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
                max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    t5 = dict(vocab_size=100, d_model=32, d_kv=16, d_ff=37, num_layers=2, num_decoder_layers=2, num_heads=2,
              dropout_rate=0.0, relative_attention_num_buckets=8, relative_attention_max_distance=16,
              decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)  # fmt: skip
    cases = [
        Case("nn.TransformerEncoder (seq-first)", _seeded(SeqFirstEncoder), _encoder_batch,
             {"x": {0: "seq", 1: "batch"}, "target": {0: "seq", 1: "batch"}}, lambda m, **b: m(**b)),
        Case("nn.Embedding(padding_idx=0), pads reach the loss", _seeded(PaddedEmbedding), _embedding_batch,
             {"ids": {0: "batch", 1: "seq"}, "target": {0: "batch", 1: "seq"}}, lambda m, **b: m(**b)),
        Case("BertForSequenceClassification", _seeded(lambda: T.BertForSequenceClassification(T.BertConfig(**bert))),
             _classification(100, 0), {**TOKENS, "labels": {0: "batch"}}, _hf_loss),
        Case("BertForMaskedLM (tied)", _seeded(lambda: T.BertForMaskedLM(T.BertConfig(**bert))),
             _language_model(100, 0, masked=True), {**TOKENS, "labels": {0: "batch", 1: "seq"}}, _hf_loss),
        Case("GPT2LMHeadModel", _seeded(lambda: T.GPT2LMHeadModel(T.GPT2Config(
                 vocab_size=100, n_positions=64, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                 attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))),
             _language_model(100, 0, masked=False), {**TOKENS, "labels": {0: "batch", 1: "seq"}}, _hf_loss),
        Case("T5ForConditionalGeneration", _seeded(lambda: T.T5ForConditionalGeneration(T.T5Config(**t5))),
             _seq2seq(100, 0), {**TOKENS, "labels": {0: "batch", 1: "tgt"}}, _hf_loss,
             dim_min={"tgt": 3}),  # torch.export: "Not all values of tgt ... satisfy the generated guard 3 <= ..."
        Case("T5ForConditionalGeneration + decoder_input_ids", _seeded(lambda: T.T5ForConditionalGeneration(T.T5Config(**t5))),
             _with_decoder_inputs(_seq2seq(100, 0)),
             {**TOKENS, "labels": {0: "batch", 1: "tgt"}, "decoder_input_ids": {0: "batch", 1: "tgt"}}, _hf_loss,
             dim_min={"tgt": 3}),
        Case("BartForConditionalGeneration", _seeded(lambda: T.BartForConditionalGeneration(T.BartConfig(
                 vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                 decoder_attention_heads=2, encoder_ffn_dim=37, decoder_ffn_dim=37, max_position_embeddings=64,
                 dropout=0.0, attention_dropout=0.0, activation_dropout=0.0))),
             _seq2seq(100, 1), {**TOKENS, "labels": {0: "batch", 1: "tgt"}}, _hf_loss),
        Case("DistilBertForSequenceClassification", _seeded(lambda: T.DistilBertForSequenceClassification(
                 T.DistilBertConfig(vocab_size=100, dim=32, n_layers=2, n_heads=2, hidden_dim=37,
                                    max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                                    seq_classif_dropout=0.0))),
             _classification(100, 0), {**TOKENS, "labels": {0: "batch"}}, _hf_loss),
        Case("RobertaForMaskedLM", _seeded(lambda: T.RobertaForMaskedLM(T.RobertaConfig(
                 **{**bert, "max_position_embeddings": 72}))),
             _language_model(100, 1, masked=True), {**TOKENS, "labels": {0: "batch", 1: "seq"}}, _hf_loss),
        Case("ViTForImageClassification", _seeded(lambda: T.ViTForImageClassification(T.ViTConfig(
                 image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=2, intermediate_size=37, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0, num_labels=3))),
             lambda b, s, g: {"pixel_values": torch.randn(b, 3, 32, 32, generator=g),
                              "labels": torch.randint(0, 3, (b,), generator=g)},
             {"pixel_values": {0: "batch"}, "labels": {0: "batch"}}, _hf_loss,
             shapes=[(4, 0), (6, 0), (2, 0), (4, 0), (3, 0)], time_shape=(16, 0)),
    ]  # fmt: skip
    return cases


# --------------------------------------------------------------------------- wrapper
class LossWrapper(nn.Module):
    """``model`` with the batch as positional tensors (named by ``forward``'s signature), returning the loss first.

    orttrainer's exporter passes inputs to ``forward`` by name and takes the first output as
    the loss; a Hugging Face model returns a ModelOutput, hence this wrapper. Its ``forward``
    has one named parameter per input (``wrapper_for``), so model_desc names map to it.
    """

    def __init__(self, model, loss):
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, *args, **kwargs):
        names = list(inspect.signature(self.forward).parameters)
        return self.loss(self.model, **dict(zip(names, args)), **kwargs)


def wrapper_for(case: Case, model: nn.Module) -> LossWrapper:
    names = list(case.dims)
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    parameters += [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in names]

    def forward(self, *args, **kwargs):
        return LossWrapper.forward(self, *args, **kwargs)

    forward.__signature__ = inspect.Signature(parameters)
    cls = type(f"LossOf{type(model).__name__}", (LossWrapper,), {"forward": forward})
    return cls(model, case.loss)


def model_desc(case: Case, batch: dict) -> dict:
    """Legacy model_desc: every axis in ``case.dims`` symbolic, the loss the only output."""
    inputs = [(name, [case.dims[name].get(axis, size) for axis, size in enumerate(batch[name].shape)])
              for name in case.dims]  # fmt: skip
    return {"inputs": inputs, "outputs": [("loss", [], True)]}


# -------------------------------------------------------------------------- helpers
def _short(error: BaseException, limit: int = 700) -> str:
    text = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", f"{type(error).__name__}: {error}").split())  # no terminal colours
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _shape_key(batch: dict) -> tuple:
    return tuple((name, tuple(tensor.shape)) for name, tensor in batch.items())


def _batches(case: Case, shapes) -> list:
    generator = torch.Generator().manual_seed(1)
    return [case.batch(b, s, generator) for b, s in shapes]


def torch_reference(case: Case, batches) -> list:
    """[(loss, {parameter name: value after the step})] of a plain torch SGD loop."""
    model = case.make().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    steps = []
    for batch in batches:
        optimizer.zero_grad()
        loss = case.loss(model, **batch)
        loss.backward()
        optimizer.step()
        steps.append((loss.item(), {name: p.detach().clone() for name, p in model.named_parameters()}))
    return steps


@dataclass
class Comparison:
    max_loss: float = 0.0
    max_weight: float = 0.0
    first_bad: str = ""  # "step i (shape): what"
    missing: list = field(default_factory=list)

    @property
    def ok(self):
        return not self.first_bad and not self.missing

    def add(self, step: int, shape, loss: float, weights: dict, reference):
        ref_loss, ref_weights = reference
        self.max_loss = max(self.max_loss, abs(loss - ref_loss))
        bad = [] if math.isclose(loss, ref_loss, rel_tol=RTOL, abs_tol=ATOL) else [f"loss {loss:.6g} vs {ref_loss:.6g}"]
        for name, expected in ref_weights.items():
            if name not in weights:
                if name not in self.missing:
                    self.missing.append(name)
                continue
            actual = weights[name]
            difference = (actual - expected).abs().max().item()
            self.max_weight = max(self.max_weight, difference)
            if not torch.allclose(actual, expected, rtol=RTOL, atol=ATOL) and len(bad) < 3:
                where = ""
                if expected.dim() == 2:  # which rows (an embedding's padding row, say)
                    close = torch.isclose(actual, expected, rtol=RTOL, atol=ATOL).all(dim=1)
                    rows = (~close).nonzero().flatten().tolist()
                    where = f" in rows {rows[:5]}{'...' if len(rows) > 5 else ''} of {expected.shape[0]}"
                bad.append(f"{name} max |diff| {difference:.2g}{where}")
        if bad and not self.first_bad:
            self.first_bad = f"step {step + 1} {shape}: " + "; ".join(bad)

    def describe(self) -> str:
        if self.missing:
            return f"weights missing from the trainer: {self.missing[:4]}"
        if self.first_bad:
            return f"DIFFERS from torch from {self.first_bad}"
        return f"= torch (max |diff| loss {self.max_loss:.1e}, weights {self.max_weight:.1e})"


def _shape_label(case, batch) -> str:
    return "x".join(str(d) for d in next(iter(batch.values())).shape) if case.dims else "?"


@contextlib.contextmanager
def _quiet():
    """Exporter chatter (progress lines, warnings) off the terminal."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


# --------------------------------------------------------------------------- route A
class _ExportClock:
    """Times orttrainer's own call of the TorchScript exporter inside train_step."""

    def __init__(self):
        self.original = orttrainer.export.export_to_onnx
        self.seconds = 0.0

    def __enter__(self):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return self.original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        orttrainer.export.export_to_onnx = timed
        return self

    def __exit__(self, *exc):
        orttrainer.export.export_to_onnx = self.original
        return False


@contextlib.contextmanager
def _python_if_held_to_shape(active: bool):
    """Route A': orttrainer's exporter with one policy changed, in this process only.

    orttrainer refuses a trace that turned a tensor into a Python bool (a Python ``if`` on a
    tensor). Under a per-shape cache an ``if`` on a *shape* is harmless; an ``if`` on *data*
    is not. Here such a warning is treated like orttrainer's other frozen values: the graph is
    held to the first batch's shapes, and the first batch of other values (same shapes) is
    exported again and must give the same graph, or orttrainer refuses loudly.
    """
    if not active:
        yield
        return
    missing = [name for name in ("_DIFFERENT", "_FROZEN_VALUE") if not hasattr(orttrainer.export, name)]
    if missing:
        raise RuntimeError(f"orttrainer.export no longer has {missing}: update _python_if_held_to_shape (route A')")
    saved = orttrainer.export._DIFFERENT, orttrainer.export._FROZEN_VALUE
    orttrainer.export._DIFFERENT = [entry for entry in saved[0] if "Python boolean" not in entry[0]]
    orttrainer.export._FROZEN_VALUE = saved[1] + "|Converting a tensor to a Python boolean"
    try:
        yield
    finally:
        orttrainer.export._DIFFERENT, orttrainer.export._FROZEN_VALUE = saved


def _torch_route_trainer(case, weights, batch, postprocess=None):
    model = case.make()
    if weights is not None:
        model.load_state_dict(weights)
    options = copy.deepcopy(OPTIONS)
    if postprocess is not None:  # orttrainer's public hook on the exported graph
        options["_internal_use"] = {"extra_postprocess": postprocess}
    return ORTTrainer(wrapper_for(case, model), model_desc(case, batch), optim.SGDConfig(lr=LR),
                      options=ORTTrainerOptions(options))  # fmt: skip


def _ort_step(trainer, batch) -> float:
    loss = trainer.train_step(**{name: batch[name] for name in (e.name for e in trainer.model_desc.inputs)})
    return float(loss[0] if isinstance(loss, (list, tuple)) else loss)


def _weights_of(trainer, prefix="model.") -> dict:
    """The trainer's weights named like the model's parameters (``prefix``: the wrapper's attribute, if any)."""
    return {name[len(prefix):]: tensor for name, tensor in trainer.state_dict(pytorch_format=True).items()
            if name.startswith(prefix)}  # fmt: skip


def _expand_where_inputs(model: onnx.ModelProto) -> int:
    """Where(c, x, y) -> Where(c, Expand(x, ...), Expand(y, ...)), each data input expanded to the output shape.

    onnxruntime-training's Where gradient (GetWhereGradient in orttraining/core/graph/gradient_builder.cc)
    is ``Where(c, dY, 0)`` / ``Where(c, 0, dY)``: it has the output's shape and is never summed
    over the axes along which the input was broadcast (Add, Mul, ... do that). Expand's gradient
    does sum them. Returns how many Where nodes were changed.
    """
    nodes, count = [], 0
    for node in model.graph.node:
        if node.op_type == "Where":
            condition, first, second = node.input
            for index, (value, other) in ((1, (first, second)), (2, (second, first))):
                base = f"{node.name or node.output[0]}.input{index}"
                nodes += [
                    onnx.helper.make_node("Shape", [condition], [f"{base}.condition_shape"], name=f"{base}.condition_shape"),
                    onnx.helper.make_node("Shape", [other], [f"{base}.other_shape"], name=f"{base}.other_shape"),
                    onnx.helper.make_node("Expand", [value, f"{base}.condition_shape"], [f"{base}.expanded1"], name=f"{base}.expand1"),
                    onnx.helper.make_node("Expand", [f"{base}.expanded1", f"{base}.other_shape"], [f"{base}.expanded"],
                                          name=f"{base}.expand2"),
                ]  # fmt: skip
                node.input[index] = f"{base}.expanded"
            count += 1
        nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return count


def _where_postprocess(model: onnx.ModelProto) -> None:
    """``_expand_where_inputs`` as orttrainer's ``_internal_use.extra_postprocess`` (changes the graph in place)."""
    _expand_where_inputs(model)


def _is_gradient_failure(text: str) -> bool:
    """An onnxruntime-training failure inside a gradient node (``<forward node>_Grad/...``)."""
    return "_Grad/" in text or "partial derivative" in text


def route_a(case: Case, batches, reference) -> dict:
    """Route A as orttrainer is now; if it refuses the model, route A' (see ``_python_if_held_to_shape``);
    if the gradient fails in onnxruntime-training, once more with ``_expand_where_inputs``."""
    result = _route_a(case, batches, reference, relaxed=False)
    if "export_s" not in result and "ExportError" in result["error"]:
        refusal = result["error"]
        result = _route_a(case, batches, reference, relaxed=True)
        result["refusal"] = refusal
    if "export_s" not in result and _is_gradient_failure(result["error"]):
        first = result
        result = _route_a(case, batches, reference, relaxed=first["relaxed"], postprocess=_where_postprocess)
        result["gradient_error"], result["refusal"] = first["error"], first.get("refusal")
        result = {key: value for key, value in result.items() if value is not None}
    return result


def _route_a(case: Case, batches, reference, relaxed: bool, postprocess=None) -> dict:
    with _python_if_held_to_shape(relaxed):
        result = _route_a_measured(case, batches, reference, postprocess)
    if "timed" in result:
        timed = result["timed"]

        def step():
            with _python_if_held_to_shape(relaxed):
                return timed()

        result["timed"] = step
    result["relaxed"] = relaxed
    return result


def _one_graph_verdicts(case, batches, trainer, prefix) -> list:
    """[(shape, ok|wrong|fails, text)]: one step of ``trainer`` from the untrained weights at each distinct shape."""
    initial = {"model": {"full_precision": {prefix + name: tensor.numpy()
                                            for name, tensor in case.make().state_dict().items()}}}  # fmt: skip
    verdicts, seen = [], set()
    for batch in batches:
        key = _shape_key(batch)
        if key in seen:
            continue
        seen.add(key)
        label = _shape_label(case, batch)
        comparison = Comparison()
        try:
            with _quiet():
                trainer.load_state_dict(initial, strict=False)
                loss = _ort_step(trainer, batch)
            comparison.add(0, label, loss, _weights_of(trainer, prefix), torch_reference(case, [batch])[0])
            verdicts.append((label, "ok" if comparison.ok else "wrong", comparison.describe()))
        except Exception as error:  # noqa: BLE001
            verdicts.append((label, "fails", _short(error, 300)))
    return verdicts


def _frozen_non_parameters(proto: onnx.ModelProto, model: nn.Module) -> list:
    """Float initializers that are not parameters (lifted constants, buffers): ORTTrainer must not train them."""
    parameters = {name for name, _ in model.named_parameters()}
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE)
    return [init.name for init in proto.graph.initializer if init.data_type in floats and init.name not in parameters]


def _raw_torchscript_trainer(case: Case, batch: dict, postprocess=None) -> ORTTrainer:
    """orttrainer's own TorchScript export (``export.export_to_onnx``, Python ``if`` allowed), handed to
    ORTTrainer as an ONNX model: nothing holds the graph to the shapes it was traced at."""
    model = case.make()
    module = orttrainer.export.module_for_export(wrapper_for(case, model))
    desc = model_desc(case, batch)
    with _python_if_held_to_shape(True), _quiet():
        proto, _, _ = orttrainer.export.export_to_onnx(
            module, [batch[name] for name in case.dims], None, list(case.dims), desc["inputs"],
            [(name, shape) for name, shape, _ in desc["outputs"]], 17)  # fmt: skip
    prefix = "model."  # the wrapper's attribute (orttrainer removed its own)
    _rename_initializers(proto, {i.name: i.name[len(prefix):] for i in proto.graph.initializer if i.name.startswith(prefix)})
    if postprocess is not None:
        postprocess(proto)
    options = copy.deepcopy(OPTIONS)
    options["utils"] = {"frozen_weights": _frozen_non_parameters(proto, model)}
    return ORTTrainer(proto, None, optim.SGDConfig(lr=LR), options=ORTTrainerOptions(options))


def _route_a_measured(case: Case, batches, reference, postprocess) -> dict:
    result = {}
    # 1. one graph per shape signature: export + build on each new shape, weights carried over
    cache, active, comparison = {}, None, Comparison()
    new_shape_seconds = []
    step, batch = 0, batches[0]
    try:
        for step, batch in enumerate(batches):
            key = _shape_key(batch)
            if key not in cache:
                weights = None if active is None else {k.removeprefix("model."): v for k, v in
                                                       active.state_dict(pytorch_format=True).items()}  # fmt: skip
                with _ExportClock() as clock, _quiet():
                    trainer = _torch_route_trainer(case, weights, batch, postprocess)
                    start = time.perf_counter()
                    loss = _ort_step(trainer, batch)
                    seconds = time.perf_counter() - start
                if active is None:
                    result["export_s"], result["build_s"] = clock.seconds, seconds - clock.seconds
                else:
                    new_shape_seconds.append(seconds)
                cache[key] = trainer
            else:
                trainer = cache[key]
                if trainer is not active:
                    trainer.load_state_dict(active.state_dict())
                start = time.perf_counter()
                with _quiet():
                    loss = _ort_step(trainer, batch)
                result.setdefault("first_reuse_s", time.perf_counter() - start)
            active = trainer
            comparison.add(step, _shape_label(case, batch), loss, _weights_of(trainer), reference[step])
        result["cache"] = comparison.describe()
        result["cache_ok"] = comparison.ok
    except Exception as error:  # noqa: BLE001 - the error text is the measurement
        result["cache"] = f"fails at step {step + 1} ({_shape_label(case, batch)}): {_short(error)}"
        result["cache_ok"] = False
        if "export_s" not in result:
            result["error"] = result["cache"]
            return result
    result["new_shape_s"] = statistics.median(new_shape_seconds) if new_shape_seconds else None
    del cache, active, trainer
    # 2. the graph traced at the first shape, one step from the untrained weights on every other shape
    result["one_graph"] = _one_graph_verdicts(case, batches, _torch_route_trainer(case, None, batches[0], postprocess), "model.")
    held = [text for _, verdict, text in result["one_graph"] if "only takes the first batch's shapes" in text]
    if held:  # orttrainer held the graph to its first shapes: what would the TorchScript graph itself do?
        result["one_graph_held"] = held[0]
        try:
            raw = _raw_torchscript_trainer(case, batches[0], postprocess)
            result["one_graph"] = _one_graph_verdicts(case, batches, raw, "")
        except Exception as error:  # noqa: BLE001
            result["one_graph_raw_error"] = _short(error)
    # 3. a graph for the timing shape (as the cache would build), timed later
    timing_batch = _batches(case, [case.time_shape])[0]
    try:
        with _quiet():
            trainer = _torch_route_trainer(case, None, timing_batch, postprocess)
            _ort_step(trainer, timing_batch)
        result["timed"] = lambda: _ort_step(trainer, timing_batch)
    except Exception as error:  # noqa: BLE001
        result["ms_error"] = _short(error)
    return result


# --------------------------------------------------------------------------- route B
def _cast_like_to_cast(model: onnx.ModelProto) -> int:
    """Replace every CastLike(x, like) by Cast(x, to=<like's element type>); return how many."""
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {info.name: info.type.tensor_type.elem_type
             for info in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)}
    types.update({init.name: init.data_type for init in model.graph.initializer})
    for node in model.graph.node:
        if node.op_type == "Constant":
            for attribute in node.attribute:
                if attribute.name == "value":
                    types[node.output[0]] = attribute.t.data_type
    count = 0
    for node in model.graph.node:
        if node.op_type != "CastLike":
            continue
        target = types.get(node.input[1], 0)
        if not target:
            raise ValueError(f"CastLike node {node.name}: element type of {node.input[1]} unknown")
        x = node.input[0]
        del node.input[:]
        node.input.append(x)
        del node.attribute[:]
        node.attribute.append(onnx.helper.make_attribute("to", target))
        node.op_type = "Cast"
        count += 1
    return count


def _tied_aliases(model: nn.Module) -> dict:
    """{state_dict name: named_parameters name} for parameters the module holds under several names."""
    canonical = {id(p): name for name, p in model.named_parameters()}
    return {name: canonical[id(t)] for name, t in model.state_dict(keep_vars=True).items()
            if id(t) in canonical and canonical[id(t)] != name}  # fmt: skip


def _rename_initializers(model: onnx.ModelProto, renames: dict) -> None:
    """Rename initializers (and their uses) by ``renames``."""
    renames = {init.name: renames[init.name] for init in model.graph.initializer if init.name in renames}

    def rename(graph):
        for init in graph.initializer:
            init.name = renames.get(init.name, init.name)
        for node in graph.node:
            for index, name in enumerate(node.input):
                node.input[index] = renames.get(name, name)
            for attribute in node.attribute:
                if attribute.HasField("g"):
                    rename(attribute.g)
                for subgraph in attribute.graphs:
                    rename(subgraph)
        for info in list(graph.value_info) + list(graph.input):
            info.name = renames.get(info.name, info.name)

    rename(model.graph)


def _constant_ints(model: onnx.ModelProto) -> dict:
    """{value name: list of ints} of integer Constant nodes and initializers."""
    values = {}
    for init in model.graph.initializer:
        if init.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32):
            values[init.name] = onnx.numpy_helper.to_array(init).reshape(-1).tolist()
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            tensor = node.attribute[0].t
            if tensor.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32):
                values[node.output[0]] = onnx.numpy_helper.to_array(tensor).reshape(-1).tolist()
    return values


def _sequence_split_to_slices(model: onnx.ModelProto) -> int:
    """SplitToSequence(x, constant split) read only by SequenceAt(constant i) -> one Slice per SequenceAt.

    onnxruntime-training has no gradient for sequence ops, so a weight before such a split
    (GPT-2's fused qkv projection, ``tensor.split``) is "unreachable from the output". Returns
    how many splits were rewritten.
    """
    constants = _constant_ints(model)
    readers = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    removed, replacement = set(), {}
    for node in model.graph.node:
        if node.op_type != "SplitToSequence" or len(node.input) < 2 or node.input[1] not in constants:
            continue
        users = readers.get(node.output[0], [])
        if not users or any(u.op_type != "SequenceAt" or u.input[1] not in constants for u in users):
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        split = constants[node.input[1]]
        slices = {}
        for user in users:
            index = constants[user.input[1]][0]
            if index < 0 or (len(split) > 1 and index >= len(split)):
                break
            start = index * split[0] if len(split) == 1 else sum(split[:index])
            end = start + (split[0] if len(split) == 1 else split[index])
            names = [f"{user.output[0]}.{part}" for part in ("starts", "ends", "axes")]
            bounds = [onnx.numpy_helper.from_array(np.array([v], dtype=np.int64), n) for n, v in zip(names, (start, end, axis))]
            slices[id(user)] = (onnx.helper.make_node("Slice", [node.input[0], *names], list(user.output),
                                                      name=f"{user.output[0]}.slice"), bounds)  # fmt: skip
        else:
            removed.add(id(node))
            for key, (slice_node, bounds) in slices.items():
                replacement[key] = slice_node
                model.graph.initializer.extend(bounds)
    nodes = [replacement.get(id(n), n) for n in model.graph.node if id(n) not in removed]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return len(removed)


def _to_onnx(case: Case, wrapper: nn.Module, batch: dict, dynamic_shapes: dict, decompose_first: bool):
    with _quiet():
        if not decompose_first:  # route B as specified
            return torch.onnx.export(wrapper, (), kwargs=batch, dynamo=True, dynamic_shapes=dynamic_shapes,
                                     optimize=False, training=TrainingMode.TRAINING)  # fmt: skip
        # fallback: torch.export with torch's default decompositions first, then the ONNX exporter
        program = torch.export.export(wrapper, (), kwargs=batch, dynamic_shapes=dynamic_shapes).run_decompositions()
        return torch.onnx.export(program, (), kwargs=batch, dynamo=True, optimize=False)


def _parameters_kept_if_optimized(program, model: nn.Module):
    """How many parameters would still be initializers of their own name (or a tied alias's) with optimize=True."""
    try:
        with _quiet():
            program.optimize()  # in place: ``program.model_proto`` was read before
    except Exception as error:  # noqa: BLE001
        return _short(error, 200)
    names = {init.name.removeprefix("model.") for init in program.model_proto.graph.initializer}
    aliases = {}
    for alias, canonical in _tied_aliases(model).items():
        aliases.setdefault(canonical, []).append(alias)
    return sum(1 for name, _ in model.named_parameters() if name in names or any(a in names for a in aliases.get(name, [])))


def dynamo_export(case: Case, model: nn.Module, batch: dict, decompose_first: bool = False):
    """torch.export -> ONNX with every axis in ``case.dims`` dynamic; returns (ModelProto, notes)."""
    wrapper = wrapper_for(case, model).train()
    dims = {}
    for axes in case.dims.values():
        for name in axes.values():
            dims.setdefault(name, torch.export.Dim(name, min=case.dim_min.get(name, 2), max=1024))
    dynamic_shapes = {name: {axis: dims[dim] for axis, dim in case.dims[name].items()} for name in case.dims}
    program = _to_onnx(case, wrapper, batch, dynamic_shapes, decompose_first)
    proto = program.model_proto
    started = time.perf_counter()
    kept_if_optimized = _parameters_kept_if_optimized(program, model)
    optimize_check_s = time.perf_counter() - started  # not part of route B: subtracted from its export time
    if proto.functions:
        proto = onnx.inliner.inline_local_functions(proto)
    prefix = "model."  # the wrapper's attribute
    _rename_initializers(proto, {i.name: i.name[len(prefix):] for i in proto.graph.initializer if i.name.startswith(prefix)})
    # torch.export names a tied parameter by one of its names, not always named_parameters()'s
    parameters = {name for name, _ in model.named_parameters()}
    names = {i.name for i in proto.graph.initializer}
    # (if both names were initializers, the tie would be lost: left as is, the check below shows it)
    tied = {name: canonical for name, canonical in _tied_aliases(model).items() if name in names and canonical not in names}
    unmapped = [name for name in parameters if name not in names]
    _rename_initializers(proto, tied)
    notes = {"unmapped_as_exported": unmapped, "tied_renamed": tied, "kept_if_optimized": kept_if_optimized,
             "optimize_check_s": optimize_check_s,
             "opset": next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")),
             "ir": proto.ir_version, "castlike": _cast_like_to_cast(proto)}  # fmt: skip
    proto.ir_version = min(proto.ir_version, 10)
    del proto.graph.output[1:]  # the loss is the only output
    return proto, notes


def route_b(case: Case, batches, reference) -> dict:
    result = {}
    model = case.make()
    start = time.perf_counter()
    try:
        proto, notes = dynamo_export(case, model, batches[0])
    except Exception as error:  # noqa: BLE001
        result["export_error"] = _short(error)
        result["failed_export_s"] = time.perf_counter() - start
        try:
            start = time.perf_counter()
            proto, notes = dynamo_export(case, model, batches[0], decompose_first=True)
        except Exception as second:  # noqa: BLE001
            result["error"] = f"export fails: {_short(error)}; with torch.export + run_decompositions() first: {_short(second)}"
            return result
    result.update(notes)
    result["export_s"] = time.perf_counter() - start - notes["optimize_check_s"]
    initializers = {init.name: init for init in proto.graph.initializer}
    parameters = [name for name, p in model.named_parameters() if p.requires_grad]
    result["unmapped"] = [name for name in parameters if name not in initializers]
    result["params"] = len(parameters)
    frozen = _frozen_non_parameters(proto, model)
    result["frozen"] = len(frozen)
    symbolic = sorted({d.dim_param for i in proto.graph.input for d in i.type.tensor_type.shape.dim if d.dim_param})
    result["symbolic"] = symbolic
    options = copy.deepcopy(OPTIONS)
    options["utils"] = {"frozen_weights": frozen}
    if any(node.op_type == "SplitToSequence" for node in proto.graph.node):
        try:  # as exported, to record why the rewrite is needed
            with _quiet():
                ORTTrainer(copy.deepcopy(proto), None, optim.SGDConfig(lr=LR), options=ORTTrainerOptions(options))
        except Exception as error:  # noqa: BLE001
            result["sequence_error"] = _short(error)
            result["sequence_rewritten"] = _sequence_split_to_slices(proto)
    trainer = _train_one_graph(case, proto, options, batches, reference, result)
    if trainer is None and _is_gradient_failure(result["one_graph"]):
        result["gradient_error"] = result.pop("one_graph")
        result.pop("error", None)
        result["where_rewritten"] = _expand_where_inputs(proto)
        trainer = _train_one_graph(case, proto, options, batches, reference, result)
    if trainer is None:
        return result
    timing_batch = _batches(case, [case.time_shape])[0]
    try:
        with _quiet():
            _ort_step(trainer, timing_batch)
        result["timed"] = lambda: _ort_step(trainer, timing_batch)
    except Exception as error:  # noqa: BLE001
        result["ms_error"] = f"the same graph at {_shape_label(case, timing_batch)}: {_short(error)}"
    return result


def _train_one_graph(case, proto, options, batches, reference, result):
    """Route B's one graph trained over every batch and compared with torch step by step; the trainer or None."""
    comparison = Comparison()
    step, batch = 0, batches[0]
    try:
        with _quiet():
            start = time.perf_counter()
            trainer = ORTTrainer(copy.deepcopy(proto), None, optim.SGDConfig(lr=LR), options=ORTTrainerOptions(options))
            for step, batch in enumerate(batches):
                loss = _ort_step(trainer, batch)
                if step == 0:
                    result["build_s"] = time.perf_counter() - start
                comparison.add(step, _shape_label(case, batch), loss, _weights_of(trainer, ""), reference[step])
        result["one_graph"] = comparison.describe()
        result["one_graph_ok"] = comparison.ok and not result["unmapped"]
        return trainer
    except Exception as error:  # noqa: BLE001
        result["one_graph"] = f"fails at step {step + 1} ({_shape_label(case, batch)}): {_short(error)}"
        result["one_graph_ok"] = False
        if "build_s" not in result:
            result["error"] = f"build fails: {_short(error)}"
        return None


def torch_step(case: Case):
    """An eager torch SGD step on the timing shape, for scale."""
    model = case.make().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    batch = _batches(case, [case.time_shape])[0]

    def step():
        optimizer.zero_grad()
        case.loss(model, **batch).backward()
        optimizer.step()

    return step


def time_interleaved(steps: dict) -> dict:
    """{name: (median ms, min ms)} of ``TIMED_STEPS`` steps each, in rounds that alternate the contenders
    (so that load from elsewhere on the machine hits all alike), after ``WARMUP_STEPS``; and under
    "B/A" the median over rounds of the ratio of the two routes' medians in that round (paired)."""
    durations = {name: [] for name in steps}
    rounds = {name: [] for name in steps}
    with _quiet():
        for step in steps.values():
            for _ in range(WARMUP_STEPS):
                step()
        for index in range(ROUNDS):
            order = list(steps.items())
            order = order[index % len(order):] + order[: index % len(order)]
            for name, step in order:
                this_round = []
                for _ in range(TIMED_STEPS // ROUNDS):
                    start = time.perf_counter()
                    step()
                    this_round.append((time.perf_counter() - start) * 1e3)
                durations[name] += this_round
                rounds[name].append(statistics.median(this_round))
    timings = {name: (statistics.median(values), min(values)) for name, values in durations.items()}
    if "A" in rounds and "B" in rounds:
        timings["B/A"] = statistics.median(b / a for a, b in zip(rounds["A"], rounds["B"]))
    return timings


# ---------------------------------------------------------------------------- report
def _seconds(value) -> str:
    return "—" if value is None else f"{value:.2f}"


def _ms(result: dict) -> str:
    """median (min) ms."""
    return f"{result['ms'][0]:.1f} ({result['ms'][1]:.1f})" if "ms" in result else "—"


def _one_graph_cell(verdicts) -> str:
    """Route A, graph traced at the first shape: the verdict at each other shape."""
    groups = {}
    for label, verdict, _ in verdicts[1:]:
        groups.setdefault(verdict, []).append(label)
    words = {"ok": "ok", "wrong": "**silently wrong**", "fails": "fails loudly"}
    return "; ".join(f"{words[v]} {', '.join(labels)}" for v, labels in groups.items()) or "—"


def _a_one_graph_cell(a: dict) -> str:
    cell = _one_graph_cell(a.get("one_graph", []))
    if "one_graph_held" in a:
        return "orttrainer refuses; raw graph: " + ("fails: see below" if "one_graph_raw_error" in a else cell)
    return cell


def row(case: Case, a: dict, b: dict) -> str:
    shape = "x".join(map(str, case.time_shape)) if case.time_shape[1] else f"{case.time_shape[0]}x3x32x32"
    if "export_s" not in a:
        a_cells = ["fails", "—", "—", "—", "—", "—"]
    else:
        label = ("refuses; A'" if a.get("relaxed") else "") + (" + Where rewrite" if a.get("gradient_error") else "")
        a_cells = [(f"{label.strip()}: " if label else "") + _seconds(a.get("export_s")),
                   _seconds(a.get("build_s")), _seconds(a.get("new_shape_s")),
                   "ok" if a.get("cache_ok") else "**no**", _a_one_graph_cell(a), _ms(a)]  # fmt: skip
    if "export_s" not in b:
        b_cells = ["fails", "—", "—", "—", "—"]
    else:
        mapped = f"{b['params'] - len(b['unmapped'])}/{b['params']}"
        if b["unmapped_as_exported"]:
            mapped = f"{b['params'] - len(b['unmapped_as_exported'])}/{b['params']} as exported, {mapped} after renaming tied aliases"
        verdict = "ok" if b.get("one_graph_ok") else ("**wrong**" if "DIFFERS" in b.get("one_graph", "") else "fails")
        rewrites = [name for key, name in (("sequence_rewritten", "Split rewrite"), ("where_rewritten", "Where rewrite"))
                    if b.get(key)]  # fmt: skip
        if rewrites and "export_s" in b:
            verdict += f" (after {' + '.join(rewrites)})"
        export_cell = ("fails; fallback: " if "export_error" in b else "") + _seconds(b.get("export_s"))
        b_cells = [export_cell, _seconds(b.get("build_s")), mapped, verdict, _ms(b)]
    eager = f"{b['eager_ms'][0]:.1f} ({b['eager_ms'][1]:.1f})" if "eager_ms" in b else "—"
    ratio = f"{b['ratio']:.2f}" if "ratio" in b else "—"
    return "| " + " | ".join([case.name] + a_cells + b_cells + [ratio, eager, shape]) + " |"


HEADER = (
    "| model | A export s | A build s | A new shape s | A cache, all shapes = torch | A graph of shape 1 at other shapes "
    "| A ms/step | B export s | B build s | B params as initializers | B one graph, all shapes = torch | B ms/step "
    "| B/A step time | torch eager ms | timed shape |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def details(case: Case, a: dict, b: dict, update: float) -> list:
    shapes = case.shapes if any(seq for _, seq in case.shapes) else [(batch,) for batch, _ in case.shapes]
    lines = [f"**{case.name}** — shapes ({'batch, seq' if len(shapes[0]) == 2 else 'batch'}) in training order {shapes}; SGD lr {LR}, "
             f"largest weight change over the run {update:.1e}"]  # fmt: skip
    if a.get("relaxed"):
        lines.append(f"- A as orttrainer is now: {a['refusal']}")
        lines.append("- A' (the same, with a Python `if` on a tensor held to the first batch's shapes and re-checked "
                     "with other values, see `_python_if_held_to_shape`):")
    if a.get("gradient_error"):
        lines.append(f"- A fails in onnxruntime-training: {a['gradient_error']}; again with every Where's data inputs "
                     "expanded to its output shape (`_expand_where_inputs`, through options "
                     "`_internal_use.extra_postprocess`):")
    lines.append(f"- A, one graph per shape: {a.get('cache', '—')}")
    if "first_reuse_s" in a:
        lines.append(f"- A, first step on a cached graph with a new batch: {a['first_reuse_s']:.2f} s"
                     + (" (A' exports once more to check that the trace does not depend on the batch's values)"
                        if a.get("relaxed") else ""))
    if "one_graph_held" in a:
        lines.append(f"- A, graph traced at {shapes[0]}, at other shapes: orttrainer refuses them, e.g. "
                     f"{a['one_graph_held']}; the same TorchScript graph given to ORTTrainer as an ONNX model:")
    if "one_graph_raw_error" in a:
        lines.append(f"- A, raw TorchScript graph: {a['one_graph_raw_error']}")
    for label, verdict, text in a.get("one_graph", []):
        lines.append(f"- A, graph traced at {shapes[0]}, one step at {label}: {text}")
    if "ms_error" in a:
        lines.append(f"- A, timing: {a['ms_error']}")
    if "export_s" in b:
        lines.append(f"- B: opset {b['opset']}, IR {b['ir']} -> 10, {b['castlike']} CastLike -> Cast, "
                     f"symbolic input dims {b['symbolic']}, {b['frozen']} non-parameter float initializers frozen; "
                     f"with optimize=True {b['kept_if_optimized']}/{b['params']} parameters would remain initializers of "
                     f"their name; parameters not initializers as exported: {b['unmapped_as_exported'] or 'none'}"
                     + (f", renamed (tied aliases): {b['tied_renamed']}" if b["tied_renamed"] else "")
                     + f"; after renaming: {b['unmapped'] or 'none'}")  # fmt: skip
        if "export_error" in b:
            lines.append(f"- B as specified fails to export (after {b['failed_export_s']:.1f} s): {b['export_error']}; exported instead through "
                         "`torch.export.export(...).run_decompositions()` then `torch.onnx.export(program)`")
        if "sequence_error" in b:
            lines.append(f"- B as exported fails to build: {b['sequence_error']}; after rewriting "
                         f"{b['sequence_rewritten']} SplitToSequence+SequenceAt into Slice (`_sequence_split_to_slices`):")
        if "gradient_error" in b:
            lines.append(f"- B fails in onnxruntime-training: {b['gradient_error']}; again after expanding the data "
                         f"inputs of {b['where_rewritten']} Where nodes (`_expand_where_inputs`):")
        lines.append(f"- B, one graph, every shape: {b.get('one_graph', '—')}")
    else:
        lines.append(f"- B: {b.get('error')}")
    if "ms_error" in b:
        lines.append(f"- B, timing: {b['ms_error']}")
    return lines


def warm_up_exporters() -> dict:
    """First-call cost of each exporter (imports, registries), paid once per process, on nn.Linear."""
    seconds = {}
    for name, dynamo in (("TorchScript", False), ("dynamo", True)):
        start = time.perf_counter()
        with _quiet():
            torch.onnx.export(nn.Linear(2, 2), (torch.randn(3, 2),), io.BytesIO() if not dynamo else None,
                              dynamo=dynamo, optimize=False)  # fmt: skip
        seconds[name] = time.perf_counter() - start
    return seconds


LEGEND = [
    "Columns. **A**: orttrainer's TorchScript export (`dynamic_axes` on every batch/seq axis), one graph per input "
    "shape signature; *export s* is orttrainer's `export_to_onnx` inside the first `train_step`, *build s* the rest of "
    "that step (gradient graph, sessions, one step), *new shape s* the median first `train_step` of a graph for a new "
    "shape (export + build). *A cache, all shapes = torch*: training over the shape sequence (weights carried from "
    "graph to graph) equals torch SGD at every step. *A graph of shape 1 at other shapes*: one step from the untrained "
    "weights at each other shape through the graph traced at the first shape. **A'**: orttrainer refuses every "
    "Hugging Face model here (a Python `if` on a tensor in transformers' mask code); A' is the same exporter with that "
    "refusal turned into orttrainer's existing hold-to-first-shapes check (`_python_if_held_to_shape`), which is what "
    "a per-shape cache needs. **B**: `torch.onnx.export(dynamo=True, dynamic_shapes=..., optimize=False)` once, "
    "CastLike -> Cast, IR 10, tied parameters renamed to their `named_parameters()` name, non-parameter float "
    "initializers frozen, then the `onnx.ModelProto` given to ORTTrainer; *export s* includes torch.export; *build s* "
    "is the ORTTrainer constructor + first `train_step`. *B one graph, all shapes = torch*: the one graph trained over "
    "the whole shape sequence equals torch SGD at every step (loss and every parameter, rtol 1e-4, atol 1e-5). "
    f"*ms/step*: median of {TIMED_STEPS} `train_step`s (SGD) on the timed shape after {WARMUP_STEPS} warm-up steps, "
    f"the contenders timed in {ROUNDS} alternating rounds, as median (min); *B/A step time* is the median over rounds of "
    "B's round median over A's (paired, so that load from other processes cancels); eager torch for scale. The built-in first-step check against torch is off everywhere "
    "(`debug.check_against_torch`, its cost is in `check_cost.md`). Rewrites named in a cell were applied only after "
    "the unrewritten graph failed (the failure is quoted below the table).",
]


def environment() -> list:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()[:10]
    versions = {name: metadata.version(name) for name in
                ["torch", "onnx", "onnxscript", "onnx-ir", "onnxruntime-training", "transformers", "numpy"]}  # fmt: skip
    return [
        f"Measured {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.machine()}, {os.cpu_count()} cores, "
        f"torch threads {torch.get_num_threads()}, Python {platform.python_version()}.",
        "",
        "Versions: " + ", ".join(f"{name} {version}" for name, version in versions.items()) + ".",
        "",
        "```",
        *lscpu,
        "```",
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", help="run the models whose name contains this (case-insensitive); writes no file")
    arguments = parser.parse_args()
    cases = [c for c in make_cases() if not arguments.only or arguments.only.lower() in c.name.lower()]
    started = time.perf_counter()
    warm = warm_up_exporters()
    rows, notes = [], []
    for case in cases:
        print(f"--- {case.name}", file=sys.stderr, flush=True)
        batches = _batches(case, case.shapes)
        reference = torch_reference(case, batches)
        initial = dict(case.make().named_parameters())
        update = max((reference[-1][1][n] - p.detach()).abs().max().item() for n, p in initial.items())
        a = route_a(case, batches, reference)
        b = route_b(case, batches, reference)
        steps = {"A": a.pop("timed", None), "B": b.pop("timed", None), "eager": torch_step(case)}
        timings = time_interleaved({name: step for name, step in steps.items() if step is not None})
        a["ms"], b["ms"], b["eager_ms"], b["ratio"] = timings.get("A"), timings.get("B"), timings["eager"], timings.get("B/A")
        a = {k: v for k, v in a.items() if v is not None}
        b = {k: v for k, v in b.items() if v is not None}
        del steps
        gc.collect()
        rows.append(row(case, a, b))
        notes += details(case, a, b, update) + [""]
        print(rows[-1], file=sys.stderr, flush=True)
    table = [HEADER, *rows]
    total = time.perf_counter() - started
    load = " / ".join(f"{value:.1f}" for value in os.getloadavg())
    preamble = [f"Load average at the end of the run (1/5/15 min): {load} on {os.cpu_count()} cores: other processes "
                "shared the machine, so absolute ms are noisy; compare within a row.", "",
                f"One-time exporter start-up (first export in the process, nn.Linear): TorchScript "
                f"{warm['TorchScript']:.2f} s, dynamo {warm['dynamo']:.2f} s (not counted in the export times below). "
                f"Whole run {total:.0f} s.", ""]  # fmt: skip
    print("\n".join(preamble + table))
    print()
    print("\n".join(notes))
    if not arguments.only:
        RESULTS.mkdir(exist_ok=True)
        text = ["# Export routes for changing batch shapes and Hugging Face models", "",
                "Written by `python benchmarks/export_routes.py`.", "", *environment(), "", *preamble, *LEGEND, "",
                *table, "",
                *notes]  # fmt: skip
        (RESULTS / "export_routes.md").write_text("\n".join(text) + "\n")


if __name__ == "__main__":
    main()
