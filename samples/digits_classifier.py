"""Classify scikit-learn's bundled handwritten digits (8x8 images) with a small CNN + BatchNorm.

The data ships inside scikit-learn (no download). Trains with ORTTrainer and Adam,
reports held-out accuracy computed with eval_step.

    python samples/digits_classifier.py [--epochs 30]
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from tqdm import tqdm

from orttrainer import ORTTrainer, ORTTrainerOptions, optim


class DigitsCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        )  # fmt: skip
        self.classifier = nn.Sequential(nn.Flatten(), nn.Dropout(0.2), nn.Linear(32 * 4 * 4, 10))

    def forward(self, images):
        return self.classifier(self.features(images))


def load_split(test_fraction=0.2):
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    cut = int(len(labels) * (1 - test_fraction))
    return (images[order[:cut]], labels[order[:cut]]), (images[order[cut:]], labels[order[cut:]])


def accuracy(trainer, images, labels, batch_size=256):
    correct = 0
    for start in range(0, len(labels), batch_size):
        logits = trainer.eval_step(images[start : start + batch_size], labels[start : start + batch_size])[1]
        correct += (logits.argmax(1) == labels[start : start + batch_size]).sum().item()
    return correct / len(labels)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    (train_x, train_y), (test_x, test_y) = load_split()
    print(f"digits: {len(train_y)} train / {len(test_y)} test images of 8x8 pixels")
    torch.manual_seed(0)
    steps_per_epoch = -(-len(train_y) // args.batch_size)
    options = ORTTrainerOptions({
        "device": {"id": args.device},
        "lr_scheduler": optim.CosineWarmupLRScheduler(args.epochs * steps_per_epoch, warmup=0.05),
    })
    trainer = ORTTrainer(DigitsCNN(), None, optim.AdamConfig(lr=3e-3, lambda_coef=1e-4), loss_fn=F.cross_entropy,
                         options=options)
    generator = torch.Generator().manual_seed(0)
    for epoch in tqdm(range(1, args.epochs + 1), desc="epochs", unit="epoch"):
        order = torch.randperm(len(train_y), generator=generator)
        for start in range(0, len(order), args.batch_size):
            batch = order[start : start + args.batch_size]
            loss = trainer.train_step(train_x[batch], train_y[batch])[0].item()
        if epoch % 10 == 0 or epoch == args.epochs:
            tqdm.write(f"epoch {epoch}: last batch loss {loss:.3f}, test accuracy {accuracy(trainer, test_x, test_y):.2%}")
    print(f"test accuracy: {accuracy(trainer, test_x, test_y):.2%}")


if __name__ == "__main__":
    main()
