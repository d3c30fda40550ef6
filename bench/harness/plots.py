"""The end-to-end benchmark's plots, per model: its metric (test accuracy, or held-out loss for lm) against
wall-clock time and samples, throughput."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

_POLICY_COLORS = {"ddp": "black", "bsp": "tab:blue", "ssp": "tab:orange", "asp": "tab:green",
                  "quorum": "tab:red", "hivemind": "tab:purple", "torchft": "tab:brown",
                  "torchft-diloco": "sienna", "torchft-localsgd": "rosybrown"}  # fmt: skip
_CODEC_STYLES = {None: "-", "none": "-", "fp16": "--", "int8": "--", "bf16": "--", "sign": "-.",
                 "topk": ":", "powersgd": ":"}  # fmt: skip


#: Variants of a policy get a colour of their own, so they can be told from the plain policy in one panel.
_VARIANT_COLORS = {"ssp-wide": "tab:cyan", "asp:inverse": "tab:olive", "quorum-fold": "tab:pink"}
#: Local steps by how their outer steps meet (``local:H``, ``local:H:async``, ``local:H:quorum:K``).
_LOCAL_COLORS = {"sync": "teal", "async": "limegreen", "quorum": "magenta"}

#: Per metric (a record's ``metric``, "acc" when absent): the curve's key, the y axis's label, the stem of
#: the file name and the words of the title.
_METRICS = {
    "acc": ("acc", "test accuracy (rank 0's parameters)", "accuracy", "accuracy"),
    "loss": ("loss", "held-out loss, nats/token (rank 0's params)", "loss", "held-out loss"),
}


def _style(r: Mapping[str, Any]) -> dict[str, Any]:
    """Line colour by system family (DDP, each policy, hivemind, torchft), line style by compression. SSP
    with a bound of 3 or more, ``asp:inverse``, Quorum with ``:fold`` and each mode of local steps get
    colours of their own; a system at a scaled lr (``NAME@lr=X``) gets markers on its line."""
    policy = r.get("policy") or ""
    kind = r.get("kind")
    family = kind if kind in _POLICY_COLORS else policy.split(":")[0]
    args = policy.split(":")[1:]
    color = _POLICY_COLORS.get(family, "tab:gray")
    if family == "ssp" and args and args[0].isdigit() and int(args[0]) >= 3:
        color = _VARIANT_COLORS["ssp-wide"]
    elif family == "asp" and "inverse" in args:
        color = _VARIANT_COLORS["asp:inverse"]
    elif family == "quorum" and "fold" in args:
        color = _VARIANT_COLORS["quorum-fold"]
    elif family == "local":
        color = _LOCAL_COLORS["async" if "async" in args else "quorum" if "quorum" in args else "sync"]
    codec = (r.get("compression") or "none").split(":")[0]
    style = {"color": color, "linestyle": _CODEC_STYLES.get(codec, "-")}
    if r.get("lr_scale", 1.0) != 1.0:
        style.update(marker="o", markersize=3)
    return style


def plot_e2e(records: Sequence[Mapping[str, Any]], out_dir: str) -> list[str]:
    """Write the end-to-end benchmark's PNGs into ``out_dir``; returns their paths.

    Per model: ``accuracy_vs_time_MODEL.png`` (one panel per scenario, test accuracy against wall-clock
    seconds, one line per system, the target as a dashed line), ``accuracy_vs_samples_MODEL.png`` (the
    same against the samples the cluster had claimed: what each system gets from a sample, whatever its
    speed); for a model scored by its loss (``metric`` "loss", lm) ``loss_vs_time_MODEL.png`` and
    ``loss_vs_samples_MODEL.png`` instead, held-out loss against the same axes; and
    ``throughput_MODEL.png`` (one panel per scenario, samples/s per system with DDP's as a
    vertical line). Skipped or failed runs are left out.
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
        y_key, y_label, y_stem, y_words = _METRICS[mine[0].get("metric") or "acc"]
        optimizer = mine[0].get("optimizer")
        name = f"{model} ({optimizer})" if optimizer else model

        for x_key, x_label, stem in (
            ("t", "wall-clock time (s)", f"{y_stem}_vs_time"),
            ("samples", "samples claimed (all workers)", f"{y_stem}_vs_samples"),
        ):
            fig, axes = plt.subplots(
                1, n, figsize=(5.0 * n + 2.0, 4.4), sharey=True, squeeze=False, layout="constrained"
            )
            for ax, sc in zip(axes[0], scenarios, strict=True):
                rows = [r for r in mine if r["scenario"] == sc]
                for r in rows:
                    ax.plot(
                        [p[x_key] for p in r["curve"]],
                        [p[y_key] for p in r["curve"]],
                        label=r["system"],
                        linewidth=1.4,
                        **_style(r),
                    )
                target = rows[0].get("target_loss" if y_key == "loss" else "target_acc")
                if target is not None:
                    ax.axhline(target, color="gray", linestyle="--", linewidth=0.8)
                ax.set_title(f"{sc}: {rows[0].get('scenario_about', '')}", fontsize=9)
                ax.set_xlabel(x_label)
                ax.grid(alpha=0.3)
            axes[0][0].set_ylabel(y_label)
            handles, labels = axes[0][0].get_legend_handles_labels()
            fig.legend(handles, labels, loc="outside right upper", fontsize=8)
            against = "wall-clock time" if x_key == "t" else "samples processed"
            fig.suptitle(f"model {name}: {y_words} against {against}{link}", fontsize=10)
            path = os.path.join(out_dir, f"{stem}_{model}.png")
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
        fig.suptitle(f"model {name}: samples/s (x DDP in the same scenario){link}", fontsize=10)
        path = os.path.join(out_dir, f"throughput_{model}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
