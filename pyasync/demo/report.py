"""Reporting: percentiles of staleness histograms, time to a target accuracy, the results table and the
accuracy plot.

Note [Demo time to target]
    The demo's point is how soon each system reaches a useful model with a straggler, so it reports,
    per system, the time to a target test accuracy (``--target``, default :data:`DEFAULT_TARGET`) and its
    ratio to DDP's. The time is that of the first point of the accuracy-against-time curve (Note
    [Timing and evaluation]) at or above the target: it can be late by up to one snapshot interval
    (about 1/40 of the run), the same resolution for every system; None when no point, the final
    model included, reaches it. The ratio is over the ``ddp`` run of the same invocation (None without
    one). The end-to-end benchmark measures it the same way (bench/harness/summary.py, which the demo
    does not import).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

#: Fields of a result record, in table order (the JSON holds more, see pyasync.demo.record.make_record).
TABLE_COLUMNS = (
    ("name", "system", "{}"),
    ("wall_s", "wall s", "{:.2f}"),
    ("samples_per_s", "samples/s", "{:.0f}"),
    ("test_acc", "test acc", "{:.4f}"),
    ("mb_sent", "MB sent", "{:.1f}"),
    ("staleness_p50", "stale p50", "{}"),
    ("staleness_p99", "stale p99", "{}"),
    ("pushes_dropped", "dropped", "{}"),
)

#: The column of the emulated device's time per step, shown when some record has one (``device_ms``).
DEVICE_COLUMN = ("device_ms", "device ms", "{:g}")

#: The columns of time to target and its ratio to DDP's, shown when some record has a target
#: (``target_acc``, see :func:`add_time_to_target` and Note [Demo time to target]).
TARGET_COLUMNS = (
    ("time_to_target_s", "to target s", "{:.2f}"),
    ("time_to_target_vs_ddp", "x ddp", "{:.2f}"),
)

#: The demo's default target test accuracy (the end-to-end benchmark's target for this MLP too).
DEFAULT_TARGET = 0.95


def time_to_target(curve: Sequence[Mapping[str, float]], target: float) -> float | None:
    """Seconds to the first point of ``curve`` (``{"t", "acc"}`` points in time order) with
    ``acc >= target``; None when none reaches it. See Note [Demo time to target]."""
    for point in curve:
        if point["acc"] >= target:
            return float(point["t"])
    return None


def add_time_to_target(records: Sequence[dict[str, Any]], target: float, baseline: str = "ddp") -> None:
    """Set ``target_acc``, ``time_to_target_s`` and ``time_to_target_vs_ddp`` on every record (in place):
    the time to ``target`` on its curve, and that time over the one of the record named ``baseline``
    (None where either is missing). See Note [Demo time to target]."""
    if not 0 < target <= 1:
        raise ValueError(f"target accuracy must be in (0, 1], got {target}")
    for r in records:
        r["target_acc"] = target
        r["time_to_target_s"] = time_to_target(r["curve"], target)
    base = next((r["time_to_target_s"] for r in records if r["name"] == baseline), None)
    for r in records:
        ttt = r["time_to_target_s"]
        r["time_to_target_vs_ddp"] = ttt / base if ttt is not None and base else None


def histogram_percentile(hist: Mapping[int, int], q: float) -> int | None:
    """Nearest-rank ``q``-quantile (0 < q <= 1) of a histogram ``{value: count}``; None when empty."""
    total = sum(hist.values())
    if total == 0:
        return None
    need = math.ceil(q * total)
    seen = 0
    for value in sorted(hist):
        seen += hist[value]
        if seen >= need:
            return int(value)
    return int(max(hist))


def format_table(records: Sequence[Mapping[str, Any]]) -> str:
    """A plain-text table of records (columns of TABLE_COLUMNS, DEVICE_COLUMN when some record has an
    emulated device, TARGET_COLUMNS when some record has a target; '-' where a field does not apply or
    the target was not reached)."""
    columns = TABLE_COLUMNS
    if any(r.get("device_ms") is not None for r in records):
        columns = (*columns, DEVICE_COLUMN)
    if any(r.get("target_acc") is not None for r in records):
        columns = (*columns, *TARGET_COLUMNS)
    head = [title for _, title, _ in columns]
    rows = [[("-" if r.get(k) is None else fmt.format(r[k])) for k, _, fmt in columns] for r in records]
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    return "\n".join([line(head), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def time_to_target_label(r: Mapping[str, Any]) -> str:
    """``r``'s name with its time to target and ratio to DDP's, as the plot's legend shows them."""
    ttt, ratio = r.get("time_to_target_s"), r.get("time_to_target_vs_ddp")
    if r.get("target_acc") is None:
        return str(r["name"])
    if ttt is None:
        return f"{r['name']}: target not reached"
    return f"{r['name']}: {ttt:.1f} s" + ("" if ratio is None else f" ({ratio:.2f}x ddp)")


def plot_curves(records: Sequence[Mapping[str, Any]], path: str, title: str = "") -> None:
    """Write a PNG of test accuracy against wall-clock time (left) and samples processed (right).

    With a target (records from :func:`add_time_to_target`) both panels draw it as a dashed line, and the
    left one marks each system's time to target with a dotted vertical line and a circle in its colour;
    the legend gives the times and their ratios to DDP's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    target = next((r["target_acc"] for r in records if r.get("target_acc") is not None), None)
    for r in records:
        ts = [p["t"] for p in r["curve"]]
        ss = [p["samples"] for p in r["curve"]]
        acc = [p["acc"] for p in r["curve"]]
        label = time_to_target_label(r)
        (line,) = ax_t.plot(ts, acc, marker=".", markersize=3, label=label)
        ax_s.plot(ss, acc, marker=".", markersize=3, color=line.get_color(), label=r["name"])
        if r.get("time_to_target_s") is not None:
            hit = next(p for p in r["curve"] if p["acc"] >= r["target_acc"])  # Note [Demo time to target]
            ax_t.axvline(hit["t"], color=line.get_color(), linestyle=":", linewidth=1)
            ax_t.plot(
                [hit["t"]], [hit["acc"]], marker="o", markersize=7, fillstyle="none", color=line.get_color()
            )
    if target is not None:
        for ax in (ax_t, ax_s):
            ax.axhline(target, color="black", linestyle="--", linewidth=1)
        ax_t.text(0.0, target, f" target {target:g}", va="bottom", ha="left", fontsize=8)
    ax_t.set_xlabel("wall-clock time (s)")
    ax_s.set_xlabel("samples processed by all workers")
    ax_t.set_ylabel("test accuracy (rank 0's parameters)")
    for ax in (ax_t, ax_s):
        ax.grid(alpha=0.3)
    ax_t.legend(loc="lower right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
