"""The loss-curve PNG the samples draw (matplotlib, without a display)."""

from pathlib import Path


def plot_loss_curve(curves: dict, ylabel: str, path: Path, baseline=None) -> None:
    """``curves``: {label: [(train_step, loss), ...]}, the first drawn as a line, the others with
    markers; ``baseline``: (label, value) drawn as a dashed horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for index, (label, points) in enumerate(curves.items()):
        if points:
            axes.plot(*zip(*points), "-" if index == 0 else "o-", label=label, alpha=0.6 if index == 0 else 1.0)
    if baseline is not None:
        axes.axhline(baseline[1], color="gray", linestyle="--", label=baseline[0])
    axes.set_xlabel("train_step")
    axes.set_ylabel(ylabel)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
