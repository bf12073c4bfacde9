"""The demo's figure: loss curves next to optimizer-state bytes by kind, as a PNG.

matplotlib is optional (requirements-dev.txt installs it); `save_demo_figure` imports it
only when called and lets ModuleNotFoundError through, so the caller can say the PNG was
skipped and carry on.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

# Over how many steps the drawn loss curve is averaged: single-batch losses jump by more than
# the optimizers differ.
SMOOTHING_STEPS = 10


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """The mean of each value and the up to window-1 values before it."""
    averaged, total = [], 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        averaged.append(total / min(index + 1, window))
    return averaged


def save_demo_figure(
    path: str | os.PathLike,
    *,
    title: str,
    train_losses: Mapping[str, Sequence[float]],
    held_out_losses: Mapping[str, float],
    state_bytes_by_kind: Mapping[str, Mapping[str, int]],
    num_params: int,
    identical_runs: Mapping[str, str],
) -> None:
    """Two panels: left, each run's training loss (a moving average, log x) with its held-out
    loss as a marker at the last step and in the legend; right, a stacked bar per run of its state bytes by kind,
    labelled with the total and the bytes per parameter.

    identical_runs maps a run to the run whose losses it repeats bit for bit: it is drawn
    dashed over that one and its legend entry says so.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display needed: the figure only goes to a file
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    figure, (loss_axes, bytes_axes) = plt.subplots(1, 2, figsize=(13, 5.6), width_ratios=(3, 2))
    figure.suptitle(title, fontsize=10)
    colors = {name: f"C{index}" for index, name in enumerate(train_losses)}

    for index, (name, losses) in enumerate(train_losses.items()):
        steps = range(1, len(losses) + 1)
        twin = identical_runs.get(name)
        held_out = held_out_losses.get(name)
        label = name + (f" (identical to {twin})" if twin else "") + \
            (f", held-out {held_out:.4f}" if held_out is not None else "")
        # The curves nearly coincide: the first (the reference) is drawn wide and pale beneath
        # the others, and a run identical to another dashed over it, so that every one shows.
        style = dict(color=colors[name], linewidth=1.3)
        if index == 0:
            style.update(linewidth=4, alpha=0.45)
        if twin:
            style.update(color="black", linestyle="--", linewidth=1, dashes=(3, 4))
        loss_axes.plot(steps, moving_average(losses, SMOOTHING_STEPS), label=label, **style)
        if held_out is not None:
            loss_axes.plot([len(losses)], [held_out], marker="x" if twin else "o",
                           color=style["color"], alpha=style.get("alpha", 1.0), linestyle="none",
                           markersize=7 if twin else 9)
    loss_axes.plot([], [], marker="o", color="gray", linestyle="none", label="held-out loss, at the end")
    loss_axes.set_xscale("log")
    loss_axes.set_xlabel("step")
    loss_axes.set_ylabel(f"training loss (mean of {SMOOTHING_STEPS} steps), nats/byte")
    loss_axes.grid(True, which="both", alpha=0.3)
    # Under the figure: on a log step axis the first steps spread over the top of the plot,
    # and the labels are too long for any corner the curves leave clear at every run length.
    figure.legend(*loss_axes.get_legend_handles_labels(), fontsize=8, loc="lower left",
                  bbox_to_anchor=(0.03, 0.0), ncol=2, frameon=False)

    names = list(state_bytes_by_kind)
    # Kinds no run has (master residuals of fp32 weights, say) would only crowd the legend.
    kinds = [kind for kind in dict.fromkeys(k for by_kind in state_bytes_by_kind.values() for k in by_kind)
             if any(by_kind.get(kind, 0) for by_kind in state_bytes_by_kind.values())]
    bottoms = [0] * len(names)
    for kind_index, kind in enumerate(kinds):
        heights = [state_bytes_by_kind[name].get(kind, 0) for name in names]
        bytes_axes.bar(range(len(names)), heights, bottom=bottoms, label=kind,
                       color=f"C{kind_index + len(colors)}")
        bottoms = [bottom + height for bottom, height in zip(bottoms, heights)]
    for index, total in enumerate(bottoms):
        bytes_axes.annotate(f"{total:,} B\n{total / num_params:.2f} B/param", (index, total),
                            ha="center", va="bottom", fontsize=8)
    bytes_axes.set_xticks(range(len(names)), [name.replace(" ", "\n", 1) for name in names],
                          fontsize=8)
    bytes_axes.set_ylabel("optimizer-state bytes")
    bytes_axes.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:,.0f}"))
    bytes_axes.set_ylim(0, math.ceil(max(bottoms, default=1) * 1.2))
    bytes_axes.legend(fontsize=8)

    figure.tight_layout(rect=(0, 0.09, 1, 1))  # room for the loss legend below
    figure.savefig(path, dpi=110)
    plt.close(figure)
