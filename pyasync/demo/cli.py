"""``python -m pyasync.demo``: DDP against pyasync's policies with one slow worker, on one machine.

Spawns ``--workers`` local processes (gloo on loopback, one thread each) per system, trains a small MLP
on scikit-learn's digits under each system in turn, then prints a table with each system's time to a
target accuracy and its ratio to DDP's, writes ``OUT/accuracy_vs_time.png`` and ``OUT/results.json``.
See docs/demo.md for how to read them, and the modules of ``pyasync.demo`` for what exactly is measured
and how the straggler is injected.

Note [Demo device time]
    The demo runs with an emulated accelerator by default (``--device-ms``, :data:`DEFAULT_DEVICE_MS`;
    Note [Emulated device]); ``--device-ms 0`` gives the CPU-only mode. In the CPU-only mode the 4
    workers share the cores of a small machine (2 on the development machine), and the straggler's
    sleep hands its core to the others, so the synchronous systems wait for it less than they would on
    hardware with one accelerator per worker: with a "3x" straggler ASP ran at only 1.2-1.3x DDP's
    throughput on the quiet development machine, and the curves overlapped. With device time that
    dominates a step, every rank waits for its own "device" with its CPU free, and a 3x straggler's
    steps really are 3x as long. The CPU part of a step (forward, backward, SGD step of the default
    MLP, 4 processes at once on the 2-core development machine) was about 7 ms on the quiet machine
    (the CPU-only demo's straggler measured 6.9 ms) and, with other jobs loading it (load average 11),
    a median of 37-45 ms without device time and 13-23 ms with D = 50 ms, since the sleeps free the
    cores. D = 50 ms keeps the CPU's share of a step near 10% on the quiet machine and under a third
    on the loaded one, while the whole demo (DDP's 100 steps of 3D per rank, then four more systems)
    stays at a few minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from pyasync.demo.config import SystemSpec, TrainConfig, parse_systems
from pyasync.demo.local import WorkerError, progress_bar, run_local, start_store_server
from pyasync.demo.report import DEFAULT_TARGET, add_time_to_target, format_table, plot_curves
from pyasync.demo.straggler import parse_straggler

#: The demo's emulated device time per step (ms) unless ``--device-ms`` says otherwise; see Note [Demo
#: device time]. ``examples/train_digits.py`` and bench/e2e.py keep the CPU-only default.
DEFAULT_DEVICE_MS = 50.0


def _default_policies(workers: int) -> str:
    return f"ddp,bsp,ssp:2,asp,quorum:{max(1, workers - 1)}"


def build_parser() -> argparse.ArgumentParser:
    """The demo's command-line options."""
    p = argparse.ArgumentParser(
        prog="python -m pyasync.demo",
        description="Train an MLP on scikit-learn's digits with N local workers, one of them slowed, "
        "under DDP and pyasync policies; print a table and plot test accuracy against wall-clock time.",
    )
    p.add_argument("--workers", type=int, default=4, help="local worker processes (default 4)")
    p.add_argument(
        "--policies",
        default=None,
        help="comma list of systems: ddp, or a pyasync policy (bsp, asp, ssp:S, quorum:K, asp:inverse, "
        "quorum:K:fold, ...) optionally with +fp16, +bf16, +int8, +sign or +topk:RATIO "
        "(default ddp,bsp,ssp:2,asp,quorum:WORKERS-1)",
    )
    p.add_argument(
        "--straggler",
        default=None,
        help="RANK:FACTOR makes that rank's steps FACTOR times its own compute time, or 'none' "
        "(default 3:3; WORKERS-1:3 with fewer than 4 workers)",
    )
    p.add_argument(
        "--straggler-delay-ms",
        type=float,
        default=None,
        help="CPU-only mode (--device-ms 0): fix the straggler's injected delay per step (ms) instead of "
        "measuring it in the first run",
    )
    add_device_option(p, default=DEFAULT_DEVICE_MS)
    p.add_argument(
        "--target",
        type=float,
        default=DEFAULT_TARGET,
        help=f"test accuracy whose time to reach the summary reports per system (default {DEFAULT_TARGET:g})",
    )
    d = TrainConfig
    p.add_argument(
        "--epochs",
        type=int,
        default=d.epochs,
        help=f"total work in passes over the training set (default {d.epochs})",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=d.batch_size,
        help=f"samples per step per worker (default {d.batch_size})",
    )
    p.add_argument(
        "--hidden", type=int, default=d.hidden, help=f"width of the MLP's hidden layers (default {d.hidden})"
    )
    p.add_argument("--lr", type=float, default=d.lr, help=f"SGD learning rate (default {d.lr})")
    p.add_argument("--momentum", type=float, default=d.momentum, help=f"SGD momentum (default {d.momentum})")
    p.add_argument(
        "--seed", type=int, default=d.seed, help=f"data split, model init and batch order (default {d.seed})"
    )
    p.add_argument(
        "--out", default="demo_out", help="directory for the plot and results.json (default demo_out)"
    )
    p.add_argument("--json", default=None, help="also write the table as a JSON list of records to this path")
    p.add_argument(
        "--timeout", type=float, default=60.0, help="timeout of every wait in a worker (s, default 60)"
    )
    p.add_argument(
        "--run-timeout", type=float, default=600.0, help="limit for one system's run (s, default 600)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def add_device_option(
    p: argparse.ArgumentParser, effect: str = "the straggler sleeps FACTOR x D", default: float | None = None
) -> None:
    """Add ``--device-ms D`` (Note [Emulated device]); ``effect`` says what it does to the slowdowns,
    ``default`` is D when the option is not given (None: off, CPU-only)."""
    p.add_argument(
        "--device-ms",
        type=float,
        default=default,
        metavar="D",
        help="emulated accelerator: every step sleeps D ms of simulated device compute, which leaves the "
        f"CPU free ({effect}); "
        + ("default: off, CPU-only" if default is None else f"default {default:g}; 0: off, CPU-only"),
    )


def check_device_ms(args: argparse.Namespace) -> None:
    """Reject a bad ``--device-ms`` or one given with ``--straggler-delay-ms``, naming the options;
    ``--device-ms 0`` means off (``args.device_ms`` becomes None: the CPU-only mode)."""
    if args.device_ms is not None and not 0 <= args.device_ms < float("inf"):
        raise ValueError(
            f"--device-ms must be a finite number >= 0 of milliseconds (0: off), got {args.device_ms}"
        )
    if args.device_ms == 0:
        args.device_ms = None
    if args.device_ms is not None and args.straggler_delay_ms is not None:
        raise ValueError(
            "--straggler-delay-ms fixes the straggler's delay of the CPU-only mode; with --device-ms D the "
            "straggler sleeps FACTOR x D per step (add --device-ms 0 for the CPU-only mode)"
        )


def train_config(
    args: argparse.Namespace,
    system: SystemSpec,
    workers: int,
    straggler: tuple[int, float] | None,
    straggler_delay_s: float | None,
) -> TrainConfig:
    """The TrainConfig of one run from the training options that the demo and ``examples/train_digits.py``
    share (``--epochs``, ``--batch-size``, ``--hidden``, ``--lr``, ``--momentum``, ``--seed``,
    ``--timeout``, ``--device-ms``)."""
    return TrainConfig(
        system=system,
        workers=workers,
        epochs=args.epochs,
        batch_size=args.batch_size,
        hidden=args.hidden,
        lr=args.lr,
        momentum=args.momentum,
        seed=args.seed,
        straggler=straggler,
        straggler_delay_s=straggler_delay_s,
        device_ms=args.device_ms,
        timeout_s=args.timeout,
    )


def main(argv: Sequence[str] | None = None) -> list[dict]:
    """Run the demo; returns the records (also printed and written). Raises on bad options or failure."""
    args = build_parser().parse_args(argv)
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    systems = parse_systems(args.policies or _default_policies(args.workers), args.workers)
    straggler = parse_straggler(args.straggler or f"{min(3, args.workers - 1)}:3", args.workers)
    delay_s = None if args.straggler_delay_ms is None else args.straggler_delay_ms / 1e3
    check_device_ms(args)
    if not 0 < args.target <= 1:
        raise ValueError(f"--target must be a test accuracy in (0, 1], got {args.target}")
    os.makedirs(args.out, exist_ok=True)

    store = start_store_server(args.timeout)
    records = []
    for i, system in enumerate(systems):
        cfg = train_config(args, system, args.workers, straggler, delay_s)
        total = cfg.budget(len(cfg.load_data().x_train)) * args.batch_size
        bar, advance = progress_bar(total, f"{system.name:>12}", disable=args.no_progress)
        try:
            record = run_local(
                cfg, store, prefix=f"run{i}/", progress=advance, run_timeout_s=args.run_timeout
            )
        finally:
            bar.close()
        if straggler is not None and delay_s is None and args.device_ms is None:
            delay_s = record["straggler"]["delay_s"]  # Note [Straggler injection]: same delay for all
        records.append(record)

    add_time_to_target(records, args.target)
    print()
    if args.device_ms is not None:
        print(
            f"emulated device: every step sleeps {args.device_ms:g} ms of simulated accelerator compute, "
            "leaving the CPU free (--device-ms D; --device-ms 0 for CPU-only; see docs/demo.md)"
        )
        if straggler is not None:
            print(
                f"straggler: rank {straggler[0]} sleeps {straggler[1] * args.device_ms:.2f} ms per step "
                f"({straggler[1]:g}x the device time)"
            )
    else:
        print(
            "CPU-only (--device-ms 0): the workers share this machine's cores, so a sleeping straggler "
            "lends its core to the others"
        )
        if straggler is not None:
            print(
                f"straggler: rank {straggler[0]} sleeps {delay_s * 1e3:.2f} ms per step "
                + (
                    "(fixed by --straggler-delay-ms)"
                    if args.straggler_delay_ms is not None
                    else f"({straggler[1]:g}x its measured compute time)"
                )
            )
    print(format_table(records))
    print(time_to_target_summary(records))
    plot = os.path.join(args.out, "accuracy_vs_time.png")
    title = f"{args.workers} workers, " + (
        f"rank {straggler[0]} slowed {straggler[1]:g}x" if straggler else "no straggler"
    )
    if args.device_ms is not None:
        title += f", emulated device {args.device_ms:g} ms per step"
    plot_curves(records, plot, title=title)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(records, f, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    print(
        f"\nplot: {plot}\nresults: {os.path.join(args.out, 'results.json')}"
        + (f", {args.json}" if args.json else "")
    )
    return records


def time_to_target_summary(records: Sequence[dict]) -> str:
    """The lines that give each system's time to the target accuracy and its ratio to DDP's (records
    from :func:`pyasync.demo.report.add_time_to_target`; Note [Demo time to target])."""
    target = records[0]["target_acc"]
    lines = [f"\ntime to test accuracy {target:g} (first snapshot at or above it; ratio to ddp's time):"]
    width = max(len(r["name"]) for r in records)
    for r in records:
        ttt, ratio = r["time_to_target_s"], r["time_to_target_vs_ddp"]
        if ttt is None:
            text = f"not reached (final accuracy {r['test_acc']:.4f})"
        else:
            text = f"{ttt:6.2f} s" + ("" if ratio is None else f"  {ratio:.2f}x ddp")
        lines.append(f"  {r['name']:<{width}}  {text}")
    return "\n".join(lines)


def cli(argv: Sequence[str] | None = None) -> int:
    """:func:`main` for the command line: bad options and failed runs print one error line; returns the
    exit status (0, or 1 on an error)."""
    try:
        main(argv)
    except (ValueError, WorkerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
