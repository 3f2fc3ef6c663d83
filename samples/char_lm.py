"""Train a small GPT-style character language model with ORTTrainer.

The text is the Python standard library's own source code (already on every machine
with Python). The run shows a progress bar, evaluates on a held-out split, saves a
checkpoint every --checkpoint-every steps and resumes from the latest one when run again,
then exports an ONNX model, samples text from it with a plain InferenceSession, and
draws the loss curves.

    python samples/char_lm.py                 # the `make demo` run
    python samples/char_lm.py --steps 3000 --out-dir runs/longer

A checkpoint holds what resuming needs (the trainer's state and the step); the loss
history for the plot is kept beside the checkpoints in history.json, so checkpoints do
not grow as training goes on.
"""

import argparse
import glob
import json
import math
import os
import sysconfig
import time
from pathlib import Path

import numpy as np
import onnxruntime
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from orttrainer import ORTTrainer, ORTTrainerOptions, optim

from loss_curve import plot_loss_curve  # samples/loss_curve.py

BLOCK = 64  # characters of context


# ----------------------------------------------------------------------------- data
def load_text(max_chars: int) -> str:
    """Python sources of the standard library, in a fixed order, up to ``max_chars``."""
    stdlib = sysconfig.get_paths()["stdlib"]
    parts, total = [], 0
    for path in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as file:
            text = file.read()
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(parts)[:max_chars]


class CharData:
    """Characters <-> ids, and random blocks of the train / held-out split."""

    def __init__(self, text: str, held_out: float = 0.1):
        self.chars = sorted(set(text))
        self.index = {char: i for i, char in enumerate(self.chars)}
        ids = torch.tensor([self.index[char] for char in text], dtype=torch.int64)
        split = int(len(ids) * (1 - held_out))
        self.train, self.val = ids[:split], ids[split:]

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def batch(self, split: str, size: int, generator: torch.Generator):
        ids = self.train if split == "train" else self.val
        starts = torch.randint(0, len(ids) - BLOCK - 1, (size,), generator=generator)
        inputs = torch.stack([ids[start : start + BLOCK] for start in starts])
        targets = torch.stack([ids[start + 1 : start + BLOCK + 1] for start in starts])
        return inputs, targets

    def unigram_loss(self) -> float:
        """Cross-entropy (nats) of predicting each held-out character from train frequencies alone."""
        counts = torch.bincount(self.train, minlength=self.vocab).double() + 1
        log_probs = (counts / counts.sum()).log()
        return -log_probs[self.val].mean().item()

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)


# ---------------------------------------------------------------------------- model
class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("causal", torch.tril(torch.ones(BLOCK, BLOCK, dtype=torch.bool)), persistent=False)

    def forward(self, x):
        batch, steps, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.reshape(batch, steps, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(width // self.heads)
        scores = scores.masked_fill(~self.causal[:steps, :steps], float("-inf"))
        attention = self.dropout(F.softmax(scores, dim=-1))
        return self.proj((attention @ v).transpose(1, 2).reshape(batch, steps, width))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = CausalSelfAttention(width, heads, dropout)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class CharGPT(nn.Module):
    def __init__(self, vocab: int, width: int = 128, heads: int = 4, layers: int = 2, dropout: float = 0.1):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(torch.zeros(1, BLOCK, width))
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*[Block(width, heads, dropout) for _ in range(layers)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        nn.init.normal_(self.positions, std=0.02)

    def forward(self, tokens):
        x = self.dropout(self.tokens(tokens) + self.positions[:, : tokens.shape[1]])
        return self.head(self.norm(self.blocks(x)))


def next_char_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ---------------------------------------------------------------------- checkpoints
def latest_checkpoint(out_dir: Path):
    found = sorted(out_dir.glob("checkpoint_*.ortcp"), key=lambda path: int(path.stem.split("_")[1]))
    return found[-1] if found else None


def save_history(history: dict, path: Path) -> None:
    """The loss history as JSON, replaced atomically (written next to each checkpoint)."""
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(history))
    os.replace(temporary, path)


def load_history(path: Path, up_to_step: int) -> dict:
    """The saved history up to a resumed checkpoint's step (empty if there is none)."""
    if not path.exists():
        return {"train": [], "eval": []}
    saved = json.loads(path.read_text())
    return {key: [tuple(point) for point in saved.get(key, []) if point[0] <= up_to_step] for key in ("train", "eval")}


def evaluate(trainer, data, batches: int, batch_size: int) -> float:
    generator = torch.Generator().manual_seed(1234)  # the same held-out batches every time
    losses = [trainer.eval_step(*data.batch("val", batch_size, generator))[0].item() for _ in range(batches)]
    return sum(losses) / len(losses)


# ----------------------------------------------------------------- after training
def generate(onnx_path: Path, data: CharData, prompt: str, length: int) -> str:
    """Greedy-free sampling (temperature 0.8) from the exported model in a plain InferenceSession."""
    session = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    names = [graph_input.name for graph_input in session.get_inputs()]
    rng = np.random.default_rng(0)
    ids = [data.index.get(char, 0) for char in prompt]
    pad = data.index.get(" ", 0)
    for _ in range(length):
        context = ([pad] * BLOCK + ids)[-BLOCK:]
        tokens = np.array([context], dtype=np.int64)
        _, logits = session.run(None, {names[0]: tokens, names[1]: np.zeros_like(tokens)})
        scaled = logits[0, -1] / 0.8
        probabilities = np.exp(scaled - scaled.max())
        ids.append(int(rng.choice(len(probabilities), p=probabilities / probabilities.sum())))
    return data.decode(ids)


# ------------------------------------------------------------------------------ main
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1200, help="train_step calls in total")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per micro-batch")
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer update")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--out-dir", default="runs/char_lm")
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--checkpoint-every", type=int, default=400)
    parser.add_argument("--max-chars", type=int, default=2_000_000, help="characters of stdlib source to use")
    args = parser.parse_args()

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = CharData(load_text(args.max_chars))
    baseline = data.unigram_loss()
    print(f"text: {len(data.train) + len(data.val):,} characters of Python stdlib source, vocabulary {data.vocab}")
    print(f"unigram baseline (held-out): {baseline:.3f} nats/char")

    torch.manual_seed(0)
    updates = args.steps // args.accumulation
    options = ORTTrainerOptions({
        "device": {"id": args.device},
        "batch": {"gradient_accumulation_steps": args.accumulation},
        "lr_scheduler": optim.LinearWarmupLRScheduler(max(updates, 1), warmup=0.05),
    })
    trainer = ORTTrainer(CharGPT(data.vocab), None, optim.AdamConfig(lr=args.lr, lambda_coef=0.01), loss_fn=next_char_loss,
                         options=options)
    history = {"train": [], "eval": []}
    history_path = out_dir / "history.json"
    start = 0
    resume_from = latest_checkpoint(out_dir)
    if resume_from is not None:
        start = int(trainer.load_checkpoint(resume_from)["step"])
        history = load_history(history_path, start)
        print(f"resuming from {resume_from} at step {start}")

    generator = torch.Generator().manual_seed(start)  # a resumed run draws fresh batches deterministically
    progress = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="training", unit="step", mininterval=1.0)
    began = time.perf_counter()
    first_step_seconds = None
    for step in progress:
        loss = trainer.train_step(*data.batch("train", args.batch_size, generator))[0].item()
        if first_step_seconds is None:  # includes exporting the model and building the graphs
            first_step_seconds = time.perf_counter() - began
        history["train"].append((step + 1, loss))
        done = step + 1
        lr = options.lr_scheduler.get_last_lr()[0]
        progress.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}")  # the bar itself shows the recent step rate
        if done % args.eval_every == 0 or done == args.steps:
            eval_loss = evaluate(trainer, data, batches=8, batch_size=args.batch_size)
            history["eval"].append((done, eval_loss))
            progress.write(f"step {done}: held-out loss {eval_loss:.3f} (unigram baseline {baseline:.3f})")
        if done % args.checkpoint_every == 0 or done == args.steps:
            trainer.save_checkpoint(out_dir / f"checkpoint_{done}.ortcp", user_dict={"step": done}, overwrite=True)
            save_history(history, history_path)
    total = time.perf_counter() - began
    progress.close()
    trained = args.steps - start
    if trained > 1:
        later = (trained - 1) / (total - first_step_seconds)
        print(f"trained {trained} steps in {total:.1f} s ({trained / total:.2f} steps/s, the bar's final rate); the first "
              f"step (export, graph build, check against torch) took {first_step_seconds:.1f} s, the others ran at "
              f"{later:.2f} steps/s (held-out evaluation and checkpoints included)")

    if start >= args.steps:
        print("nothing left to train: the latest checkpoint is already at --steps")
    if not history["eval"]:
        history["eval"].append((args.steps, evaluate(trainer, data, batches=8, batch_size=args.batch_size)))
    final = history["eval"][-1][1]
    print(f"final held-out loss {final:.3f} nats/char vs unigram baseline {baseline:.3f} "
          f"({'learned' if final < baseline else 'did NOT beat the baseline'})")
    onnx_path = out_dir / "char_lm.onnx"
    trainer.save_as_onnx(str(onnx_path))
    print(f"inference model: {onnx_path}")
    print("sample from the exported model:\n" + "-" * 60)
    print(generate(onnx_path, data, "def ", 200))
    print("-" * 60)
    plot_loss_curve({"train (micro-batch)": history["train"], "held-out": history["eval"]}, "cross-entropy (nats/char)",
                    out_dir / "loss_curve.png", baseline=("unigram baseline", baseline))
    print(f"loss curve: {out_dir / 'loss_curve.png'}; checkpoints: {out_dir}/checkpoint_*.ortcp")


if __name__ == "__main__":
    main()
