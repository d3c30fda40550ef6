"""End-to-end benchmark: DDP (plain, fp16, PowerSGD), pyasync's policies with and without compression, and
the peers hivemind and torchft (DDP-style, DiLoCo, LocalSGD), trained on the same data, model and seed,
with equal workers, a persistent straggler and transient slowdowns (and, on request, heterogeneous
speeds), optionally behind an emulated link of fixed bandwidth and on an emulated accelerator. The peers
need their own venv (``bash bench/peers/setup.sh``; run this script with ``.venv-peers/bin/python``),
else they are skipped.

    python bench/e2e.py --out e2e_out                    # everything (long; run on a quiet machine)
    python bench/e2e.py --out /tmp/e2e_quick --quick     # every system kind, a few minutes
    python bench/e2e.py --out e2e_1g --bandwidth 1       # every rank sends through a 1 Gbit/s link
    python bench/e2e.py --out e2e_dev --device-ms 20     # every step has 20 ms of emulated device compute
    python bench/e2e.py --out x --systems ddp,asp+int8 --scenarios slow2x --models mlp --epochs 10
    python bench/e2e.py --out lm --models lm --device-ms 100 --optimizer adamw   # the GPT, with AdamW

Each run spawns ``--workers`` local processes (gloo on loopback, one thread each), as ``python -m
pyasync.demo`` does. Output: ``OUT/e2e.json`` (a JSON list of records, rewritten after every run), PNG
plots in OUT and a summary table with each system's samples/s and time to target over DDP's in the same
scenario. docs/benchmarks.md says what is measured and how.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import _path  # noqa: F401  (first: sys.path, see bench/_path.py)
import common
from harness import scenarios as S
from harness import summary as E
from harness.peers import peer_status
from harness.plots import plot_e2e
from harness.train import calibrate_local, run_bench
from harness.workload import (
    ADAMW_BETAS,
    ADAMW_WEIGHT_DECAY,
    MODELS,
    OPTIMIZERS,
    BenchConfig,
    parse_systems,
)

from pyasync.demo.cli import add_device_option
from pyasync.demo.local import WorkerError, progress_bar, start_store_server

#: Budgets of --quick, in passes over the training set; the models other than mlp run only the equal
#: scenario.
QUICK_EPOCHS = {"mlp": 15, "wide": 3, "seq": 2, "lm": 4}
QUICK_WIDE_SCENARIOS = ("equal",)

#: The models of a run without --models: lm is opt-in (its budget alone is about a minute and a half per
#: system with --device-ms 100, and its metric is a loss; the other three keep their tables comparable).
DEFAULT_MODELS = ("mlp", "wide", "seq")

#: Keys every record starts with (the JSON holds more, see docs/benchmarks.md).
FIRST_KEYS = (
    "system",
    "policy",
    "compression",
    "scenario",
    "model",
    "samples_per_s",
    "time_to_target_s",
    "final_acc",
    "bytes_per_step",
    "bandwidth_gbps",
    "device_ms",
    "optimizer",
    "metric",
    "final_loss",
    "samples_per_s_vs_ddp",
    "time_to_target_vs_ddp",
    "target_acc",
    "target_loss",
    "wall_s",
    "staleness_hist",
)


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's command-line options."""
    p = argparse.ArgumentParser(
        prog="python bench/e2e.py",
        description="End-to-end benchmark: DDP and its compression hooks, pyasync policies with "
        "compression, hivemind and torchft, under equal workers, a straggler and transient slowdowns.",
    )
    p.add_argument("--out", required=True, help="directory for e2e.json and the plots")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a few minutes: every system kind once, short budgets "
        f"({', '.join(f'{m} {e} epochs' for m, e in QUICK_EPOCHS.items())}; every model but mlp: equal only)",
    )
    p.add_argument(
        "--bandwidth",
        type=float,
        default=None,
        metavar="GBPS",
        help="emulate a sending link of GBPS gigabits per second per worker",
    )
    add_device_option(
        p,
        "slowdowns become multiples of D, a 2x straggler sleeps 2D; the default scenarios are then "
        f"{','.join(S.DEVICE_SCENARIOS)}",
    )
    p.add_argument(
        "--systems",
        default=None,
        help="comma list: ddp, ddp+fp16, ddp+powersgd[:RANK], hivemind[:ROUND], torchft, "
        "torchft-diloco[:H][:lr=X][:momentum=M] (torchft's DiLoCo, H inner steps per outer step, default 16; "
        "outer Nesterov SGD, default lr 0.5, momentum 0.8 as local:H), torchft-localsgd[:H] (torchft's "
        "LocalSGD), or a pyasync policy (bsp, ssp:S, asp, quorum:K, local:H, ...) optionally +int8, "
        "+topk:RATIO, +fp16, ...; any of them @lr=X to train it at X times the model's lr "
        "(default: the 16 of docs/benchmarks.md)",
    )
    p.add_argument(
        "--scenarios",
        default=None,
        help=f"comma list of {', '.join(S.SCENARIOS)} (default: {','.join(S.DEFAULT_SCENARIOS)})",
    )
    p.add_argument(
        "--models",
        default=None,
        help=f"comma list of {', '.join(MODELS)} (default: {','.join(DEFAULT_MODELS)}; lm is opt-in)",
    )
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=None,
        help="what every system steps: sgd (each model's lr and momentum) or adamw (each model's adamw_lr, "
        f"betas {ADAMW_BETAS}, weight decay {ADAMW_WEIGHT_DECAY}) (default: each model's own, sgd)",
    )
    p.add_argument(
        "--epochs",
        type=int,
        default=None,
        help="budget of every model in passes over its training set (default: "
        + ", ".join(f"{m} {s.epochs}" for m, s in MODELS.items())
        + ")",
    )
    p.add_argument(
        "--target",
        default=None,
        help="target for time-to-target in each model's metric, test accuracy (reached from below) or, "
        "for lm, held-out loss in nats per token (reached from above): X for every model or MODEL=X,... "
        "(default "
        + ", ".join(
            f"{m}={s.target:g}" + ("" if s.adamw_target is None else f" ({s.adamw_target:g} with adamw)")
            for m, s in MODELS.items()
        )
        + ")",
    )
    p.add_argument("--workers", type=int, default=4, help="local worker processes (default 4)")
    p.add_argument("--batch-size", type=int, default=64, help="samples per step per worker (default 64)")
    p.add_argument("--seed", type=int, default=0, help="data, model init, batch order, slowdowns (default 0)")
    p.add_argument(
        "--compute-ms",
        type=float,
        default=None,
        help="fix the compute time C of one step (ms) for the injected delays instead of measuring it "
        "once per model",
    )
    p.add_argument(
        "--powersgd-warmup",
        type=int,
        default=None,
        help="ddp+powersgd: plain all-reduce steps before compressing (default min(10, 10%% of steps), >= 2)",
    )
    p.add_argument("--eval-points", type=int, default=40, help="accuracy snapshots per run (default 40)")
    p.add_argument("--timeout", type=float, default=120.0, help="timeout of every wait in a worker (s)")
    p.add_argument("--run-timeout", type=float, default=900.0, help="limit for one run (s, default 900)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def hivemind_status() -> str | None:
    """None when hivemind imports, else why not (one line)."""
    return peer_status("hivemind")


def _plan(args: argparse.Namespace, models: list[str]) -> list[tuple[str, S.Scenario]]:
    """(model, scenario) pairs in run order."""
    default = S.DEFAULT_SCENARIOS if args.device_ms is None else S.DEVICE_SCENARIOS
    scenarios = S.parse_scenarios(args.scenarios or ",".join(default), args.workers)
    plan = []
    for m in models:
        for sc in scenarios:
            if args.quick and m != "mlp" and args.scenarios is None and sc.name not in QUICK_WIDE_SCENARIOS:
                continue
            plan.append((m, sc))
    return plan


def _ordered(rec: dict[str, Any]) -> dict[str, Any]:
    return {**{k: rec.get(k) for k in FIRST_KEYS}, **{k: v for k, v in rec.items() if k not in FIRST_KEYS}}


def _write_json(path: str, records: list[dict[str, Any]]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump([_ordered(r) for r in records], f, indent=1)
    os.replace(tmp, path)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run the benchmark; returns the records (also written to OUT/e2e.json). Raises ValueError on bad
    options; a failed run becomes a record with ``error`` and the others still run."""
    args = build_parser().parse_args(argv)
    if args.workers < 2:
        raise ValueError(f"--workers must be >= 2, got {args.workers}")
    if args.epochs is not None and args.epochs < 1:
        raise ValueError(f"--epochs must be >= 1, got {args.epochs}")
    if args.bandwidth is not None and not 0 < args.bandwidth < float("inf"):
        raise ValueError(f"--bandwidth must be a finite number > 0 of Gbit/s, got {args.bandwidth}")
    if args.compute_ms is not None and not args.compute_ms >= 0:
        raise ValueError(f"--compute-ms must be >= 0, got {args.compute_ms}")
    if args.device_ms is not None and not 0 < args.device_ms < float("inf"):
        raise ValueError(f"--device-ms must be a finite number > 0 of milliseconds, got {args.device_ms}")
    if args.device_ms is not None and args.compute_ms is not None:
        raise ValueError(
            "--compute-ms sets C of the CPU-only mode; with --device-ms D every slowdown is a multiple of D"
        )
    systems = parse_systems(args.systems or S.default_systems(args.workers, args.quick), args.workers)
    models = [m.strip() for m in (args.models or ",".join(DEFAULT_MODELS)).split(",") if m.strip()]
    for m in models:
        if m not in MODELS:
            raise ValueError(f"--models: unknown model {m!r}, choose from {', '.join(MODELS)}")
    if not models or len(set(models)) != len(models):
        raise ValueError(f"--models: give unique model names from {', '.join(MODELS)}")
    defaults = {m: s.target_for(args.optimizer or s.optimizer) for m, s in MODELS.items()}
    targets = E.parse_targets(args.target, defaults, {m: s.metric for m, s in MODELS.items()})
    plan = _plan(args, models)
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "e2e.json")
    missing = {k: peer_status(k) for k in {s.kind for s in systems if s.is_peer}}
    missing = {k: why for k, why in missing.items() if why is not None}
    machine = common.machine_info()
    command = common.command_line()

    store = start_store_server(args.timeout)
    records: list[dict[str, Any]] = []
    compute_s: dict[str, float | None] = {}
    printed: set[str] = set()
    started = time.perf_counter()
    n_runs = 0
    for model, sc in plan:
        spec = MODELS[model]
        epochs = args.epochs or (QUICK_EPOCHS[model] if args.quick else spec.epochs)
        optimizer = args.optimizer or spec.optimizer

        def config(system, model=model, sc=sc, spec=spec, epochs=epochs, optimizer=optimizer) -> BenchConfig:
            return BenchConfig(
                system=system,
                workers=args.workers,
                model=model,
                optimizer=optimizer,
                epochs=epochs,
                batch_size=args.batch_size,
                hidden=spec.hidden,
                lr=(spec.adamw_lr if optimizer == "adamw" else spec.lr) * system.lr_scale,
                momentum=spec.momentum if optimizer == "sgd" else 0.0,
                seed=args.seed,
                straggler=sc.straggler,
                transient=sc.transient,
                speeds=sc.speeds,
                device_ms=args.device_ms,
                compute_s=compute_s.get(model),
                powersgd_warmup=args.powersgd_warmup,
                bandwidth_gbps=args.bandwidth,
                eval_points=args.eval_points,
                timeout_s=args.timeout,
            )

        if model not in compute_s:
            # See Note [Straggler injection]: C is measured once per model, all ranks at once, and the
            # same seconds are used by every system and scenario of this invocation.
            slowed = any(s.straggler or s.transient or s.speeds for m, s in plan if m == model)
            if not slowed or args.device_ms is not None:
                compute_s[model] = None  # nothing to inject, or multiples of D (Note [Emulated device])
            elif args.compute_ms is not None:
                compute_s[model] = args.compute_ms / 1e3
            else:
                per_rank = calibrate_local(
                    config(systems[0]), store, prefix=f"cal-{model}/", run_timeout_s=args.run_timeout
                )
                compute_s[model] = statistics.median(per_rank)
        if model not in printed and compute_s[model] is not None:
            printed.add(model)
            print(
                f"model {model}: {spec.data}; compute time C = {compute_s[model] * 1e3:.2f} ms per step"
                + (" (--compute-ms)" if args.compute_ms is not None else " (median over ranks)"),
                file=sys.stderr,
            )
        for system in systems:
            base = {
                "system": system.name,
                "policy": system.policy,
                "compression": system.compression,
                "kind": system.kind,
                "scenario": sc.name,
                "scenario_about": sc.about,
                "model": model,
                "optimizer": optimizer,
                "lr_scale": system.lr_scale,
                "metric": spec.metric,
                "target_acc": targets[model] if spec.metric == "acc" else None,
                "target_loss": targets[model] if spec.metric == "loss" else None,
                "bandwidth_gbps": args.bandwidth,
                "device_ms": args.device_ms,
                "machine": machine,
                "command": command,
                "quick": args.quick,
            }
            if system.kind in missing:
                note = f"skipped: {system.kind} is not importable ({missing[system.kind]})"
                records.append({**base, "skipped": True, "note": note})
                print(f"{model}/{sc.name}/{system.name}: {note}", file=sys.stderr)
                _write_json(json_path, records)
                continue
            cfg = config(system)
            total = cfg.budget(len(cfg.load_data().x_train)) * args.batch_size
            desc = f"{model}/{sc.name}/{system.name}"[:40].rjust(40)
            bar, advance = progress_bar(total, desc, disable=args.no_progress, leave=False)
            n_runs += 1
            try:
                rec = run_bench(
                    cfg, store, prefix=f"e2e{n_runs}/", progress=advance, run_timeout_s=args.run_timeout
                )
            except WorkerError as e:
                records.append({**base, "error": str(e)})
                print(f"{model}/{sc.name}/{system.name}: FAILED: {e}", file=sys.stderr)
            else:
                link_gbps = rec["bandwidth_gbps"]  # what the workers' link really was
                rec.update(base)
                rec["bandwidth_gbps"] = link_gbps
                rec["final_acc"] = rec["test_acc"]
                rec["final_loss"] = rec["curve"][-1]["loss"] if spec.metric == "loss" else None
                rec["time_to_target_s"] = E.time_to_target(rec["curve"], targets[model], spec.metric)
                records.append(rec)
            finally:
                bar.close()
            E.add_ratios(records)
            _write_json(json_path, records)

    E.add_ratios(records)
    _write_json(json_path, records)
    total_s = time.perf_counter() - started
    print()
    for model in dict.fromkeys(m for m, _ in plan):
        c = compute_s.get(model)
        spec = MODELS[model]
        optimizer = args.optimizer or spec.optimizer
        lr = spec.adamw_lr if optimizer == "adamw" else spec.lr
        steps = f"adamw lr {lr:g}" if optimizer == "adamw" else f"sgd lr {lr:g} momentum {spec.momentum:g}"
        what = "held-out loss <=" if spec.metric == "loss" else "test accuracy >="
        print(
            f"model {model}: {spec.data}, "
            + ("" if c is None else f"C = {c * 1e3:.2f} ms, ")
            + f"{steps}, target {what} {targets[model]:g}"
        )
    for sc in dict.fromkeys(sc for _, sc in plan):
        print(f"scenario {sc.name}: {sc.about}")
    if args.bandwidth is not None:
        print(f"link: {args.bandwidth:g} Gbit/s per sending worker (emulated, sender side only)")
    if args.device_ms is not None:
        print(
            f"device: {args.device_ms:g} ms of emulated compute per step (a sleep that leaves the CPU free; "
            "slowdowns are multiples of it)"
        )
    for kind, why in sorted(missing.items()):
        print(f"{kind}: skipped ({why})")
    print(E.format_summary(records))
    paths = plot_e2e(records, args.out)
    print(f"\nresults: {json_path}\nplots: {', '.join(paths) or '(none)'}\ntotal {total_s:.0f} s")
    return records


if __name__ == "__main__":
    try:
        recs = main()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(1 if any(r.get("error") for r in recs) else 0)
