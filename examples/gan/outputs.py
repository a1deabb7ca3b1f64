"""What a run shows and writes besides checkpoints and events: the progress bar
and the step timing, history.json, metrics.json, samples.png and curves.png."""

from __future__ import absolute_import, division, print_function

import json
import os
import time

import numpy as np


class Progress(object):
    """A tqdm progress bar over the steps, and the steady time per step.

    The first step's ``session.run`` includes graph set-up, so the time per
    step is taken from the end of the first step, when there are two or more.
    """

    def __init__(self, desc, total, initial=0, disable=False):
        from tqdm import tqdm
        self._bar = tqdm(total=total, initial=initial, desc=desc, unit="step",
                         dynamic_ncols=True, mininterval=0.5, disable=disable)
        self.steps = 0
        self.start = self._steady_start = time.time()
        self.end = None

    def update(self, **postfix):
        """After each step's ``session.run``: shows ``postfix``, advances the bar."""
        self.steps += 1
        if self.steps == 1:
            self._steady_start = time.time()
        self._bar.set_postfix(refresh=False, **postfix)
        self._bar.update(1)

    def close(self):
        self._bar.close()
        self.end = time.time()

    def seconds_per_step(self):
        if self.steps > 1:
            return (self.end - self._steady_start) / (self.steps - 1)
        return self.end - self.start

    def train_seconds(self):
        return self.end - self.start


def write_json(path, payload):
    """Writes JSON through a temporary file and a rename (no half-written file)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(payload, handle, indent=2, sort_keys=True)
        handle.write("\n")
    os.replace(tmp, path)


#: history.json's per-step columns; skip_reason is a code of
#: npu_lossscale.diagnostics.REASONS (0: applied).
COLUMNS = ["step", "d_loss", "g_loss", "loss_scale", "finite", "skip_reason"]
#: history.json's underflow rows, one per group every few steps
#: (TrainOps.underflow).
UNDERFLOW_COLUMNS = ["step", "group", "flushed_share", "subnormal_share", "headroom",
                     "zero_share", "float32_zero_share"]


class History(object):
    """What history.json holds: one row per step (``COLUMNS``) and the
    underflow measurements (``UNDERFLOW_COLUMNS``)."""

    def __init__(self, rows=(), underflow=()):
        self.rows = list(rows)
        self.underflow = list(underflow)

    def add_step(self, row):
        self.rows.append(list(row))

    def add_underflow(self, step, measured):
        """Adds a fetched ``TrainOps.underflow`` (group -> Underflow)."""
        for group, record in sorted(measured.items()):
            self.underflow.append([step, group] + [float(getattr(record, name))
                                                   for name in UNDERFLOW_COLUMNS[2:]])


#: A group's gradients are healthy when at most this share of the elements
#: float32 keeps non-zero underflow in float16 (flushed to zero or
#: subnormal): ListeningLossScaleManager's default raise_above_underflow_share.
HEALTHY_UNDERFLOW_SHARE = 0.01


def skips_by_reason(history, reasons):
    """{reason name: skipped steps} over the history's rows."""
    counts = {}
    for row in history.rows:
        if len(row) > 5 and row[5]:
            counts[reasons[row[5]]] = counts.get(reasons[row[5]], 0) + 1
    return counts


def last_underflow(history):
    """{group: {field: value}} of the last underflow measurement."""
    last = {}
    for row in history.underflow:
        last[row[1]] = dict(zip(UNDERFLOW_COLUMNS[2:], row[2:]))
    return last


def healthy_from_step(history):
    """The measured step from which on, at every measurement and in every
    group, at most ``HEALTHY_UNDERFLOW_SHARE`` of the gradient underflowed
    (flushed or subnormal); None when the last measurement is not healthy."""
    by_step = {}
    for row in history.underflow:
        by_step.setdefault(row[0], []).append(row[2] + row[3])
    healthy = None
    for step in sorted(by_step):
        if max(by_step[step]) > HEALTHY_UNDERFLOW_SHARE:
            healthy = None
        elif healthy is None:
            healthy = step
    return healthy


def load_history(out, upto):
    """The ``History`` in history.json up to step ``upto`` (the restored
    checkpoint's)."""
    path = os.path.join(out, "history.json")
    if not os.path.isfile(path):
        return History()
    with open(path) as handle:
        saved = json.load(handle)
    return History([row for row in saved.get("rows", []) if row[0] <= upto],
                   [row for row in saved.get("underflow", []) if row[0] <= upto])


def save_history(out, history):
    write_json(os.path.join(out, "history.json"), {
        "columns": COLUMNS, "rows": history.rows,
        "underflow_columns": UNDERFLOW_COLUMNS, "underflow": history.underflow})


def save_samples_png(path, images, rows=10):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    count = rows * rows
    images = images[:count]
    size = images.shape[1]
    canvas = np.zeros((rows * (size + 1) - 1, rows * (size + 1) - 1))
    for k, image in enumerate(images):
        r, c = divmod(k, rows)
        canvas[r * (size + 1):r * (size + 1) + size, c * (size + 1):c * (size + 1) + size] = image
    fig = plt.figure(figsize=(5, 5))
    plt.imshow(canvas, cmap="gray_r", vmin=0.0, vmax=1.0, interpolation="nearest")
    plt.axis("off")
    fig.savefig(path, bbox_inches="tight", dpi=100)
    plt.close(fig)


def _smooth(values, window=25):
    values = np.asarray(values, dtype=np.float64)
    if len(values) < window:
        return values
    kernel = np.ones(window) / window
    padded = np.concatenate([np.full(window - 1, values[0]), values])
    return np.convolve(padded, kernel, mode="valid")


#: A colour per skip reason (npu_lossscale.diagnostics.REASONS, 1 on).
_REASON_COLORS = ("tab:purple", "tab:red", "tab:brown", "tab:olive", "tab:cyan")


def save_curves_png(path, history, title, reasons):
    """Three panels over the steps: both losses; the loss scale, with the
    skipped steps marked by reason; the underflow measurement (the share of
    gradient elements float16 flushed to zero, and the subnormal share, per
    group).

    Args:
      path: the PNG to write.
      history: the run's ``History``.
      title: the figure's title.
      reasons: the reason names, by code (``diagnostics.REASONS``).
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    # Rows of an older history.json have no skip_reason: 0 there.
    data = np.array([list(row[:6]) + [0] * (6 - len(row)) for row in history.rows],
                    dtype=np.float64).reshape(-1, 6)
    steps, d_loss, g_loss, scale, _, reason = data.T
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(8, 8.5), sharex=True)
    for values, label, color in ((d_loss, "discriminator", "tab:blue"),
                                 (g_loss, "generator", "tab:orange")):
        ok = np.isfinite(values)
        top.plot(steps[ok], values[ok], color=color, alpha=0.2, linewidth=0.5)
        top.plot(steps[ok], _smooth(values[ok]), color=color, label=label)
    top.set_ylabel("loss")
    top.legend(loc="upper right")
    top.set_title(title)

    middle.step(steps, scale, where="post", color="tab:green", label="loss scale")
    middle.set_yscale("log", base=2)
    middle.set_ylabel("loss scale")
    for code in sorted(set(int(value) for value in reason if value > 0)):
        at = steps[reason == code]
        color = _REASON_COLORS[(code - 1) % len(_REASON_COLORS)]
        for k, step in enumerate(at):
            middle.axvline(step, color=color, alpha=0.5, linewidth=0.8,
                           label="skipped: %s (%d)" % (reasons[code], len(at)) if k == 0
                           else None)
    middle.legend(loc="best", fontsize="small")

    groups = sorted(set(row[1] for row in history.underflow))
    for k, group in enumerate(groups):
        rows = np.array([row[:1] + row[2:] for row in history.underflow if row[1] == group],
                        dtype=np.float64).reshape(-1, len(UNDERFLOW_COLUMNS) - 1)
        color = ("tab:blue", "tab:orange", "tab:gray")[k % 3]
        bottom.plot(rows[:, 0], 100.0 * rows[:, 1], color=color, marker=".",
                    label="%s: flushed to 0" % group)
        bottom.plot(rows[:, 0], 100.0 * rows[:, 2], color=color, linestyle=":",
                    label="%s: subnormal" % group)
    # Linear below 0.01 %, logarithmic above: shares of a few elements in a
    # million and shares of tens of percent on one axis.
    bottom.set_yscale("symlog", linthresh=0.01)
    bottom.set_ylim(bottom=0.0)
    bottom.set_ylabel("% of gradient elements\n(of float32's non-zero)")
    bottom.set_xlabel("step")
    if groups:
        bottom.legend(loc="best", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
