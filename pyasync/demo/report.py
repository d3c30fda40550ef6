"""Reporting: percentiles of staleness histograms, the results table and the accuracy plot."""

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
    """A plain-text table of records (columns of TABLE_COLUMNS, and DEVICE_COLUMN when some record has an
    emulated device; '-' where a field does not apply)."""
    columns = TABLE_COLUMNS
    if any(r.get("device_ms") is not None for r in records):
        columns = (*columns, DEVICE_COLUMN)
    head = [title for _, title, _ in columns]
    rows = [[("-" if r.get(k) is None else fmt.format(r[k])) for k, _, fmt in columns] for r in records]
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    return "\n".join([line(head), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def plot_curves(records: Sequence[Mapping[str, Any]], path: str, title: str = "") -> None:
    """Write a PNG of test accuracy against wall-clock time (left) and samples processed (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for r in records:
        ts = [p["t"] for p in r["curve"]]
        ss = [p["samples"] for p in r["curve"]]
        acc = [p["acc"] for p in r["curve"]]
        (line,) = ax_t.plot(ts, acc, marker=".", markersize=3, label=r["name"])
        ax_s.plot(ss, acc, marker=".", markersize=3, color=line.get_color(), label=r["name"])
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
