"""Dynamically padded batches, orttrainer against torch eager: whole-run time, peak RSS, graphs built (issue 44 §5).

Every batch is padded to its own longest sequence, as Hugging Face's ``DataCollatorWithPadding`` does by default
(no ``pad_to_multiple_of``), so the batch shapes change from step to step, and orttrainer may export the model
again at a new shape and build another graph where the trace needs one (runtime/graph_cache.py). What that costs
over a whole run is measured here, from model construction to the end of the last step, every export, graph
build, session and first-step check included.

Rows (tiny random-init configs built in code, nothing downloaded; every dropout 0, so the losses compare):
- bert-classifier: BertForSequenceClassification, 4 layers x 256 (4 heads, FFN 1024), vocab 30522, 2 labels;
- gpt2-classifier: GPT2ForSequenceClassification, 4 layers x 256 (4 heads), vocab 30522, pad_token_id 0, 2 labels;
- gpt2-lm: GPT2LMHeadModel, 4 x 256, labels = input_ids with the padding -100;
- t5-seq2seq: T5ForConditionalGeneration, d_model 256, 4 + 4 layers, 4 heads, d_ff 1024; source and target lengths
  drawn independently (the target padded with -100, as DataCollatorForSeq2Seq pads labels);
- cnn-three-sizes: a small ResNet (basic blocks with BatchNorm, defined here), images of 32, 48 and 64 pixels in
  turn, 10 classes, the same batch size;
- hf-trainer: the BERT classifier through ``orttrainer.hf.Trainer`` against ``transformers.Trainer`` (the "torch
  eager" contender), a plain ``DataCollatorWithPadding`` over an in-memory dataset of random token ids, Trainer's
  defaults (adamw_torch, linear decay, max_grad_norm 1.0) but learning_rate 1e-4; same seed for both.

Workload: 40 batches of 16 sequences, each of a length drawn uniformly in 16..128 tokens, attention_mask 0 on the
padding; the same batches for both contenders (a seeded generator). The other rows train with AdamW lr 1e-4 (torch:
torch.optim.AdamW's defaults otherwise, zero_grad, forward, backward, step; orttrainer: the AdamConfig that is torch's
AdamW, as benchmarks/bench.py passes it, with utils.grad_norm_clip False, since a torch loop does not clip, and
otherwise the default ORTTrainerOptions on {"device": {"id": "cpu"}}: the first-step check on).

Each contender runs each row in a fresh process of its own (``dynamic_lengths.py --child``), one at a time, in rounds
that interleave the contenders (their order alternating from round to round), so that a shared host's load falls on
both alike. A run reports its wall and CPU time (the process's, all threads), its peak RSS (getrusage ru_maxrss of
the child, imports included), every step's loss, the distinct padded shapes it saw ("distinct lengths": T5's are
(source, target) pairs, the CNN's image sizes), and for orttrainer the graphs
built (``graphs_built``) and the time of each kind of build phase (exports, gradient graphs, sessions, checks). The
table gives medians over the rounds and the largest relative difference of a step's loss from torch's.
Threads: torch's and ONNX Runtime's defaults (both use every core; 2 on the project's machine), as a user runs them.

    python benchmarks/dynamic_lengths.py                     # every row, 3 rounds: results/dynamic_lengths.{json,md,png}
    python benchmarks/dynamic_lengths.py --quick             # 6 batches of 4, lengths 8..24, 1 round, to a temp dir
    python benchmarks/dynamic_lengths.py --quick --rows bert-classifier,cnn-three-sizes --out /tmp/dl
    python benchmarks/dynamic_lengths.py --rows t5-seq2seq --add  # run one row again, keep the others of the JSON
    python benchmarks/dynamic_lengths.py --rows gpt2-lm --rounds 1 --out /tmp/dl

--quick takes about a minute for two small rows on the 2-core machine and never writes to benchmarks/results/. The
full run has not been timed here: on 2 cores expect tens of minutes (each orttrainer run exports once per new shape).
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from children import child_result, merged_rows

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
STEM = "dynamic_lengths"
CONTENDERS = ("torch eager", "orttrainer")
ADAMW = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}  # torch.optim.AdamW's defaults, lr 1e-4
VOCAB, PAD = 30522, 0  # BERT's vocabulary size; token ids are drawn from 3.. (0: padding)
WIDTH, LAYERS, HEADS, FFN = 256, 4, 4, 1024
IMAGE_SIZES, CLASSES = (32, 48, 64), 10
SETTINGS = {"full": {"batches": 40, "batch": 16, "lengths": [16, 128]},
            "quick": {"batches": 6, "batch": 4, "lengths": [8, 24]}}  # fmt: skip

ROWS = {
    "bert-classifier": f"BertForSequenceClassification {LAYERS} x {WIDTH}, vocab {VOCAB}, 2 labels",
    "gpt2-classifier": f"GPT2ForSequenceClassification {LAYERS} x {WIDTH}, vocab {VOCAB}, 2 labels",
    "gpt2-lm": f"GPT2LMHeadModel {LAYERS} x {WIDTH}, vocab {VOCAB}",
    "t5-seq2seq": f"T5ForConditionalGeneration d_model {WIDTH}, {LAYERS} + {LAYERS} layers, vocab {VOCAB}",
    "cnn-three-sizes": f"ResNet-like CNN with BatchNorm, images {'/'.join(map(str, IMAGE_SIZES))} px, {CLASSES} classes",
    "hf-trainer": "BERT classifier, orttrainer.hf.Trainer vs transformers.Trainer, DataCollatorWithPadding",
}

MODEL_CLASSES = {"bert-classifier": ("BertConfig", "BertForSequenceClassification"),
                 "hf-trainer": ("BertConfig", "BertForSequenceClassification"),
                 "gpt2-classifier": ("GPT2Config", "GPT2ForSequenceClassification"),
                 "gpt2-lm": ("GPT2Config", "GPT2LMHeadModel"),
                 "t5-seq2seq": ("T5Config", "T5ForConditionalGeneration")}  # fmt: skip


# ----------------------------------------------------------------------------- child
def graphs_built(trainer):
    """The graphs an ORTTrainer has built so far (None if unknown). orttrainer has no public count: this reads the
    private ``ORTTrainer._graphs``, a runtime/graph_cache.py GraphCache whose ``built`` counts every graph built,
    dropped ones included. Change it here if that moves."""
    return getattr(getattr(trainer, "_graphs", None), "built", None)


def make_model(row):
    if row == "cnn-three-sizes":
        return small_resnet()
    import transformers

    if row in ("bert-classifier", "hf-trainer"):
        config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS,
                                         num_attention_heads=HEADS, intermediate_size=FFN, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0, pad_token_id=PAD, num_labels=2)  # fmt: skip
        return transformers.BertForSequenceClassification(config)
    if row in ("gpt2-classifier", "gpt2-lm"):
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=512, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
                                         bos_token_id=1, eos_token_id=2, pad_token_id=PAD, num_labels=2)  # fmt: skip
        model = transformers.GPT2ForSequenceClassification if row == "gpt2-classifier" else transformers.GPT2LMHeadModel
        return model(config)
    if row == "t5-seq2seq":
        config = transformers.T5Config(vocab_size=VOCAB, d_model=WIDTH, d_kv=WIDTH // HEADS, d_ff=FFN, num_layers=LAYERS,
                                       num_decoder_layers=LAYERS, num_heads=HEADS, dropout_rate=0.0, pad_token_id=PAD,
                                       eos_token_id=1, decoder_start_token_id=PAD)  # fmt: skip
        return transformers.T5ForConditionalGeneration(config)
    raise ValueError(f"no row {row!r}")


def small_resnet():
    """A CIFAR-style ResNet for any image size: a 3x3 stem, three stages of two basic blocks (widths 16, 32, 64, the
    last two starting at stride 2), BatchNorm after every convolution, global average pooling, a linear head."""
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, inputs, width, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(inputs, width, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(width)
            self.shortcut = nn.Sequential()
            if stride != 1 or inputs != width:
                self.shortcut = nn.Sequential(nn.Conv2d(inputs, width, 1, stride, bias=False), nn.BatchNorm2d(width))

        def forward(self, x):
            out = self.bn1(self.conv1(x)).relu()
            return (self.bn2(self.conv2(out)) + self.shortcut(x)).relu()

    layers, inputs = [nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()], 16
    for width, stride in ((16, 1), (32, 2), (64, 2)):
        layers += [Block(inputs, width, stride), Block(width, width, 1)]
        inputs = width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inputs, CLASSES))


def _padded(generator, settings):
    """Token ids of ``batch`` sequences of lengths drawn in ``lengths``, padded to the longest (PAD), and the mask."""
    import torch

    low, high = settings["lengths"]
    lengths = torch.randint(low, high + 1, (settings["batch"],), generator=generator)
    longest = int(lengths.max())
    mask = (torch.arange(longest)[None, :] < lengths[:, None]).long()
    ids = torch.randint(3, VOCAB, (settings["batch"], longest), generator=generator).masked_fill(mask == 0, PAD)
    return ids, mask


def make_batches(row, settings):
    """The row's batches (the same for both contenders): dicts of keywords (labels included), or (images, labels)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    batches = []
    for index in range(settings["batches"]):
        if row == "cnn-three-sizes":
            size = IMAGE_SIZES[index % len(IMAGE_SIZES)]
            batches.append((torch.randn(settings["batch"], 3, size, size, generator=generator),
                            torch.randint(0, CLASSES, (settings["batch"],), generator=generator)))  # fmt: skip
            continue
        ids, mask = _padded(generator, settings)
        if row == "gpt2-lm":
            batches.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
        elif row == "t5-seq2seq":
            target, target_mask = _padded(generator, settings)
            labels = target.masked_fill(target_mask == 0, -100)
            batches.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
        else:
            batches.append({"input_ids": ids, "attention_mask": mask,
                            "labels": torch.randint(0, 2, (settings["batch"],), generator=generator)})  # fmt: skip
    return batches


def _shape_of(row, batch):
    """The padded shape that decides the graph: the sequence length (T5: source and target), or the image size."""
    if row == "cnn-three-sizes":
        return [int(batch[0].shape[-1])]
    return [int(batch["input_ids"].shape[1])] + ([int(batch["labels"].shape[1])] if row == "t5-seq2seq" else [])


def _orttrainer_config():
    """(config, options) of orttrainer's AdamW: torch.optim.AdamW's update (bench.py's settings), no clipping."""
    from orttrainer import ORTTrainerOptions, optim

    config = optim.AdamConfig(lr=ADAMW["lr"], alpha=ADAMW["betas"][0], beta=ADAMW["betas"][1], epsilon=ADAMW["eps"],
                              lambda_coef=ADAMW["weight_decay"])  # fmt: skip
    return config, ORTTrainerOptions({"device": {"id": "cpu"}, "utils": {"grad_norm_clip": False}})


def _time_phases(phases):
    """Replace orttrainer's progress.phase (first_step.py's way) to add up each kind of build phase:
    {"export" | "graph" | "sessions" | "check": [count, seconds]}."""
    import contextlib

    from orttrainer import progress

    kinds = {"exported": "export", "built": "graph", "opened": "sessions", "checked": "check"}

    @contextlib.contextmanager
    def timed_phase(done):
        start = time.perf_counter()
        yield
        kind = kinds.get(done.split()[0], done.split()[0])
        count, seconds = phases.get(kind, [0, 0.0])
        phases[kind] = [count + 1, seconds + time.perf_counter() - start]

    progress.phase = timed_phase


def _loop(row, contender, batches, result):
    """Construct the model and train it on ``batches`` with ``contender``; the losses into ``result``."""
    import torch
    from workloads import train_on

    loss_fn = torch.nn.functional.cross_entropy if row == "cnn-three-sizes" else None
    torch.manual_seed(0)
    model = make_model(row)
    model.train()
    if contender == "torch eager":
        optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)

        def step(batch):  # bench._torch_step's order
            optimizer.zero_grad(set_to_none=True)
            loss = model(**batch).loss if isinstance(batch, dict) else loss_fn(model(*batch[:-1]), batch[-1])
            loss.backward()
            optimizer.step()
            return loss
    else:
        from orttrainer import ORTTrainer

        config, options = _orttrainer_config()
        trainer = ORTTrainer(model, None, config, loss_fn=loss_fn, options=options)
        result["graphs_built"] = 0

        def step(batch):
            outputs = train_on(trainer, batch)
            result["graphs_built"] = graphs_built(trainer)
            return outputs.loss if hasattr(outputs, "loss") else outputs[0] if isinstance(outputs, list) else outputs

    for batch in batches:
        start = time.perf_counter()
        result["losses"].append(float(step(batch)))
        result["step_times"].append(time.perf_counter() - start)


def _hf_dataset(settings, shapes):
    """(rows, collate) of the hf-trainer row: tokenized examples of random ids, as ``dataset.map(tokenizer)`` gives
    them, and a plain DataCollatorWithPadding that records each batch's padded length into ``shapes``."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models

    generator = torch.Generator().manual_seed(0)
    low, high = settings["lengths"]
    rows = []
    for _ in range(settings["batches"] * settings["batch"]):
        length = int(torch.randint(low, high + 1, (), generator=generator))
        rows.append({"input_ids": torch.randint(3, VOCAB, (length,), generator=generator).tolist(),
                     "label": int(torch.randint(0, 2, (), generator=generator))})  # fmt: skip
    # the collator needs a tokenizer only for pad(): a WordLevel one made in code (nothing downloaded), pad id PAD
    words = Tokenizer(models.WordLevel({"[PAD]": PAD, "[UNK]": 1}, unk_token="[UNK]"))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="[PAD]", unk_token="[UNK]")
    pad = transformers.DataCollatorWithPadding(tokenizer, return_tensors="pt")  # no pad_to_multiple_of

    def collate(features):
        batch = pad(features)
        shapes.append([int(batch["input_ids"].shape[1])])
        return batch

    return rows, collate


def _hf_trainer(contender, dataset, result, directory):
    """The BERT classifier trained by transformers.Trainer or orttrainer.hf.Trainer (``dataset``: _hf_dataset's)."""
    import torch
    import transformers

    if contender == "orttrainer":
        import orttrainer.hf

        base = orttrainer.hf.Trainer
    else:
        base = transformers.Trainer
    losses, times, start = result["losses"], result["step_times"], time.perf_counter()

    class Recording(base):
        def training_step(self, *args, **kwargs):  # each step's loss (log_history's are rounded means)
            loss = super().training_step(*args, **kwargs)
            losses.append(float(loss))
            times.append(time.perf_counter() - start - sum(times))  # the first: from the model's construction
            return loss

    torch.manual_seed(0)
    model = make_model("hf-trainer")
    rows, collate, settings = dataset
    arguments = transformers.TrainingArguments(str(directory), per_device_train_batch_size=settings["batch"],
                                               max_steps=settings["batches"], learning_rate=ADAMW["lr"], report_to=[],
                                               seed=0, save_strategy="no", disable_tqdm=True, use_cpu=True)  # fmt: skip
    trainer = Recording(model=model, args=arguments, train_dataset=rows, data_collator=collate)
    result["train_loss"] = trainer.train().training_loss
    runner = getattr(trainer, "_graph_runner", None)  # orttrainer.hf.Trainer's GradientSource (private, as graphs_built)
    if runner is not None:
        result["graphs_built"] = graphs_built(runner._trainer)


def child(row, contender, quick):
    """Train ``row`` with ``contender`` over the whole workload; print one JSON line."""
    import resource
    import warnings

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    import torch

    sys.path.insert(0, str(HERE))
    import workloads  # noqa: F401  (train_on; imported here, out of the timed run, as the libraries below)

    if row != "cnn-three-sizes":  # transformers imports a class's module at its first use: not in the timed run
        import transformers

        for name in MODEL_CLASSES[row] + (("Trainer", "TrainingArguments") if row == "hf-trainer" else ()):
            getattr(transformers, name)
    settings = SETTINGS["quick" if quick else "full"]
    result = {"losses": [], "step_times": [], "shapes": [], "torch_threads": torch.get_num_threads()}
    if contender == "orttrainer":
        import onnxruntime

        import orttrainer  # noqa: F401

        if row == "hf-trainer":
            import orttrainer.hf  # noqa: F401
        onnxruntime.set_default_logger_severity(3)
        result["phases"] = {}
        _time_phases(result["phases"])
    if row == "hf-trainer":
        dataset = (*_hf_dataset(settings, result["shapes"]), settings)
    else:
        batches = make_batches(row, settings)
        result["shapes"] = [_shape_of(row, batch) for batch in batches]
    start, cpu = time.perf_counter(), time.process_time()  # from the model's construction to the last step's end
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            warnings.filterwarnings("ignore", category=FutureWarning)
            if row == "hf-trainer":
                with tempfile.TemporaryDirectory() as directory:
                    _hf_trainer(contender, dataset, result, directory)
            else:
                _loop(row, contender, batches, result)
    except Exception as error:  # reported in the table, not a crash of the benchmark
        lines = str(error).strip().splitlines() or [""]
        result["error"] = f"{type(error).__name__}: {lines[0][:200]}"
    result["wall_s"], result["cpu_s"] = time.perf_counter() - start, time.process_time() - cpu
    result["warnings"] = sorted({str(w.message).splitlines()[0][:300] for w in caught if "orttrainer" in str(w.message)})
    result["distinct_lengths"] = len({tuple(shape) for shape in result["shapes"]})
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(result), flush=True)


# ---------------------------------------------------------------------------- parent
def run_child(row, contender, quick):
    """The child's JSON result, or {"error": ...} when it died without one (killed for memory, say)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", row, contender] + (["--quick"] if quick else [])
    return child_result(subprocess.run(command, capture_output=True, text=True))


def summarize(entry, runs):
    """Each contender's medians over its rounds, and the row's ratios and loss comparison, into ``entry``."""
    for contender in CONTENDERS:
        good = [run for run in runs[contender] if "error" not in run]
        failed = [run["error"] for run in runs[contender] if "error" in run]
        summary = {"rounds": len(runs[contender]), "failed_rounds": len(failed)}
        if failed:
            summary["error"] = failed[0]
        if good:
            first = good[0]
            for key in ("wall_s", "cpu_s", "peak_rss_mib"):
                summary[key] = statistics.median(run[key] for run in good)
            summary.update({"wall_s_all": [run["wall_s"] for run in good], "first_step_s": first["step_times"][0],
                            "step_times": first["step_times"], "losses": first["losses"],
                            "distinct_lengths": first["distinct_lengths"],
                            "shapes": first["shapes"], "torch_threads": first["torch_threads"],
                            "warnings": sorted({w for run in good for w in run["warnings"]})})  # fmt: skip
            for key in ("graphs_built", "phases", "train_loss"):
                if key in first:
                    summary[key] = first[key]
            summary["same_losses_every_round"] = all(run["losses"] == first["losses"] for run in good)
        entry[contender] = summary
    theirs, ours = entry["torch eager"], entry["orttrainer"]
    both = "wall_s" in theirs and "wall_s" in ours
    entry["speed_ratio"] = theirs["wall_s"] / ours["wall_s"] if both else None
    entry["rss_ratio"] = ours["peak_rss_mib"] / theirs["peak_rss_mib"] if both else None
    torch_losses, our_losses = theirs.get("losses", []), ours.get("losses", [])
    complete = torch_losses and len(our_losses) == len(torch_losses) and "error" not in ours and "error" not in theirs
    entry["max_loss_rel_diff"] = (max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(our_losses, torch_losses))
                                  if complete else None)  # fmt: skip


def _cell(value, form):
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, form)


def markdown(report):
    settings = report["settings"]
    lines = [f"Measured {report['date']} on {report['machine']}; {settings['batches']} batches of {settings['batch']}, "
             f"lengths {settings['lengths'][0]}..{settings['lengths'][1]} padded to each batch's longest (the CNN: "
             f"images of {'/'.join(map(str, IMAGE_SIZES))} px in turn; T5: source and target lengths); AdamW lr "
             f"{ADAMW['lr']}; torch's and ONNX Runtime's default threads; median of {report['rounds']} round(s), each "
             "contender in a fresh process. Time: the whole run, model construction to the last step's end "
             "(orttrainer's exports, graph builds and checks included), s; peak RSS of the process, MiB. Speed ratio "
             "torch/orttrainer (>1: orttrainer faster); RSS ratio orttrainer/torch.", "",
             "| row | torch time | orttrainer time | speed ratio | torch peak RSS | orttrainer peak RSS | ratio "
             "| graphs built | distinct lengths | max loss rel diff |", "|---" * 10 + "|"]  # fmt: skip
    notes, failures = [], []
    for entry in report["rows"]:
        theirs, ours = entry["torch eager"], entry["orttrainer"]
        for contender in CONTENDERS:
            if "error" in entry[contender]:
                failures.append(f"- {entry['name']}, {contender} ({entry[contender]['failed_rounds']} of "
                                f"{entry[contender]['rounds']} rounds): {entry[contender]['error']}")
        cells = [f"{entry['name']} ({entry['model']})", _cell(theirs.get("wall_s"), ".1f"),
                 _cell(ours.get("wall_s"), ".1f"), _cell(entry["speed_ratio"], ".2f"),
                 _cell(theirs.get("peak_rss_mib"), ".0f"), _cell(ours.get("peak_rss_mib"), ".0f"),
                 _cell(entry["rss_ratio"], ".2f"), _cell(ours.get("graphs_built"), "d"),
                 _cell(theirs.get("distinct_lengths", ours.get("distinct_lengths")), "d"),
                 _cell(entry["max_loss_rel_diff"], ".1e")]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
        phases = ours.get("phases") or {}
        if phases:
            spent = ", ".join(f"{kind} {count} x = {seconds:.1f} s" for kind, (count, seconds) in phases.items())
            torch_first = _cell(theirs.get("first_step_s"), ".2f")
            notes.append(f"- {entry['name']}: orttrainer's build phases: {spent} (of {ours['wall_s']:.1f} s); first "
                         f"step {ours['first_step_s']:.1f} s against torch's {torch_first} s")
        if "train_loss" in ours or "train_loss" in theirs:
            losses = [_cell(result.get("train_loss"), ".6f") for result in (theirs, ours)]
            notes.append(f"- {entry['name']}: Trainer's final train loss: transformers.Trainer {losses[0]}, "
                         f"orttrainer.hf.Trainer {losses[1]}")
        for warning in ours.get("warnings", []):
            notes.append(f"- {entry['name']}: orttrainer warned: {warning}")
        if ours.get("same_losses_every_round") is False:
            notes.append(f"- {entry['name']}: orttrainer's losses differ from round to round")
    if notes:
        lines += ["", *notes]
    if failures:
        lines += ["", "Failures:", *failures]
    return "\n".join(lines)


def plot(report, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    names = [row["name"] for row in rows]
    figure, axes = plt.subplots(1, 2, figsize=(11, 1.5 + 0.45 * len(rows)), sharey=True)
    panels = ((lambda row: 1 / row["speed_ratio"] if row["speed_ratio"] else 0, "whole-run time, orttrainer / torch"),
              (lambda row: row["rss_ratio"] or 0, "peak RSS, orttrainer / torch"))  # fmt: skip
    for axis, (value, title) in zip(axes, panels):
        values = [value(row) for row in rows]
        axis.barh(range(len(rows)), values, color="tab:orange")
        for position, ratio in enumerate(values):
            axis.text(ratio, position, f" {ratio:.2f}x" if ratio else " fails", va="center", fontsize=8)
        axis.axvline(1.0, color="gray", linestyle="--")
        axis.set_xlim(0, max([*values, 1.0]) * 1.25)
        axis.set_title(title + " (lower is better)", fontsize=10)
    axes[0].set_yticks(range(len(rows)), names, fontsize=8)
    axes[0].invert_yaxis()  # the table's order, top to bottom
    settings = report["settings"]
    figure.suptitle(f"Batches padded to their own longest: {settings['batches']} x {settings['batch']}, lengths "
                    f"{settings['lengths'][0]}..{settings['lengths'][1]} ({report['date']})", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="", help=f"comma-separated rows (default: all): {', '.join(ROWS)}")
    parser.add_argument("--quick", action="store_true", help="6 batches of 4, lengths 8..24, 1 round (a smoke run); "
                                                             "writes to a temporary directory unless --out is given")
    parser.add_argument("--rounds", type=int, default=None, help="runs of each contender per row (default 3; --quick 1)")
    parser.add_argument("--out", type=Path, default=None, help=f"results directory (default {RESULTS})")
    parser.add_argument("--add", action="store_true", help=f"keep the other rows of --out's {STEM}.json (a row run "
                                                           "again replaces its old one)")
    parser.add_argument("--child", nargs=2, metavar=("ROW", "CONTENDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child, args.quick)
    names = [name.strip() for name in args.rows.split(",") if name.strip()] or list(ROWS)
    unknown = [name for name in names if name not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix=f"{STEM}-quick-")) if args.quick else RESULTS
    elif args.quick and args.out.resolve() == RESULTS:
        parser.error(f"--quick does not write to {RESULTS}: its numbers are a smoke run's")
    rounds = args.rounds if args.rounds is not None else 1 if args.quick else 3
    report = {"date": date.today().isoformat(), "settings": SETTINGS["quick" if args.quick else "full"],
              "rounds": rounds, "rows": []}  # fmt: skip
    for name in names:
        runs = {contender: [] for contender in CONTENDERS}
        for round_ in range(rounds):
            for contender in CONTENDERS if round_ % 2 == 0 else CONTENDERS[::-1]:  # one child at a time
                print(f"{name}, round {round_ + 1}: {contender} ...", end=" ", flush=True)
                result = run_child(name, contender, args.quick)
                runs[contender].append(result)
                graphs = f", {result['graphs_built']} graphs built" if result.get("graphs_built") is not None else ""
                print(result.get("error") or f"{result['wall_s']:.1f} s (cpu {result['cpu_s']:.1f} s), peak "
                      f"{result['peak_rss_mib']:.0f} MiB, {result['distinct_lengths']} distinct lengths{graphs}, "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
        entry = {"name": name, "model": ROWS[name]}
        summarize(entry, runs)
        report["rows"].append(entry)
    sys.path.insert(0, str(HERE))
    from bench import _cpu_model  # imports torch: only after the children, whose peak RSS a big parent would inflate

    report["machine"] = f"{_cpu_model()}, {os.cpu_count()} cores"
    if args.add and (args.out / f"{STEM}.json").exists():
        old = json.loads((args.out / f"{STEM}.json").read_text())
        if old.get("settings") != report["settings"]:
            sys.exit(f"--add: {args.out / f'{STEM}.json'} was measured with other settings ({old.get('settings')}); "
                     "run without --add")
        report["rows"] = merged_rows(old["rows"], report["rows"], ROWS)
    table = markdown(report)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{STEM}.json").write_text(json.dumps(report, indent=1))
    (args.out / f"{STEM}.md").write_text(table + "\n")
    plot(report, args.out / f"{STEM}.png")
    print(f"results: {args.out / STEM}.{{json,md,png}}")


if __name__ == "__main__":
    main()
