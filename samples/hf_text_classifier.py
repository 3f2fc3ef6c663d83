"""Fine-tune a Hugging Face transformers model with `transformers.Trainer`, run by orttrainer.

The script is an ordinary `Trainer` script; the one change is the import: `Trainer` comes from
`orttrainer.hf`, so each training step's forward and backward run in ONNX Runtime while the
optimizer, schedule, clipping, logging, evaluation and checkpoints are `Trainer`'s own. The model is
`BertForSequenceClassification` (a small config, random init: nothing is downloaded), the tokenizer a
`tokenizers` WordPiece trained here, the batches come from `DataCollatorWithPadding` (dynamic padding
to a multiple of 16: a graph per sequence length). The task: tell which standard-library package
(email, json, unittest, xml, ...) a snippet of Python source comes from. The run shows Trainer's
progress bar, evaluates on snippets of held-out files each epoch, draws the loss curve and saves the
model, ready for `BertForSequenceClassification.from_pretrained`.

    python samples/hf_text_classifier.py
    python samples/hf_text_classifier.py --epochs 1 --out-dir runs/quick
"""

import argparse
import glob
import os
import random
import sysconfig
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import BertConfig, BertForSequenceClassification, DataCollatorWithPadding, PreTrainedTokenizerFast
from transformers import TrainingArguments

from orttrainer.hf import Trainer  # was: from transformers import Trainer

from loss_curve import plot_loss_curve  # samples/loss_curve.py

PACKAGES = ("asyncio", "email", "json", "unittest", "xml", "multiprocessing")
LINES_PER_SNIPPET = 4
MAX_TOKENS = 128


# ----------------------------------------------------------------------------- data
def load_snippets(max_files: int) -> dict:
    """{'train' | 'test': [(text, label), ...]}: runs of source lines from each package's files;
    one file in 5 of each package is held out, so test snippets come from files never trained on."""
    stdlib = sysconfig.get_paths()["stdlib"]
    split = {"train": [], "test": []}
    for label, package in enumerate(PACKAGES):
        files = sorted(glob.glob(os.path.join(stdlib, package, "**", "*.py"), recursive=True))[:max_files]
        for index, path in enumerate(files):
            with open(path, encoding="utf-8", errors="replace") as file:
                lines = [line for line in file.read().splitlines() if line.strip()]
            part = "test" if index % 5 == 2 else "train"
            for start in range(0, len(lines) - LINES_PER_SNIPPET + 1, LINES_PER_SNIPPET):
                split[part].append(("\n".join(lines[start : start + LINES_PER_SNIPPET]), label))
    return split


def train_tokenizer(texts, vocab_size: int) -> PreTrainedTokenizerFast:
    """A WordPiece tokenizer trained on the training snippets, wrapped as transformers wants it."""
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    tokenizer.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=special))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", model_max_length=MAX_TOKENS)


def encoded(snippets, tokenizer) -> list:
    """The dataset as a collator takes it: one dict per example."""
    texts, labels = zip(*snippets)
    encodings = tokenizer(list(texts), truncation=True, max_length=MAX_TOKENS)
    return [{"input_ids": ids, "label": label} for ids, label in zip(encodings["input_ids"], labels)]


def accuracy(prediction) -> dict:
    """Trainer's compute_metrics: the share of held-out snippets whose package is the likeliest."""
    logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
    return {"accuracy": float((logits.argmax(-1) == prediction.label_ids).mean())}


# ------------------------------------------------------------------------------ main
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--max-files", type=int, default=20, help="source files read per package")
    parser.add_argument("--out-dir", default="runs/hf_text_classifier")
    args = parser.parse_args()

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    random.seed(0)
    torch.manual_seed(0)
    snippets = load_snippets(args.max_files)
    tokenizer = train_tokenizer([text for text, _ in snippets["train"]], vocab_size=2000)
    train, test = encoded(snippets["train"], tokenizer), encoded(snippets["test"], tokenizer)
    majority = max(sum(example["label"] == label for example in test) for label in range(len(PACKAGES))) / len(test)
    print(f"{len(train)} training and {len(test)} held-out snippets from {len(PACKAGES)} packages; "
          f"vocabulary {tokenizer.vocab_size}; always guessing the commonest package: {majority:.1%}")

    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=MAX_TOKENS, num_labels=len(PACKAGES),
                        pad_token_id=tokenizer.pad_token_id)
    model = BertForSequenceClassification(config)
    arguments = TrainingArguments(str(out_dir / "trainer"), num_train_epochs=args.epochs, learning_rate=args.lr,
                                  per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=64,
                                  warmup_steps=0.1, weight_decay=0.01, logging_steps=5, eval_strategy="epoch",
                                  save_strategy="no", report_to=[], seed=0, use_cpu=True)
    collator = DataCollatorWithPadding(tokenizer, return_tensors="pt")  # each batch to its own longest: one graph
    trainer = Trainer(model=model, args=arguments, train_dataset=train, eval_dataset=test, data_collator=collator,
                      compute_metrics=accuracy)

    began = time.perf_counter()
    trainer.train()
    losses = [(entry["step"], entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]
    window = min(4, len(losses))
    first, last = (sum(loss for _, loss in part) / window for part in (losses[:window], losses[-window:]))
    print(f"trained {trainer.state.global_step} steps in {time.perf_counter() - began:.1f} s; mean logged loss of the "
          f"first {window} logs {first:.3f}, of the last {window} {last:.3f}")

    final = trainer.evaluate()["eval_accuracy"]
    print(f"final held-out accuracy {final:.1%} vs {majority:.1%} for the commonest package "
          f"({'learned' if final > majority + 0.1 else 'did NOT beat the baseline'})")
    trainer.save_model(str(out_dir / "model"))  # trained in place: `model` holds the trained weights
    tokenizer.save_pretrained(out_dir / "model")
    plot_loss_curve({"train (logged)": losses}, "cross-entropy", out_dir / "loss_curve.png")
    print(f"model: {out_dir / 'model'} (BertForSequenceClassification.from_pretrained); loss curve: {out_dir / 'loss_curve.png'}")


if __name__ == "__main__":
    main()
