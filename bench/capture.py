"""The price of the gradient-edit guarantee: step time under ``grad_edits="detect"`` (the default: what
``.grad`` holds when ``step()`` is called is what gets pushed) against ``grad_edits="forbid"`` (buckets
sent while backward runs), with no edit, and step time with edits under "detect"; every mode of one
(model, policy) side by side in the same worker processes and interleaved rounds.

Modes (one pyasync.DistributedOptimizer each, on its own copy of the same model, the same batches):

* ``forbid``: ``grad_edits="forbid"``: each bucket is pushed as soon as it is encoded, during backward
  (the old behaviour; an edit would make step() raise).
* ``detect``: ``grad_edits="detect"``: buckets are encoded during backward and sent by step() once every
  ``.grad`` of the bucket is checked to be the same object with the same version counter (Note [What
  step() pushes] in engine/core/capture.py). No edit: this against ``forbid`` is the guarantee's price.
* ``mul``: "detect", and ``p.grad.mul_(0.5)`` on every parameter after backward.
* ``clip``: "detect", and ``torch.nn.utils.clip_grad_norm_(params, --max-norm)`` after backward.
* ``maxnorm``: "detect" with the engine's own ``max_grad_norm=--max-norm`` (``.grad`` is not edited).
  Under BSP the owners clip the mean gradient (nothing is encoded again); under SSP/ASP each push is
  clipped, which scales the encoded buckets of every step where the norm is above the limit, so those
  steps encode every bucket again.
* ``autocast``: "detect", the forward pass under ``torch.autocast("cpu", dtype=torch.bfloat16)``, no
  edit: the baseline of ``amp`` (bf16 autocast has a price of its own on a CPU without bf16 units).
* ``amp``: ``autocast`` with ``torch.amp.GradScaler("cpu")``: ``scaler.scale(loss).backward();
  scaler.step(opt); scaler.update()`` (step() divides the scale out while encoding, so every bucket is
  encoded again).

``mul``, ``clip`` and ``amp`` edit (or scale) the gradients between backward() and step(): their
buckets are encoded again in step(), which ``buckets_reencoded_per_step`` (from ``stats()``) shows.
By default the wide model skips ``autocast`` and ``amp``: bf16 autocast on a CPU without bf16
arithmetic made its steps 15-20x slower (5 s instead of 0.3 s on the development machine), which
hides the GradScaler's own price in the noise and takes most of the run. ``--modes`` sets the modes
of every model.

Workload: the end-to-end benchmark's models and data (bench/harness/workload.py, spawned with the demo's
local runner like bench/e2e.py: ``--workers`` processes, gloo on loopback, one torch thread and one
pyasync kernel thread each), plain SGD with the model's learning rate, batch 64 per worker, each rank
drawing its own shard's batches. ``mlp`` (digits, 300K parameters) keeps the optimizer's default
bucket cap (25 MiB: one bucket, as in bench/e2e.py); ``wide`` (4.7M parameters) runs with an 8 KiB cap,
which cuts its six tensors into five buckets (last layer, a bias, the 16 MiB middle weight, a bias,
the first weight), so that sending early could overlap backward.

Timing: each worker builds every mode's optimizer, runs ``--warmup`` untimed steps of each, then
``--rounds`` rounds; a round runs a block of ``--steps`` steps of every mode, in an order rotated by
one each round (so load changes hit the modes alike). Every block starts after a barrier; its time
per step is the slowest rank's (``time.perf_counter`` around the block on each rank), and after it
every rank waits until its owners have applied every push of the block (``Engine.drain``, untimed), so
no asynchronous work spills into the next mode's block. Figures are medians over rounds; the ratios
are taken between modes of the same run: against ``forbid``, ``detect`` and each mode's ``baseline``,
the same step without that mode's one difference (``detect`` for the edits and ``autocast``, ``autocast``
for ``amp``, ``forbid`` for ``detect``); ``ratio_vs_*`` are ratios of medians, ``paired_ratio_vs_*`` the
median over rounds of the per-round ratio.

    python bench/capture.py --out capture.json                   # mlp and wide, bsp and asp, every mode
    python bench/capture.py --models mlp --rounds 20 --out capture_mlp.json
    python bench/capture.py --quick                              # a dry run: 3 rounds of 5 steps

Output: a table on stdout and, with ``--out``, a JSON list with one record per (model, policy, mode);
docs/benchmarks.md ("The price of the gradient-edit guarantee") has the fields and the results.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import _path  # noqa: F401  (first: sys.path, see bench/_path.py)
import common
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness.cli import add_systems_option
from harness.summary import parse_per_model
from harness.workload import MODELS, BenchConfig, parse_system

from pyasync.demo.data import Digits, batches
from pyasync.demo.local import run_local, start_store_server
from pyasync.demo.record import gather_rank_stats
from pyasync.demo.train import setup

MODES = ("forbid", "detect", "mul", "clip", "maxnorm", "autocast", "amp")
#: The modes a model runs unless --modes says otherwise (see the module docstring).
DEFAULT_MODES = {"mlp": MODES, "wide": tuple(m for m in MODES if m not in ("autocast", "amp"))}
#: Modes that change ``.grad`` between backward() and step() (their buckets are encoded again).
EDIT_MODES = ("mul", "clip", "amp")
ABOUT = {
    "forbid": 'grad_edits="forbid": buckets sent while backward runs; no edit',
    "detect": 'grad_edits="detect": encoded while backward runs, sent by step() after the check; no edit',
    "mul": "p.grad.mul_(0.5) on every parameter after backward",
    "clip": "torch.nn.utils.clip_grad_norm_(params, max_norm) after backward",
    "maxnorm": "the engine's max_grad_norm=max_norm (.grad not edited)",
    "autocast": 'torch.autocast("cpu", dtype=torch.bfloat16) forward, no GradScaler, no edit',
    "amp": 'bf16 autocast + torch.amp.GradScaler("cpu"): scale(loss).backward(), step, update',
}
#: What each mode is compared with: the same step without that one difference.
BASELINE = {"detect": "forbid", "mul": "detect", "clip": "detect", "maxnorm": "detect", "autocast": "detect",
            "amp": "autocast"}
#: Default bucket caps (MiB): mlp as in bench/e2e.py (one bucket), wide cut into five buckets.
BUCKET_MB = {"mlp": 25.0, "wide": 8 / 1024}


@dataclasses.dataclass(frozen=True)
class CaptureConfig(BenchConfig):
    """One (model, policy) of the benchmark, the same on every rank: BenchConfig (model, workers, batch,
    lr, seed, timeouts; ``system`` is the policy) plus what the modes and the rounds need."""

    modes: tuple[str, ...] = MODES
    bucket_mb: float = 25.0  # the optimizer's bucket_cap_mb (MiB)
    rounds: int = 10  # timed rounds; each runs a block of every mode
    steps: int = 20  # steps per block
    warmup: int = 10  # untimed steps of every mode before the rounds
    max_norm: float = 1.0  # clip and maxnorm: the total gradient norm clipped to
    threads: int = 1  # torch and pyasync kernel threads per worker


def _step_fn(mode: str, net: torch.nn.Module, opt, draw, max_norm: float) -> Callable[[], None]:
    """One training step of ``mode`` (see the module docstring) on the next batch of ``draw``."""
    params = [p for p in net.parameters() if p.requires_grad]
    scaler = torch.amp.GradScaler("cpu") if mode == "amp" else None

    def step() -> None:
        xb, yb = next(draw)
        opt.zero_grad(set_to_none=True)
        if mode in ("autocast", "amp"):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(net(xb), yb)
            if scaler is None:
                loss.backward()
                opt.step()
                return
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            return
        F.cross_entropy(net(xb), yb).backward()
        if mode == "mul":
            for p in params:
                p.grad.mul_(0.5)
        elif mode == "clip":
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        opt.step()

    return step


def _settle(opt) -> None:
    """Wait (at most the optimizer's timeout) until this rank's owners have applied every push the
    ranks made so far, so that a block's asynchronous work does not spill into the next one."""
    clock = torch.tensor([opt.engine.clock], dtype=torch.int64)
    clocks = [torch.empty_like(clock) for _ in range(dist.get_world_size())]
    dist.all_gather(clocks, clock)
    opt.engine.drain([int(c) for c in clocks])


def capture_worker(
    cfg: CaptureConfig,
    rank: int,
    store: dist.Store,
    progress: Callable[[int], None] | None = None,
    data: Digits | None = None,
) -> dict[str, Any] | None:
    """Build every mode's optimizer, run the rounds; rank 0 returns every rank's figures (None
    elsewhere). A worker of ``pyasync.demo.local.run_local``."""
    import pyasync

    common.set_threads(cfg.threads)
    run = setup(cfg, rank, data)
    opts: dict[str, Any] = {}
    steps: dict[str, Callable[[], None]] = {}
    for mode in cfg.modes:  # the same order on every rank: construction is collective
        net = copy.deepcopy(run.model)
        opts[mode] = pyasync.DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=cfg.lr, momentum=cfg.momentum),
            policy=cfg.system.policy,
            compression=cfg.system.compression,
            bucket_cap_mb=cfg.bucket_mb,
            timeout=datetime.timedelta(seconds=cfg.timeout_s),
            grad_edits="forbid" if mode == "forbid" else "detect",
            max_grad_norm=cfg.max_norm if mode == "maxnorm" else None,
        )
        draw = batches(run.x, run.y, run.per_pass, cfg.batch_size, cfg.seed, run.rank)
        steps[mode] = _step_fn(mode, net, opts[mode], draw, cfg.max_norm)
    for mode in cfg.modes:
        for _ in range(cfg.warmup):
            steps[mode]()
        _settle(opts[mode])
    own: dict[str, float] = {}
    reencoded = dict.fromkeys(cfg.modes, 0)
    names = list(cfg.modes)
    for r in range(cfg.rounds):
        k = r % len(names)
        for mode in names[k:] + names[:k]:
            opt = opts[mode]
            dist.barrier()
            before = opt.stats().buckets_reencoded
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(cfg.steps):
                steps[mode]()
            t1, c1 = time.perf_counter(), time.process_time()
            reencoded[mode] += opt.stats().buckets_reencoded - before
            own[f"{mode}/ms/{r}"] = 1e3 * (t1 - t0) / cfg.steps
            own[f"{mode}/cpu/{r}"] = 1e3 * (c1 - c0) / cfg.steps
            _settle(opt)
    for mode in cfg.modes:
        own[f"{mode}/reencoded"] = reencoded[mode]
        own[f"{mode}/buckets"] = len(opts[mode].bucket_layouts)
    for mode in cfg.modes:  # collective too: every rank closes in the same order
        opts[mode].close()
    fields = sorted(own)
    per_rank = gather_rank_stats(own, fields)
    if rank != 0:
        return None
    return {"ranks": per_rank, "params": sum(p.numel() for p in run.model.parameters())}


# ------------------------------------------------------------------------------------------------
# The parent: plan, spawn, reduce


@dataclasses.dataclass(frozen=True)
class Config:
    """The whole benchmark. Bucket caps are MiB; times seconds."""

    models: tuple[str, ...] = ("mlp", "wide")
    policies: tuple[str, ...] = ("bsp", "asp")  # pyasync system names: a policy, optionally +COMPRESSION
    modes: tuple[str, ...] | None = None  # every model's; None: DEFAULT_MODES
    bucket_mb: tuple[tuple[str, float], ...] = tuple(BUCKET_MB.items())  # (model, MiB)
    workers: int = 4
    batch_size: int = 64
    hidden: int | None = None  # width of the MLP's hidden layers; None: the model's own
    rounds: int = 10
    steps: int = 20
    warmup: int = 10
    max_norm: float = 1.0
    threads: int = 1
    seed: int = 0
    timeout_s: float = 120.0  # every wait inside a worker
    run_timeout_s: float = 1800.0  # one (model, policy) run, enforced by the parent

    def validate(self) -> None:
        for m in self.models:
            if m not in MODELS:
                raise ValueError(f"unknown model {m!r}: choose from {', '.join(MODELS)}")
        if not self.models or len(set(self.models)) != len(self.models):
            raise ValueError(f"give unique models from {', '.join(MODELS)}, got {self.models}")
        if self.modes is not None:
            bad = [m for m in self.modes if m not in MODES]
            if bad or not self.modes or len(set(self.modes)) != len(self.modes):
                raise ValueError(f"modes must be unique names from {', '.join(MODES)}, got {self.modes}")
        if not self.policies or len(set(self.policies)) != len(self.policies):
            raise ValueError(f"give unique pyasync policies, got {self.policies}")
        for p in self.policies:
            if not parse_system(p, self.workers).is_pyasync:
                raise ValueError(f"policy {p!r}: this benchmark measures pyasync policies (bsp, asp, ...)")
        caps = dict(self.bucket_mb)
        for m in self.models:
            if not (m in caps and math.isfinite(caps[m]) and caps[m] > 0):
                raise ValueError(f"bucket cap of model {m!r} must be MiB > 0, got {caps.get(m)}")
        for name in ("workers", "batch_size", "rounds", "steps", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.workers < 2:
            raise ValueError(f"workers must be >= 2, got {self.workers}")
        if self.warmup < 0 or (self.hidden is not None and self.hidden < 1):
            raise ValueError(f"need warmup >= 0 and hidden >= 1, got {self.warmup}, {self.hidden}")
        if not (math.isfinite(self.max_norm) and self.max_norm > 0):
            raise ValueError(f"max_norm must be > 0, got {self.max_norm}")
        if self.timeout_s <= 0 or self.run_timeout_s <= 0:
            raise ValueError("timeouts must be > 0 seconds")

    def run_config(self, model: str, policy: str) -> CaptureConfig:
        spec = MODELS[model]
        return CaptureConfig(
            system=parse_system(policy, self.workers),
            workers=self.workers,
            model=model,
            batch_size=self.batch_size,
            hidden=spec.hidden if self.hidden is None else self.hidden,
            lr=spec.lr,
            seed=self.seed,
            timeout_s=self.timeout_s,
            modes=DEFAULT_MODES[model] if self.modes is None else self.modes,
            bucket_mb=dict(self.bucket_mb)[model],
            rounds=self.rounds,
            steps=self.steps,
            warmup=self.warmup,
            max_norm=self.max_norm,
            threads=self.threads,
        )


def _records(cfg: Config, run: CaptureConfig, out: dict[str, Any], wall_s: float, machine, cmd) -> list[dict]:
    """One record per mode of one (model, policy) run, from every rank's figures."""
    ranks = out["ranks"]
    rounds = range(run.rounds)
    # A block's time per step is its slowest rank's; CPU time per step is the mean over ranks.
    ms = {m: [max(rk[f"{m}/ms/{r}"] for rk in ranks) for r in rounds] for m in run.modes}
    cpu = {m: [statistics.mean(rk[f"{m}/cpu/{r}"] for rk in ranks) for r in rounds] for m in run.modes}
    med = {m: statistics.median(v) for m, v in ms.items()}

    def ratios(m: str, base: str) -> tuple[float | None, float | None]:
        if base not in med:
            return None, None
        paired = statistics.median(a / b for a, b in zip(ms[m], ms[base], strict=True))
        return med[m] / med[base], paired

    records = []
    for m in run.modes:
        timing = common.Timing(samples_ms=ms[m])
        vs_forbid, paired_forbid = ratios(m, "forbid")
        vs_detect, paired_detect = ratios(m, "detect")
        base = BASELINE.get(m)
        vs_base, paired_base = ratios(m, base) if base is not None else (None, None)
        records.append({
            "bench": "capture",
            "model": run.model,
            "policy": run.system.name,
            "mode": m,
            "grad_edits": "forbid" if m == "forbid" else "detect",
            "edits_grad": m in EDIT_MODES,
            "about": ABOUT[m],
            "ms_per_step": timing.median_ms,
            "ms_min": timing.min_ms,
            "ms_iqr": timing.iqr_ms,
            "ratio_vs_forbid": vs_forbid,
            "paired_ratio_vs_forbid": paired_forbid,
            "ratio_vs_detect": vs_detect,
            "paired_ratio_vs_detect": paired_detect,
            "baseline": base,
            "ratio_vs_baseline": vs_base,
            "paired_ratio_vs_baseline": paired_base,
            "cpu_ms_per_rank_step": statistics.median(cpu[m]),
            "buckets": int(ranks[0][f"{m}/buckets"]),
            "buckets_reencoded_per_step": statistics.mean(rk[f"{m}/reencoded"] for rk in ranks)
            / (run.rounds * run.steps),
            "samples_ms": ms[m],
            "bucket_mb": run.bucket_mb,
            "params": out["params"],
            "workers": run.workers,
            "batch": run.batch_size,
            "lr": run.lr,
            "max_norm": run.max_norm,
            "rounds": run.rounds,
            "steps_per_round": run.steps,
            "warmup": run.warmup,
            "threads": run.threads,
            "run_s": wall_s,
            "loadavg_1m": common.loadavg(),
            "config": dataclasses.asdict(cfg),
            "machine": machine,
            "command": cmd,
        })
    return records


def measure(cfg: Config, report: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Run every (model, policy) in its own spawned workers; one record per (model, policy, mode)."""
    cfg.validate()
    machine, cmd = common.machine_info("cpu"), common.command_line()
    store = start_store_server(cfg.timeout_s)
    records: list[dict[str, Any]] = []
    for model in cfg.models:
        for policy in cfg.policies:
            run = cfg.run_config(model, policy)
            t0 = time.monotonic()
            out = run_local(run, store, f"capture-{model}-{len(records)}/", None, cfg.run_timeout_s,
                            worker=capture_worker, label=f"capture {model}/{policy}")
            recs = _records(cfg, run, out, time.monotonic() - t0, machine, cmd)
            records += recs
            if report is not None:
                report(f"{model}/{policy}: {recs[0]['buckets']} bucket(s), "
                       f"{time.monotonic() - t0:.0f} s, load {common.loadavg()}")
    return records


COLUMNS = [
    ("model", "model"),
    ("policy", "policy"),
    ("mode", "mode"),
    ("buckets", "buckets"),
    ("ms_per_step", "ms/step"),
    ("ms_iqr", "iqr"),
    ("ratio_vs_forbid", "x forbid"),
    ("paired_ratio_vs_forbid", "paired"),
    ("baseline", "baseline"),
    ("ratio_vs_baseline", "x baseline"),
    ("buckets_reencoded_per_step", "re-encoded/step"),
    ("cpu_ms_per_rank_step", "CPU ms"),
]


def summary(records: Sequence[dict[str, Any]]) -> str:
    """The table, and the guarantee's price (detect over forbid, no edit) per model and policy."""
    lines = [common.format_table(records, COLUMNS), ""]
    for r in records:
        if r["mode"] == "detect" and r["ratio_vs_forbid"] is not None:
            lines.append(
                f"{r['model']}/{r['policy']}: detect costs {100 * (r['ratio_vs_forbid'] - 1):+.1f}% of "
                f"forbid's step time (paired {100 * (r['paired_ratio_vs_forbid'] - 1):+.1f}%), "
                f"{r['buckets']} bucket(s)"
            )
    return "\n".join(lines)


def _caps(text: str) -> tuple[tuple[str, float], ...]:
    """``MiB`` for every model, or ``MODEL=MiB,...`` (the others keep their default)."""
    try:
        caps = parse_per_model(text, BUCKET_MB, "--bucket-mb", "1, or mlp=25,wide=0.0078125")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return tuple(caps.items())


def _names(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = Config()
    ap.add_argument("--out", default=None, help="JSON output path (a list of records)")
    ap.add_argument("--quick", action="store_true", help="a dry run: 3 rounds of 5 steps, 2 warm-up steps")
    ap.add_argument("--models", type=_names, default=d.models, help="mlp, wide (default: both)")
    add_systems_option(ap, "--policies", dest="policies", default=",".join(d.policies),
                       help="pyasync policies, optionally +COMPRESSION (default: bsp,asp)")
    ap.add_argument("--modes", type=_names, default=None,
                    help=f"some of {','.join(MODES)}, for every model (default: all; wide without "
                    "autocast and amp)")
    ap.add_argument("--bucket-mb", type=_caps, default=d.bucket_mb,
                    help="bucket cap in MiB: one for every model, or MODEL=MiB,... (default mlp=25, "
                    "wide=8 KiB)")
    ap.add_argument("--workers", type=int, default=d.workers, help="worker processes (default 4)")
    ap.add_argument("--batch-size", type=int, default=d.batch_size, help="samples per step per worker (64)")
    ap.add_argument("--hidden", type=int, default=None, help="hidden width (default: the model's)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 10; --quick: 3)")
    ap.add_argument("--steps", type=int, default=None, help="steps per block (default 20; --quick: 5)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed steps per mode (default 10; --quick: 2)")
    ap.add_argument("--max-norm", type=float, default=d.max_norm, help="clip and maxnorm: the norm (1.0)")
    ap.add_argument("--threads", type=int, default=d.threads, help="torch and kernel threads per worker (1)")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--timeout", type=float, default=d.timeout_s,
                    help="seconds any wait inside a worker may take")
    ap.add_argument("--run-timeout", type=float, default=d.run_timeout_s,
                    help="seconds one (model, policy) run may take")
    a = ap.parse_args(argv)
    cfg = Config(
        models=a.models, policies=_names(a.policies), modes=a.modes, bucket_mb=a.bucket_mb, workers=a.workers,
        batch_size=a.batch_size, hidden=a.hidden,
        rounds=a.rounds if a.rounds is not None else (3 if a.quick else d.rounds),
        steps=a.steps if a.steps is not None else (5 if a.quick else d.steps),
        warmup=a.warmup if a.warmup is not None else (2 if a.quick else d.warmup),
        max_norm=a.max_norm, threads=a.threads, seed=a.seed, timeout_s=a.timeout, run_timeout_s=a.run_timeout,
    )
    try:
        cfg.validate()
    except ValueError as e:
        ap.error(str(e))
    records = measure(cfg, report=lambda s: print(s, file=sys.stderr, flush=True))
    print(summary(records))
    common.write_results(a.out, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
