"""The end-to-end benchmark's summary (``python bench/e2e.py``): targets, time to target, ratios against DDP
and the summary table. docs/benchmarks.md describes the benchmark.

Note [Time to target]
    Rank 0 snapshots its parameters every ``eval_every`` of its steps (about ``eval_points`` times per
    run, see Note [Timing and evaluation]); the snapshots are evaluated after training, giving the curve
    of the workload's metric against wall-clock seconds since the start barrier. Time to target is the
    time of the first point of that curve that reaches the target: accuracy >= the target, or for a
    workload scored by its loss (``lm``, ``ModelSpec.metric == "loss"``) held-out loss <= the target.
    It is an upper bound, late by at most one snapshot interval (about 1/40 of the run), the same
    resolution for every system, and None when no point reaches the target, including the final model
    after ``close()``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["add_ratios", "format_summary", "parse_per_model", "parse_targets", "time_to_target"]


def parse_per_model(
    text: str | None, defaults: Mapping[str, float], option: str, example: str
) -> dict[str, float]:
    """A number per model: ``None`` or empty (the defaults), ``X`` (every model) or ``MODEL=X,...`` (the
    named models; the others keep their default). ValueError naming ``option`` (e.g. ``--target``)
    with ``example`` (e.g. ``mlp=0.95,wide=0.9``) for anything else."""
    out = dict(defaults)
    if text is None or not text.strip():
        return out
    items = [t.strip() for t in text.split(",") if t.strip()]
    try:
        if len(items) == 1 and "=" not in items[0]:
            out = dict.fromkeys(out, float(items[0]))
        else:
            for item in items:
                name, eq, value = item.partition("=")
                if not eq or name.strip() not in defaults:
                    raise ValueError(item)
                out[name.strip()] = float(value)
    except ValueError:
        raise ValueError(
            f"{option} {text!r}: give a number for every model or MODEL=X pairs (e.g. {example}) for models "
            f"{sorted(defaults)}"
        ) from None
    return out


def parse_targets(
    text: str | None, defaults: Mapping[str, float], metrics: Mapping[str, str] | None = None
) -> dict[str, float]:
    """Targets per model: ``None`` (the defaults), ``X`` (every model) or ``MODEL=X,...`` (the named
    models; the others keep their default). ``metrics[model]`` says what a target is (default "acc"): an
    accuracy in (0, 1] for "acc", a finite loss > 0 (nats per token) for "loss"."""
    out = parse_per_model(text, defaults, "--target", "0.95, or mlp=0.95,wide=0.9,lm=1.3")
    for m, value in out.items():
        metric = (metrics or {}).get(m, "acc")
        if metric == "loss" and not 0 < value < float("inf"):
            raise ValueError(f"--target: held-out loss of {m!r} must be a finite number > 0, got {value}")
        if metric == "acc" and not 0 < value <= 1:
            raise ValueError(f"--target: accuracy of {m!r} must be in (0, 1], got {value}")
    return out


def time_to_target(curve: Sequence[Mapping[str, float]], target: float, metric: str = "acc") -> float | None:
    """Seconds to the first point of ``curve`` (``{"t", metric}`` points in time order) that reaches
    ``target``: ``acc >= target`` for ``metric="acc"``, ``loss <= target`` for ``metric="loss"``; None
    when none does. See Note [Time to target]."""
    if metric not in ("acc", "loss"):
        raise ValueError(f"metric must be 'acc' (higher is better) or 'loss' (lower is better): {metric!r}")
    for point in curve:
        if (point[metric] >= target) if metric == "acc" else (point[metric] <= target):
            return float(point["t"])
    return None


def _group(r: Mapping[str, Any]) -> tuple:
    keys = ("model", "optimizer", "scenario", "bandwidth_gbps", "device_ms")
    return tuple(r.get(k) for k in keys)


def add_ratios(records: Sequence[dict[str, Any]], baseline: str = "ddp") -> None:
    """Set ``samples_per_s_vs_ddp`` and ``time_to_target_vs_ddp`` on every record (in place): the
    record's samples/s and time to target over those of ``baseline`` in the same model, optimizer,
    scenario, bandwidth and emulated device time, measured in the same invocation. None where either
    side is missing."""
    base = {_group(r): r for r in records if r.get("system") == baseline and not r.get("skipped")}
    for r in records:
        b = base.get(_group(r))
        sps, bsps = r.get("samples_per_s"), None if b is None else b.get("samples_per_s")
        r["samples_per_s_vs_ddp"] = sps / bsps if sps is not None and bsps else None
        ttt, bttt = r.get("time_to_target_s"), None if b is None else b.get("time_to_target_s")
        r["time_to_target_vs_ddp"] = ttt / bttt if ttt is not None and bttt else None


_SUMMARY = (
    ("model", "model", "{}"),
    ("scenario", "scenario", "{}"),
    ("system", "system", "{}"),
    ("optimizer", "optimizer", "{}"),
    ("samples_per_s", "samples/s", "{:.0f}"),
    ("samples_per_s_vs_ddp", "x ddp", "{:.2f}"),
    ("time_to_target_s", "t->target s", "{:.2f}"),
    ("time_to_target_vs_ddp", "t x ddp", "{:.2f}"),
    ("final_acc", "final acc", "{:.4f}"),
    ("bytes_per_step", "KB/step", None),
    ("staleness_p50", "stale p50", "{}"),
    ("staleness_p99", "stale p99", "{}"),
    ("pushes_dropped", "dropped", "{}"),
)

#: The held-out loss of a workload scored by it (lm), a column after "final acc" when some record has one.
_LOSS = ("final_loss", "final loss", "{:.4f}")
#: The emulated device's time per step, a column when some record has one.
_DEVICE = ("device_ms", "device ms", "{:g}")


def _cell(r: Mapping[str, Any], key: str, fmt: str | None) -> str:
    if key == "system" and r.get("link_emulated") is False:  # not behind --bandwidth's link: say so
        return f"{r.get(key)} (no link)"
    if key in ("model", "scenario", "system"):
        return str(r.get(key))
    if key in ("device_ms", "optimizer"):  # properties of the run: shown for skipped and failed runs too
        return "-" if r.get(key) is None else fmt.format(r[key])
    if r.get("skipped"):
        return "skipped" if key == "samples_per_s" else "-"
    if r.get("error"):
        return "failed" if key == "samples_per_s" else "-"
    v = r.get(key)
    if v is None:
        return "-"
    if key == "bytes_per_step":
        return f"{v / 1e3:.1f}"
    return fmt.format(v)


def format_summary(records: Sequence[Mapping[str, Any]]) -> str:
    """The summary table: one row per run (its optimizer among the first columns); ratios against DDP in
    the same model, optimizer and scenario. A column gives the final held-out loss when some record has
    one (lm), a last one the emulated device's ms per step when some record has one."""
    columns = _SUMMARY
    if any(r.get("final_loss") is not None for r in records):
        at = [k for k, _, _ in columns].index("final_acc") + 1
        columns = (*columns[:at], _LOSS, *columns[at:])
    if any(r.get("device_ms") is not None for r in records):
        columns = (*columns, _DEVICE)
    head = [title for _, title, _ in columns]
    rows = [[_cell(r, k, fmt) for k, _, fmt in columns] for r in records]
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    return "\n".join([line(head), line(["-" * w for w in widths]), *(line(r) for r in rows)])
