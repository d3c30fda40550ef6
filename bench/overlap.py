"""Overlap benchmark: how much of the communication the backward pass hides, per bucket size, for pyasync
(BSP, no compression; ``--int8`` adds int8) against torch DDP (gloo) with the same bucket caps.

Model and workers: an MLP of ``--depth`` Linear(``--width``, ``--width``) layers with ReLU between
them (default 80 x 512: 21.0 M fp32 parameters, 80 MiB of gradients; each layer's weight and bias
are 1.002 MiB, so a 1 MB cap gives one layer per bucket, 5 MB five and 25 MB twenty-five), a fixed
random batch of ``--batch`` rows per worker, MSE loss, plain SGD. ``--workers`` processes are spawned
on this machine, gloo over loopback, ``torch.set_num_threads(1)`` and one pyasync kernel thread each.
Bucket caps are MiB (2**20 bytes): DDP's ``bucket_cap_mb`` and pyasync's
``DistributedOptimizer(bucket_cap_mb=...)``.

Definition (the same formula for both systems):

* ``T_compute``: zero_grad + forward + backward + a local SGD step of the full model, with no
  communication at all (a plain copy of the model, no DDP wrapper, no pyasync hooks). It does not
  depend on the system; it is measured once per round and used by every system's record.
* ``T_serial``: a step whose communication is not overlapped with backward. DDP: backward under
  ``ddp.no_sync()``, then the gradients are all-reduced in DDP's own buckets (the rebuilt bucket
  assignment DDP reports after warm-up): each bucket is copied into a flat buffer, divided by n and
  all-reduced asynchronously, all buckets are waited for and copied back, then the SGD step. pyasync:
  backward under ``opt.no_sync()`` (the gradient hooks return at once, nothing is pushed), then
  ``opt.step()``, which hands every bucket to the push thread at step time (``Engine.step`` enqueues
  every bucket not yet enqueued), waits for the owners' BSP answers and installs them.
* ``T_overlap``: a normal step: DDP all-reduces and pyasync pushes start from the gradient hooks
  during backward.
* ``comm = T_serial - T_compute``: the communication alone (for pyasync: everything the engine adds
  to a step: flatten, encode, push, the owner's apply on its 1/n shard, replies and install, less the
  full local SGD step that T_compute makes and pyasync's workers do not).
* ``exposed = T_overlap - T_compute``: the communication the overlapped step still pays.
* ``hidden_fraction = 1 - exposed / comm``, raw, nothing clipped: 1 means all communication is hidden
  behind backward, 0 means overlapping gained nothing over communicating after backward. Below 0, the
  overlapped step is slower than the serial one (overlap costs more than it hides: the communication
  competes with backward for cores and the GIL, or many small messages cost more than a few large
  ones). Above 1, the overlapped step is faster than the compute-only step: noise, or (pyasync) a
  step that is cheaper than the local full-model SGD step of T_compute once communication hides.

Timing: each worker builds, per bucket size, the plain model, a DDP replica and a pyasync replica (all
from the same initial values), warms every mode up, then runs ``--rounds`` rounds; a round runs one
step of every (system, mode) in an order rotated by one each round, so that load changes hit the
modes alike. Every timed step starts after a ``dist.barrier()`` (not timed), so the ranks start it
together; a step's time is the slowest rank's (``time.perf_counter`` on each rank), and the figures
are medians over rounds. Each step also records its rank's process CPU time (user + system, all
threads: training, engine and gloo threads) and minor page faults (``getrusage``); those are means
over ranks, medians over rounds. A CPU time per rank close to the wall time, with no more cores than
workers, means the communication is CPU work that competes with backward for the cores: overlap can
only hide what leaves a core idle.

    python bench/overlap.py                          # 2 workers, 1/5/25 MB, ddp and pyasync
    python bench/overlap.py --int8 --out overlap.json
    python bench/overlap.py --quick                  # 5 rounds, 1 warm-up step per mode
    python bench/overlap.py --workers 4 --bucket-mb 1,25

Output: a table on stdout and, with ``--out``, a JSON list with one record per (system, bucket_mb);
see bench/README.md for the fields.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import math
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import _path  # noqa: F401  (first: sys.path, see bench/_path.py)
import common
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness.launch import ONE_THREAD_ENV, run_ranks

SYSTEMS = ("ddp", "pyasync", "pyasync:int8")
MODES = ("serial", "overlap")


@dataclass(frozen=True)
class Config:
    """One benchmark run. Times are seconds; bucket caps MiB."""

    workers: int = 2
    bucket_mb: tuple[float, ...] = (1.0, 5.0, 25.0)
    systems: tuple[str, ...] = ("ddp", "pyasync")
    width: int = 512
    depth: int = 80
    batch: int = 16
    rounds: int = 20
    warmup: int = 3
    lr: float = 1e-4
    timeout_s: float = 120.0  # every collective and every pyasync wait inside the workers
    run_timeout_s: float = 3600.0  # the whole run, enforced by the parent

    def validate(self) -> None:
        if self.workers < 2:
            raise ValueError(f"workers must be >= 2, got {self.workers}")
        if not self.bucket_mb or any(not (math.isfinite(b) and b > 0) for b in self.bucket_mb):
            raise ValueError(f"bucket sizes must be MiB > 0, got {self.bucket_mb}")
        bad = [s for s in self.systems if s not in SYSTEMS]
        if bad or not self.systems:
            raise ValueError(f"systems must be some of {SYSTEMS}, got {self.systems}")
        for name in ("width", "depth", "batch", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.timeout_s <= 0 or self.run_timeout_s <= 0:
            raise ValueError("timeouts must be > 0 seconds")


def build_model(width: int, depth: int) -> torch.nn.Sequential:
    """``depth`` Linear(width, width) layers, ReLU between them; He-normal weights and zero biases from
    a fixed seed (the same on every rank), so activations keep their scale through the depth (no
    denormals, whose arithmetic is slow on CPUs, and no blow-up)."""
    g = torch.Generator().manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i in range(depth):
        lin = torch.nn.Linear(width, width)
        with torch.no_grad():
            lin.weight.normal_(0.0, math.sqrt(2.0 / width), generator=g)
            lin.bias.zero_()
        layers.append(lin)
        if i < depth - 1:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


# ------------------------------------------------------------------------------------------------
# DDP's buckets, all-reduced after backward (the serial DDP step)


def _greedy_buckets(params: Sequence[torch.Tensor], cap_bytes: int) -> list[list[int]]:
    """DDP's rule without its report: reverse parameter order, a bucket closes once it holds >= cap."""
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i in reversed(range(len(params))):
        cur.append(i)
        size += params[i].numel() * params[i].element_size()
        if size >= cap_bytes:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


def ddp_buckets(ddp: torch.nn.parallel.DistributedDataParallel, cap_bytes: int) -> list[list[int]]:
    """The parameter indices of DDP's buckets, in all-reduce order: the rebuilt assignment DDP reports
    after its first iterations (``rebuilt_per_bucket_param_indices``), or the same greedy rule when this
    torch does not report it."""
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    text = ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices")
    if isinstance(text, str) and text.strip():
        plan = [[int(i) for i in part.split()] for part in text.split(",")]
        if sorted(i for b in plan for i in b) == list(range(len(params))):
            return plan
    return _greedy_buckets(params, cap_bytes)


class BucketAllReduce:
    """All-reduce (mean over ranks) of the gradients of ``params`` in the given buckets, as DDP's reducer
    does it: copy each bucket into a flat buffer, divide by n, launch an asynchronous all-reduce; then
    wait for each and copy the bucket back into the gradients."""

    def __init__(self, params: Sequence[torch.Tensor], plan: list[list[int]], timeout_s: float) -> None:
        self.buckets = [[params[i] for i in b] for b in plan]
        self.flats = [torch.empty(sum(p.numel() for p in b), dtype=torch.float32) for b in self.buckets]
        self.n = dist.get_world_size()
        self.timeout = datetime.timedelta(seconds=timeout_s)

    def __call__(self) -> None:
        works = []
        for ps, flat in zip(self.buckets, self.flats):
            torch.cat([p.grad.reshape(-1) for p in ps], out=flat)
            flat.div_(self.n)
            works.append(dist.all_reduce(flat, async_op=True))
        for ps, flat, work in zip(self.buckets, self.flats, works):
            work.wait(self.timeout)
            o = 0
            for p in ps:
                n = p.numel()
                p.grad.view(-1).copy_(flat[o : o + n])
                o += n


# ------------------------------------------------------------------------------------------------
# One worker process


def _measure_bucket(rank: int, cfg: Config, mb: float) -> dict[str, Any]:
    """Build every system for bucket cap ``mb``, warm up, run the rounds; this rank's step times."""
    import pyasync

    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    base = build_model(cfg.width, cfg.depth)
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own data, as in data parallelism
    x = torch.randn(cfg.batch, cfg.width, generator=g)
    y = torch.randn(cfg.batch, cfg.width, generator=g)

    steps: dict[str, Callable[[], None]] = {}
    models: dict[str, torch.nn.Module] = {}
    buckets: dict[str, int] = {}
    closers: list[Callable[[], None]] = []

    plain = copy.deepcopy(base)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=cfg.lr)
    models["compute"] = plain

    def compute() -> None:
        plain_opt.zero_grad(set_to_none=False)
        F.mse_loss(plain(x), y).backward()
        plain_opt.step()

    steps["compute"] = compute

    if "ddp" in cfg.systems:
        ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=mb)
        ddp_opt = torch.optim.SGD(ddp.parameters(), lr=cfg.lr)
        models["ddp"] = ddp.module

        def ddp_overlap() -> None:
            ddp_opt.zero_grad(set_to_none=False)
            F.mse_loss(ddp(x), y).backward()
            ddp_opt.step()

        # DDP rebuilds its buckets in its first iterations; the serial step copies that assignment.
        for _ in range(3):
            ddp_overlap()
        plan = ddp_buckets(ddp, int(mb * (1 << 20)))
        reduce = BucketAllReduce([p for p in ddp.module.parameters() if p.requires_grad], plan, cfg.timeout_s)
        buckets["ddp"] = len(plan)

        def ddp_serial() -> None:
            ddp_opt.zero_grad(set_to_none=False)
            with ddp.no_sync():
                F.mse_loss(ddp(x), y).backward()
            reduce()
            ddp_opt.step()

        steps["ddp/serial"] = ddp_serial
        steps["ddp/overlap"] = ddp_overlap

    for system in cfg.systems:
        if not system.startswith("pyasync"):
            continue
        net = copy.deepcopy(base)
        opt = pyasync.DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=cfg.lr),
            policy="bsp",
            compression="int8" if system == "pyasync:int8" else None,
            bucket_cap_mb=mb,
            timeout=timeout,
        )
        models[system] = net
        buckets[system] = len(opt.bucket_layouts)
        closers.append(opt.close)

        def pa_overlap(opt=opt, net=net) -> None:
            opt.zero_grad(set_to_none=False)
            F.mse_loss(net(x), y).backward()
            opt.step()

        def pa_serial(opt=opt, net=net) -> None:
            opt.zero_grad(set_to_none=False)
            with opt.no_sync():  # hooks push nothing; step() pushes every bucket
                F.mse_loss(net(x), y).backward()
            opt.step()

        steps[f"{system}/serial"] = pa_serial
        steps[f"{system}/overlap"] = pa_overlap

    names = list(steps)
    for _ in range(cfg.warmup):
        for name in names:
            steps[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    faults: dict[str, list[int]] = {name: [] for name in names}
    for r in range(cfg.rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:  # the same order on every rank: the steps are collective
            dist.barrier()
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            steps[name]()
            t1 = time.perf_counter()
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            samples[name].append(1e3 * (t1 - t0))
            cpu[name].append(1e3 * (ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime))
            faults[name].append(ru1.ru_minflt - ru0.ru_minflt)
    for close in closers:
        close()
    finite = {k: all(bool(torch.isfinite(p).all()) for p in m.parameters()) for k, m in models.items()}
    return {
        "bucket_mb": mb,
        "buckets": buckets,
        "samples_ms": samples,
        "cpu_ms": cpu,
        "minflt": faults,
        "finite": finite,
    }


def _worker(rank: int, world: int, cfg: Config) -> list[dict[str, Any]]:
    """One rank (started by harness.launch.run_ranks): every bucket size's figures."""
    t0 = time.monotonic()
    out = []
    for mb in cfg.bucket_mb:
        out.append(_measure_bucket(rank, cfg, mb))
        if rank == 0:
            print(f"overlap: bucket {mb:g} MB done, {time.monotonic() - t0:.0f} s "
                  f"(load {common.loadavg()})", flush=True)
    dist.barrier()
    return out


# ------------------------------------------------------------------------------------------------
# The parent: spawn, collect, reduce


def _spawn(cfg: Config) -> list[list[dict[str, Any]]]:
    """Run ``_worker`` on ``cfg.workers`` spawned processes; every rank's list of per-bucket results.
    Raises RuntimeError with the tracebacks when a rank fails or the run passes ``run_timeout_s``."""
    env = {**ONE_THREAD_ENV, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    return run_ranks(
        _worker, cfg.workers, (cfg,), name="overlap", timeout_s=cfg.timeout_s,
        run_timeout_s=cfg.run_timeout_s, env=env, fast_exit=True,
    )


def _iqr(xs: Sequence[float]) -> float:
    if len(xs) < 2:
        return 0.0
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[2] - q[0]


def _per_round(ranks: list[dict[str, Any]], key: str, name: str, over_ranks: Callable) -> list[float]:
    """``over_ranks`` (max, mean) of the ranks' values of ``key``/``name``, one value per round."""
    return [over_ranks(v) for v in zip(*(rk[key][name] for rk in ranks))]


def measure(cfg: Config) -> list[dict[str, Any]]:
    """Run the benchmark; one record per (system, bucket_mb), in bucket order (see bench/README.md)."""
    cfg.validate()
    t0 = time.monotonic()
    per_rank = _spawn(cfg)
    wall = time.monotonic() - t0
    machine, cmd = common.machine_info("cpu"), common.command_line()
    params = cfg.depth * (cfg.width * cfg.width + cfg.width)
    model = f"mlp {cfg.depth} x Linear({cfg.width}, {cfg.width}) + ReLU, mse, sgd lr {cfg.lr:g}"
    records = []
    for i, mb in enumerate(cfg.bucket_mb):
        ranks = [per_rank[r][i] for r in range(cfg.workers)]
        names = list(ranks[0]["samples_ms"])
        # A step's time is its slowest rank's; CPU time and page faults are per rank (mean over ranks).
        step_ms = {n: _per_round(ranks, "samples_ms", n, max) for n in names}
        med = {n: statistics.median(v) for n, v in step_ms.items()}
        cpu = {n: statistics.median(_per_round(ranks, "cpu_ms", n, statistics.mean)) for n in names}
        flt = {n: statistics.median(_per_round(ranks, "minflt", n, statistics.mean)) for n in names}
        for system in cfg.systems:
            t_c, t_s, t_o = med["compute"], med[f"{system}/serial"], med[f"{system}/overlap"]
            comm, exposed = t_s - t_c, t_o - t_c
            records.append(
                {
                    "bench": "overlap",
                    "system": system,
                    "bucket_mb": mb,
                    "buckets": ranks[0]["buckets"][system],
                    "t_compute_ms": t_c,
                    "t_serial_ms": t_s,
                    "t_overlap_ms": t_o,
                    "comm_ms": comm,
                    "exposed_ms": exposed,
                    "hidden_fraction": 1.0 - exposed / comm if comm != 0 else None,
                    "cpu_compute_ms": cpu["compute"],
                    "cpu_serial_ms": cpu[f"{system}/serial"],
                    "cpu_overlap_ms": cpu[f"{system}/overlap"],
                    "minflt": {
                        "compute": flt["compute"],
                        "serial": flt[f"{system}/serial"],
                        "overlap": flt[f"{system}/overlap"],
                    },
                    "iqr_ms": {
                        "compute": _iqr(step_ms["compute"]),
                        "serial": _iqr(step_ms[f"{system}/serial"]),
                        "overlap": _iqr(step_ms[f"{system}/overlap"]),
                    },
                    "samples_ms": {
                        "compute": step_ms["compute"],
                        "serial": step_ms[f"{system}/serial"],
                        "overlap": step_ms[f"{system}/overlap"],
                    },
                    "finite": all(rk["finite"][system] and rk["finite"]["compute"] for rk in ranks),
                    "workers": cfg.workers,
                    "batch": cfg.batch,
                    "model": model,
                    "params": params,
                    "grad_mb": params * 4 / (1 << 20),
                    "rounds": cfg.rounds,
                    "warmup": cfg.warmup,
                    "threads": 1,
                    "run_s": wall,
                    "loadavg_1m": common.loadavg(),
                    "config": asdict(cfg),
                    "machine": machine,
                    "command": cmd,
                }
            )
    return records


COLUMNS = [
    ("system", "system"),
    ("bucket_mb", "bucket MB"),
    ("buckets", "buckets"),
    ("t_compute_ms", "compute ms"),
    ("t_serial_ms", "serial ms"),
    ("t_overlap_ms", "overlap ms"),
    ("comm_ms", "comm ms"),
    ("exposed_ms", "exposed ms"),
    ("hidden_fraction", "hidden"),
    ("cpu_serial_ms", "CPU serial"),
    ("cpu_overlap_ms", "CPU overlap"),
]


def _floats(text: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad list {text!r}: give MiB such as 1,5,25") from None
    if not vals or any(not (math.isfinite(v) and v > 0) for v in vals):
        raise argparse.ArgumentTypeError(f"bad list {text!r}: bucket sizes must be MiB > 0")
    return vals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="JSON output path (a list of records)")
    ap.add_argument("--quick", action="store_true", help="a dry run: 5 rounds, 1 warm-up step per mode")
    ap.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    ap.add_argument(
        "--bucket-mb", type=_floats, default=(1.0, 5.0, 25.0), help="bucket caps in MiB, e.g. 1,5,25"
    )
    ap.add_argument("--int8", action="store_true", help="also measure pyasync BSP with int8 compression")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 20; --quick: 5)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per mode (default 3; --quick: 1)")
    ap.add_argument("--width", type=int, default=512, help="MLP width (default 512)")
    ap.add_argument("--depth", type=int, default=80, help="Linear layers (default 80)")
    ap.add_argument("--batch", type=int, default=16, help="rows per worker per step (default 16)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds any wait inside a worker may take")
    ap.add_argument("--run-timeout", type=float, default=3600.0, help="seconds the whole run may take")
    args = ap.parse_args(argv)
    cfg = Config(
        workers=args.workers,
        bucket_mb=args.bucket_mb,
        systems=("ddp", "pyasync", "pyasync:int8") if args.int8 else ("ddp", "pyasync"),
        width=args.width,
        depth=args.depth,
        batch=args.batch,
        rounds=args.rounds if args.rounds is not None else (5 if args.quick else 20),
        warmup=args.warmup if args.warmup is not None else (1 if args.quick else 3),
        timeout_s=args.timeout,
        run_timeout_s=args.run_timeout,
    )
    try:
        cfg.validate()
    except ValueError as e:
        ap.error(str(e))
    records = measure(cfg)
    r0 = records[0]
    print(f"{r0['model']}: {r0['params'] / 1e6:.1f} M params, {r0['grad_mb']:.1f} MiB of gradients; "
          f"{cfg.workers} workers, batch {cfg.batch}, {cfg.rounds} rounds; {r0['run_s']:.0f} s; "
          f"load {r0['loadavg_1m']}")
    print(common.format_table(records, COLUMNS))
    if not all(r["finite"] for r in records):
        print("warning: some parameters became non-finite; lower the learning rate", file=sys.stderr)
    common.write_results(args.out, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
