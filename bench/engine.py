"""Engine step-time benchmark: DDP against pyasync (BSP, ASP, ...) on the same model, gloo, one machine.

Each mode runs in its own set of ``--ranks`` processes (gloo, ``torch.set_num_threads(--threads)``):
an MLP on a fixed random batch, plain SGD: ``--model small`` 64-256-256-10 (~85K fp32 parameters, one
bucket; the default), ``mlp`` 64-512-512-10 and ``wide`` 256-2048-2048-10 (the shapes of bench/e2e.py's
models). After ``--warmup`` untimed steps and a barrier, every rank times ``--steps`` steps
(``zero_grad``/forward/backward/``step``) with ``time.perf_counter`` and measures its process CPU time
(all threads: training thread, engine threads, gloo's threads) with ``time.process_time``. The figure
of a mode is the slowest rank's wall time per step (the job moves at the pace of its slowest rank) and
the mean CPU per rank per step; each record also has the mean time per rank and step of the forward
pass, of backward() (DDP's all-reduce that backward waits for, and the reduces pyasync's BSP launches
from its hooks, included) and of step(). ``--device-ms D`` sleeps D ms before every forward pass (an
emulated accelerator that leaves the CPU free, as bench/e2e.py's), ``--bucket-mb`` sets pyasync's
``bucket_cap_mb``. Modes run one after the other, so background load on a shared machine
hits them unevenly: repeat with ``--rounds`` (modes interleaved round-robin) and read the medians.

    python bench/engine.py --out engine.json                 # ddp, bsp, asp; 4 ranks; 3 rounds
    python bench/engine.py --systems ddp,bsp,ssp:1,asp --steps 300 --rounds 5
    python bench/engine.py --systems ddp,bsp --model mlp --batch 64 --bucket-mb 1 --rounds 5

Output: a table on stdout and, with ``--out``, a JSON list with one record per mode (median over
rounds, every round's figures, the machine and the command line), see bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from typing import Any

import _path  # noqa: F401  (first: sys.path, see bench/_path.py)
import common
import torch
import torch.distributed as dist
from harness.cli import add_systems_option, parse_system_specs, split_systems
from harness.launch import run_ranks

_TIMEOUT_S = 120.0  # any wait inside a rank (process group, pyasync), seconds
_RUN_TIMEOUT_S = 1800.0  # one round of one mode, seconds


#: --model: (features, hidden) of an MLP features-hidden-hidden-10
MODELS = {"small": (64, 256), "mlp": (64, 512), "wide": (256, 2048)}


def _model(name: str) -> torch.nn.Module:
    features, hidden = MODELS[name]
    return torch.nn.Sequential(
        torch.nn.Linear(features, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )


def _rank_main(rank: int, world: int, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One rank of one round (started by harness.launch.run_ranks, in its gloo group): its record."""
    import pyasync

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = _model(args.model)
    if mode == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
    else:
        net = model
        spec, _, transport = mode.partition("@")
        policy, _, codec = spec.partition("+")
        factory = None
        if transport == "gloo":
            from pyasync.transport.gloo import GlooTransport as factory
        elif transport not in ("", "tcp"):
            raise SystemExit(f"unknown transport {transport!r} in mode {mode!r}: use @tcp or @gloo")
        opt = pyasync.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05),
            policy=policy,
            timeout=datetime.timedelta(seconds=120),
            transport=factory,
            bucket_cap_mb=args.bucket_mb,
            compression=codec or None,
        )
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, MODELS[args.model][0], generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    phases = {"fwd": 0.0, "bwd": 0.0, "step": 0.0}

    def step() -> None:
        if args.device_ms:
            time.sleep(args.device_ms / 1e3)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        phases["fwd"] += t1 - t0
        phases["bwd"] += t2 - t1
        phases["step"] += t3 - t2

    for _ in range(args.warmup):
        step()
    if mode == "ddp":
        dist.barrier()
    else:
        # A plain barrier can strand a slow rank under Quorum(k < n), see DistributedOptimizer.barrier.
        opt.barrier()
    phases.update(fwd=0.0, bwd=0.0, step=0.0)
    cpu0, t0 = time.process_time(), time.perf_counter()
    for _ in range(args.steps):
        step()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    rec: dict[str, Any] = {
        "rank": rank,
        "ms_per_step": 1e3 * wall / args.steps,
        "cpu_ms_per_step": 1e3 * cpu / args.steps,
        **{f"{k}_ms": 1e3 * v / args.steps for k, v in phases.items()},
    }
    if mode != "ddp":
        st = opt.stats()
        rec["bytes_sent_per_step"] = st.bytes_sent / st.clock if st.clock else None
        opt.close()
    dist.barrier()
    return rec


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One round of one mode: ``args.ranks`` processes; returns the slowest rank's ms/step, the mean
    CPU ms per rank per step and the per-rank records."""
    recs = run_ranks(
        _rank_main, args.ranks, (mode, args), name="engine",
        timeout_s=_TIMEOUT_S, run_timeout_s=_RUN_TIMEOUT_S, threads=None,
    )
    return {
        "ms_per_step": max(r["ms_per_step"] for r in recs),
        "cpu_ms_per_rank_step": statistics.mean(r["cpu_ms_per_step"] for r in recs),
        **{f"{k}_ms": statistics.mean(r[f"{k}_ms"] for r in recs) for k in ("fwd", "bwd", "step")},
        "ranks": recs,
        "loadavg": common.loadavg(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_systems_option(
        ap,
        "--modes",
        default="ddp,bsp,asp",
        help="comma-separated: ddp or a pyasync policy spec, optionally +COMPRESSION (e.g. bsp+topk:0.01) "
        "and @tcp (default) or @gloo, "
        "the point-to-point transport (e.g. asp@gloo)",
    )
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200, help="timed steps per round")
    ap.add_argument("--warmup", type=int, default=20, help="untimed steps before the barrier")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, modes interleaved; medians reported")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads per rank")
    ap.add_argument("--model", choices=sorted(MODELS), default="small", help="the MLP (default small)")
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="pyasync's bucket_cap_mb (default 25)")
    ap.add_argument("--device-ms", type=float, default=0.0, help="sleep before each forward pass (ms)")
    ap.add_argument("--out", default=None, help="JSON output path")
    args = ap.parse_args(argv)
    for name in ("ranks", "steps", "rounds", "batch", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        ap.error(f"--warmup must be >= 0, got {args.warmup}")
    if not args.bucket_mb > 0 or not args.device_ms >= 0:
        ap.error("--bucket-mb must be > 0 and --device-ms >= 0")
    try:
        modes = split_systems(args.systems)
        for m in modes:
            spec, _, transport = m.partition("@")
            parse_system_specs(spec, args.ranks)
            if transport not in ("", "tcp", "gloo"):
                raise ValueError(f"unknown transport {transport!r} in {m!r}: use @tcp or @gloo")
    except ValueError as e:
        ap.error(str(e))
    rounds: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for i in range(args.rounds):
        for m in modes:
            r = run_mode(m, args)
            rounds[m].append(r)
            print(
                f"round {i + 1}/{args.rounds} {m:>8}: {r['ms_per_step']:7.2f} ms/step, "
                f"{r['cpu_ms_per_rank_step']:6.2f} CPU ms/rank/step (fwd {r['fwd_ms']:.2f}, bwd "
                f"{r['bwd_ms']:.2f}, step {r['step_ms']:.2f} ms; load {r['loadavg']})",
                flush=True,
            )
    machine, cmd = common.machine_info("cpu"), common.command_line()
    records = []
    for m in modes:
        rs = rounds[m]
        records.append(
            {
                "bench": "engine",
                "mode": m,
                "ranks": args.ranks,
                "steps": args.steps,
                "batch": args.batch,
                "threads": args.threads,
                "model": "mlp {}-{h}-{h}-10, sgd".format(*MODELS[args.model], h=MODELS[args.model][1]),
                "bucket_cap_mb": None if m == "ddp" else args.bucket_mb,
                "device_ms": args.device_ms,
                "ms_per_step": statistics.median(r["ms_per_step"] for r in rs),
                "cpu_ms_per_rank_step": statistics.median(r["cpu_ms_per_rank_step"] for r in rs),
                **{f"{k}_ms": statistics.median(r[f"{k}_ms"] for r in rs) for k in ("fwd", "bwd", "step")},
                "vs_ddp": None,
                "rounds": rs,
                "machine": machine,
                "command": cmd,
            }
        )
    ddp = [r for r in records if r["mode"] == "ddp"]
    for r in records:  # steps/s against DDP's: the median over rounds of the ratio within each round
        if ddp:
            r["vs_ddp"] = statistics.median(
                d["ms_per_step"] / x["ms_per_step"] for d, x in zip(ddp[0]["rounds"], r["rounds"])
            )
    print(
        common.format_table(
            records,
            [
                ("mode", "mode"),
                ("ms_per_step", "ms/step"),
                ("vs_ddp", "steps/s x ddp"),
                ("cpu_ms_per_rank_step", "CPU ms/rank/step"),
                ("fwd_ms", "fwd ms"),
                ("bwd_ms", "bwd ms"),
                ("step_ms", "step ms"),
            ],
        )
    )
    common.write_results(args.out, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
