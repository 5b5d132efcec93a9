"""PNG figures for run directories (matplotlib, no screen needed)."""

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np

from poecaps.errors import InputError
from poecaps.validation import check_integer, check_number


def mosaic(images, gap=2, fill=1.0):
    """Tile `images [rows, cols, H, W, C]` into one `[rows (H + gap) - gap, cols (W + gap) - gap, C]` array.

    Cell `(r, c)` starts at row `r (H + gap)` and column `c (W + gap)`;
    the gaps between cells hold `fill`, a number in [0, 1]; `gap` is an
    integer >= 0. Values are clipped to [0, 1].
    """
    gap, fill = check_integer(gap, "gap", minimum=0), check_number(fill, "fill", minimum=0, maximum=1)
    images = np.clip(np.asarray(images, dtype="float32"), 0.0, 1.0)
    if images.ndim != 5 or images.size == 0:
        raise InputError(f"images must be [rows, cols, H, W, C], no axis empty. Received: shape={images.shape}")
    rows, cols, height, width, channels = images.shape
    tiled = np.full((rows * (height + gap) - gap, cols * (width + gap) - gap, channels), fill, dtype="float32")
    for r in range(rows):
        for c in range(cols):
            top, left = r * (height + gap), c * (width + gap)
            tiled[top:top + height, left:left + width] = images[r, c]
    return tiled


def image_grid(images, path, title=None, column_labels=None, row_labels=None):
    """Save `images [rows, cols, H, W, C]` as one grid PNG (one image drawn: `mosaic`, then labels): one column
    label per column and one row label per row, if given."""
    gap = 2
    tiled = mosaic(images, gap)
    rows, cols, height, width = np.shape(images)[:4]
    for name, labels, count in (("column_labels", column_labels, cols), ("row_labels", row_labels, rows)):
        given = None if labels is None else len(list(labels))
        if given is not None and given != count:
            raise InputError(f"{name} must hold one label per {name.split('_')[0]}, {count}. Received: {given} "
                             f"label{'' if given == 1 else 's'}")
    fig, ax = plt.subplots(figsize=(cols * 0.8, rows * 0.8 + 0.4))
    ax.imshow(tiled[..., 0] if tiled.shape[-1] == 1 else tiled, cmap="gray", vmin=0, vmax=1,
              interpolation="nearest")
    ax.set_xticks([c * (width + gap) + (width - 1) / 2 for c in range(cols)] if column_labels is not None else [])
    ax.set_yticks([r * (height + gap) + (height - 1) / 2 for r in range(rows)] if row_labels is not None else [])
    if column_labels is not None:
        ax.set_xticklabels([str(label) for label in column_labels], fontsize=6)
        ax.xaxis.tick_top()
    if row_labels is not None:
        ax.set_yticklabels([str(label) for label in row_labels], fontsize=6)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def filters(kernel, path, title="First-layer filters"):
    """Save the first filter bank `[k, k, C, F]` as a grid (first channel)."""
    k = kernel[..., 0, :]
    k = (k - k.min(axis=(0, 1))) / (np.ptp(k, axis=(0, 1)) + 1e-8)
    count = k.shape[-1]
    cols = 16
    rows = int(np.ceil(count / cols))
    grid = np.ones((rows, cols, k.shape[0], k.shape[1], 1), dtype="float32")
    for f in range(count):
        grid[f // cols, f % cols, :, :, 0] = k[..., f]
    image_grid(grid, path, title=title)


def scaled_curve(values):
    """`(values / scale, scale)` with `scale` the largest finite `|value|` (1 if there is none or it is 0), and
    non-finite values as NaN (a gap in the curve)."""
    values = np.array(values, dtype=float)
    values[~np.isfinite(values)] = np.nan
    finite = np.abs(values[np.isfinite(values)])
    scale = float(finite.max()) if finite.size else 0.0
    scale = scale or 1.0
    return values / scale, scale


def training_curves(metrics_path, path):
    """Plot every numeric metric of `metrics.jsonl`, one panel per stage, each curve divided by its largest finite
    magnitude (non-finite values are left out of the curve). Returns whether a figure was saved: a file with no
    records (a run stopped before its first epoch ended) has nothing to plot."""
    with open(metrics_path) as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    if not records:
        return False
    stages = list(dict.fromkeys(r["stage"] for r in records))
    fig, axes = plt.subplots(1, len(stages), figsize=(4 * len(stages), 3), squeeze=False)
    for ax, stage in zip(axes[0], stages):
        rows = [r for r in records if r["stage"] == stage]
        keys = [k for k in rows[0] if k not in ("stage", "epoch") and isinstance(rows[0][k], float)]
        for key in keys:
            values, scale = scaled_curve([r.get(key, np.nan) for r in rows])
            ax.plot([r["epoch"] + 1 for r in rows], values, marker="o",
                    label=f"{key} (/{scale:.3g})")
        ax.set_title(stage)
        ax.set_xlabel("epoch")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def per_epoch(entries, key):
    """`{epoch: entry[key]}` of per-epoch records (dicts with an "epoch"), skipping those without the key: a
    series for `line_panels`."""
    return {e["epoch"]: e[key] for e in entries if e.get(key) is not None}


def line_panels(panels, path, title=None, xlabel="step", ylabel=None):
    """Save small line plots: `panels` is `[[(panel title, {label: values}), ...], ...]` (rows of panels).

    `values` is a sequence (plotted against its index) or a dict `{x: y}` (plotted at its x, with markers:
    per-epoch curves).
    """
    rows, cols = len(panels), max(len(row) for row in panels)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.4 * rows), squeeze=False)
    for r, row in enumerate(panels):
        for c, (name, series) in enumerate(row):
            ax = axes[r, c]
            for label, values in series.items():
                if isinstance(values, dict):
                    ax.plot(list(values), list(values.values()), label=str(label), linewidth=1, marker="o",
                            markersize=2)
                    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
                else:
                    ax.plot(np.asarray(values), label=str(label), linewidth=1)
            ax.set_title(name, fontsize=8)
            ax.set_xlabel(xlabel, fontsize=7)
            if ylabel:
                ax.set_ylabel(ylabel, fontsize=7)
            ax.tick_params(labelsize=6)
            ax.legend(fontsize=6)
        for c in range(len(row), cols):
            axes[r, c].axis("off")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
