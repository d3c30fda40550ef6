"""The end-to-end benchmark's plots: accuracy against wall-clock time and throughput, per model."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

_POLICY_COLORS = {"ddp": "black", "bsp": "tab:blue", "ssp": "tab:orange", "asp": "tab:green",
                  "quorum": "tab:red", "hivemind": "tab:purple", "torchft": "tab:brown"}  # fmt: skip
_CODEC_STYLES = {None: "-", "none": "-", "fp16": "--", "int8": "--", "bf16": "--", "sign": "-.",
                 "topk": ":", "powersgd": ":"}  # fmt: skip


def _style(r: Mapping[str, Any]) -> dict[str, Any]:
    """Line colour by system family (DDP, each policy, hivemind, torchft), line style by compression."""
    kind = r.get("kind")
    family = kind if kind in ("ddp", "hivemind", "torchft") else (r.get("policy") or "").split(":")[0]
    codec = (r.get("compression") or "none").split(":")[0]
    return {"color": _POLICY_COLORS.get(family, "tab:gray"), "linestyle": _CODEC_STYLES.get(codec, "-")}


def plot_e2e(records: Sequence[Mapping[str, Any]], out_dir: str) -> list[str]:
    """Write the end-to-end benchmark's PNGs into ``out_dir``; returns their paths.

    Per model: ``accuracy_vs_time_MODEL.png`` (one panel per scenario, test accuracy against wall-clock
    seconds, one line per system, the target as a dashed line) and ``throughput_MODEL.png`` (one panel
    per scenario, samples/s per system with DDP's as a vertical line). Skipped or failed runs are left
    out.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in records if r.get("curve") and not r.get("skipped") and not r.get("error")]
    paths = []
    for model in dict.fromkeys(r["model"] for r in ran):
        mine = [r for r in ran if r["model"] == model]
        scenarios = list(dict.fromkeys(r["scenario"] for r in mine))
        bw = mine[0].get("bandwidth_gbps")
        link = f", link {bw:g} Gbit/s" if bw else ""
        device = mine[0].get("device_ms")
        link += f", emulated device {device:g} ms/step" if device else ""
        n = len(scenarios)

        fig, axes = plt.subplots(
            1, n, figsize=(5.0 * n + 2.0, 4.4), sharey=True, squeeze=False, layout="constrained"
        )
        for ax, sc in zip(axes[0], scenarios, strict=True):
            rows = [r for r in mine if r["scenario"] == sc]
            for r in rows:
                ax.plot(
                    [p["t"] for p in r["curve"]],
                    [p["acc"] for p in r["curve"]],
                    label=r["system"],
                    linewidth=1.4,
                    **_style(r),
                )
            target = rows[0].get("target_acc")
            if target is not None:
                ax.axhline(target, color="gray", linestyle="--", linewidth=0.8)
            ax.set_title(f"{sc}: {rows[0].get('scenario_about', '')}", fontsize=9)
            ax.set_xlabel("wall-clock time (s)")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("test accuracy (rank 0's parameters)")
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside right upper", fontsize=8)
        fig.suptitle(f"model {model}: accuracy against wall-clock time{link}")
        path = os.path.join(out_dir, f"accuracy_vs_time_{model}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

        fig, axes = plt.subplots(
            1, n, figsize=(max(7.0, 4.6 * n), 0.3 * len(mine) / n + 1.9), squeeze=False, layout="constrained"
        )
        for ax, sc in zip(axes[0], scenarios, strict=True):
            rows = [r for r in mine if r["scenario"] == sc]
            ys = range(len(rows))
            colors = [_style(r)["color"] for r in rows]
            bars = ax.barh(list(ys), [r["samples_per_s"] for r in rows], color=colors)
            for bar, r in zip(
                bars, rows, strict=True
            ):  # hatch by compression, as the line styles of the other plot
                bar.set_hatch({"-": "", "--": "//", ":": "..", "-.": "xx"}[_style(r)["linestyle"]])
                bar.set_edgecolor("white")
            ax.set_yticks(list(ys), [r["system"] for r in rows], fontsize=8)
            ax.invert_yaxis()
            ddp = [r for r in rows if r["system"] == "ddp"]
            if ddp:
                ax.axvline(ddp[0]["samples_per_s"], color="black", linestyle="--", linewidth=0.8)
            for y, r in zip(ys, rows, strict=True):
                ratio = r.get("samples_per_s_vs_ddp")
                if ratio is not None:
                    ax.text(r["samples_per_s"], y, f" {ratio:.2f}x", va="center", fontsize=7)
            ax.set_title(sc, fontsize=9)
            ax.set_xlabel("samples/s (all workers)")
            ax.grid(alpha=0.3, axis="x")
        fig.suptitle(f"model {model}: samples/s (x DDP in the same scenario){link}", fontsize=10)
        path = os.path.join(out_dir, f"throughput_{model}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
