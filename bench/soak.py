"""Soak test: many thousands of asynchronous steps on local gloo workers, checking that no update is
lost and that memory, threads and file descriptors stay flat.

    python bench/soak.py                                   # 4 workers, ASP, 5000 steps each
    python bench/soak.py --steps 20000 --compression topk:0.01 --out soak.json
    python bench/soak.py --steps 3000 --compression int8 --systems ssp:2
    python bench/soak.py --slow-owner-ms 20 --steps 1000 --systems asp:unanswered=inf  # a slow owner

Each of ``--workers`` spawned processes (gloo over loopback, one torch thread) trains a small model
(three linear layers, 7312 fp32 parameters in 3 buckets) with ``pyasync.DistributedOptimizer`` and
plain SGD, sleeping a random (seeded) time before every step: up to ``--delay-ms`` on most ranks, three
times that on the last one (a straggler), so under ASP the ranks drift apart and the fast ones close
while the straggler still pushes. ``--systems`` (old name ``--policy``) takes one of asp, ssp:S or bsp
(``+COMPRESSION`` there replaces ``--compression``); Quorum (drops or folds late pushes) and
lr_scale="inverse" (rescales pushes) are refused, since the ledger needs every push applied as lr * g / n.

Ledger (no lost update). Every layer sees integer inputs x in [-2, 2] and an integer upstream gradient
u in [-1, 1] (loss = sum(layer(x) * u)), so every gradient (u^T x, sum of u) is a small integer that
each worker also adds to a float64 ledger, computed from x and u without autograd. With lr = 1/8 and
a power-of-two number of workers n, every applied update lr * g / n is a multiple of 1/(8n) and every
partial sum stays far below 2^24 such units, so fp32 applies every push exactly, in any order: after
close() the parameters must equal p0 - lr / n * sum over workers of (ledger - final error-feedback
residual) *exactly* (no compression, or top-k, whose residual arithmetic is exact on integers). Int8's
scales are not dyadic, so its residuals round: it is checked to ``--ledger-tol`` (default 1e-3; a
single lost push moves the elements it carried by lr / n * |g|, about 1/32 per unit of gradient). A
non-power-of-two n makes 1/n inexact, and is checked to the same tolerance. The stats counters must
agree: pushes applied (by all owners) = pushes sent (by all workers) = n * steps * non-empty shards,
none dropped or skipped, every clock = steps, min_included_clock = steps - 1, and all replicas equal.

Resources. Every ``--sample-every`` steps (and at the warm-up step, ``--warmup`` of the steps) each
worker records its resident set (``/proc/self/statm``), its Python threads
(``threading.active_count()``), its OS threads (``/proc/self/task``) and its open descriptors
(``/proc/self/fd``). The growth is the last sample (after the last step, before close) minus the
warm-up sample. Fails when any rank's threads or descriptors grew, when its RSS grew by more than
``--rss-limit-mib`` (default 16 MiB, see below), or when close() did not release what the optimizer
took (Python threads, OS threads or descriptors after close() > before the optimizer was built).

Why 16 MiB: after warm-up a rank's RSS still moves by allocator noise, in steps that then stay flat
(glibc arenas of the engine's threads and gloo buffers reaching a new high-water mark when a rank
falls behind for a moment and messages queue up): up to 4.0 MiB per rank in 5000 steps on the
2-core development machine with other jobs running, so 16 MiB is about four times the noise. A leak
worth finding is per step or per message, and grows linearly: one bucket-sized buffer (4-16 KB) per
step is 18-72 MB over the 4500 steps after warm-up. 16 MiB over 4500 steps catches anything from
about 3.7 KB per step, i.e. about 100 bytes per network message (a rank sends and receives some 36
per step here: pushes and replies, headers and payloads); more steps catch smaller leaks, since the
limit does not grow with the run. Two finer signals are reported, not judged: the least-squares slope
of RSS over the samples after warm-up (bytes per step) and the growth over the second half of the
run (a linear leak shows half its total there, a high-water step usually nothing).

Slow owner (``--slow-owner-ms MS``). Every rank trains with :class:`SlowOwnerSGD`, plain SGD run
through the engine's generic rule (any optimizer class other than exactly SGD, Adam or AdamW is stepped
as a private instance per owned shard, pyasync/engine/core/rule.py), whose step() first sleeps MS on the
rank ``--slow-owner-rank`` (default 0) only: that rank's owner takes MS longer per update it applies,
while its worker and every other rank run as before. Under ``asp:unanswered=inf`` nobody waits for
answers (ASP's default waits for its own, for about a step), so the other workers push faster than that
owner applies; the owner's intake is bounded (Note [Bounded intake] in
pyasync/engine/p2p/intake.py), so its receiver stops reading, the sockets fill and the senders wait. The
run adds one check, ``intake``: on every rank, the most received pushes its owner held at once
(``stats().intake_peak``) is at most ``intake_limit(n, S)`` = 2 n S + 2 n (S: shards it owns), and
the live buffers of its push receive pool stayed within that limit; RSS, the ledger, the counters and
close() are checked as always. The record reports each rank's pool figures (``push_pool``: peak,
buffers allocated over the run, the limit) and how long close() took (the slow owner drains what the
sockets still hold). docs/reliability.md ("Memory per rank") derives the bound.

Memory. Every rank's record also holds ``buffer_bound``: the most bytes its pyasync buffers can hold,
term by term, by the formula of docs/reliability.md ("Memory per rank") evaluated on its own layout,
reported next to its RSS growth from construction to the last step (not judged: RSS also holds what
the C allocator keeps). ``--hidden H`` widens the middle layer (32 -> H -> H -> 16; 2048 gives 4.3M
parameters, 16.6 MiB, in 5 buckets), so that the buffers show against the ~300 MiB of torch.

Output: a summary on stdout and, with ``--out``, a JSON list holding one record: the configuration,
the machine, the command, every rank's samples and growth, the ledger's error, every check and the
verdict. Exit status 0 when every check passed, 1 otherwise (a failed or timed-out worker included).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import io
import os
import random
import sys
import threading
import time
from typing import Any

import _path  # noqa: F401  (first: sys.path, see bench/_path.py)
import common
import torch
from harness.cli import add_systems_option, parse_system_specs
from harness.launch import ONE_THREAD_ENV, run_ranks

LR = 0.125  # a power of two: lr * g / n stays dyadic
HIDDEN = 64  # default width of the middle layer


def layers(hidden: int = HIDDEN) -> tuple[tuple[int, int], ...]:
    """(in, out) of the three linear layers: 32 -> hidden -> hidden -> 16 (hidden 64: 7312 parameters)."""
    return ((32, hidden), (hidden, hidden), (hidden, 16))


LAYERS = layers()
BATCH = 2
BUCKET_CAP_MB = 0.004  # 1048 fp32 elements: 3 buckets (last layer + middle bias, middle weight, first layer)


def bucket_count(hidden: int = HIDDEN) -> int:
    """Buckets of the soak's model (3 at the default width, 5 at hidden 2048)."""
    from pyasync.engine.core.buckets import compute_bucket_assignment_by_size

    sizes = [4 * n for i, o in layers(hidden) for n in (i * o, o)]
    cap = max(1, int(BUCKET_CAP_MB * (1 << 20)))
    return len(compute_bucket_assignment_by_size(sizes, ["f32"] * len(sizes), ["cpu"] * len(sizes), cap))

#: Seconds the slow owner's SlowOwnerSGD sleeps per update; set in the slow rank's process only.
_slow_owner_s = 0.0


class SlowOwnerSGD(torch.optim.SGD):
    """Plain SGD whose step() first sleeps ``_slow_owner_s`` seconds (0 on every rank but the slow owner).

    pyasync runs any optimizer class other than exactly SGD, Adam or AdamW as a private instance of that
    class per owned shard (pyasync/engine/core/rule.py), so on the rank that sets the delay every update of
    every shard it owns takes that much longer, and nothing else does. Every rank builds this class: the
    start-up agreement compares the optimizer's class. The update itself is SGD's (p -= lr * g), so the
    ledger stays exact."""

    def step(self, closure=None):
        if _slow_owner_s > 0:
            time.sleep(_slow_owner_s)
        return super().step(closure)


@dataclasses.dataclass
class SoakConfig:
    steps: int = 5000  # steps per worker
    workers: int = 4
    policy: str = "asp"
    compression: str = "none"  # none | int8 | topk:RATIO | any pyasync compression spec
    seed: int = 0
    delay_ms: float = 1.0  # upper bound of the random sleep before each step; the last rank: 3x
    sample_every: int = 250  # steps between resource samples
    warmup: float = 0.1  # fraction of the steps before the reference sample
    rss_limit_mib: float | None = 16.0  # None: report RSS growth, do not judge it
    ledger_tol: float = 1e-3  # max |error| where the ledger cannot be exact (int8, n not a power of 2)
    timeout_s: float = 60.0  # the optimizer's timeout (every wait), and the process group's
    run_timeout_s: float | None = None  # the whole run; default 120 s + 50 ms per step (+ the slow owner's)
    slow_owner_ms: float = 0.0  # > 0: rank slow_owner_rank's owner sleeps this long per update applied
    slow_owner_rank: int = 0
    hidden: int = HIDDEN  # width of the middle layer: 64 (7312 parameters), 2048 (4.3M, 16.6 MiB)

    def warm_step(self) -> int:
        return max(1, round(self.warmup * self.steps))

    def run_timeout(self) -> float:
        """The whole run (s): 120 s + 50 ms per step, plus, with a slow owner, its delay for every push
        it must apply (n workers x steps x its shards, as if its appliers never overlapped)."""
        if self.run_timeout_s is not None:
            return self.run_timeout_s
        slow = self.workers * self.steps * bucket_count(self.hidden) * self.slow_owner_ms / 1e3
        return 120.0 + 0.05 * self.steps + slow


# -- worker -----------------------------------------------------------------------------------------
def _resources() -> dict[str, Any]:
    with open("/proc/self/statm", encoding="ascii") as f:
        rss_pages = int(f.read().split()[1])
    return {
        "rss_bytes": rss_pages * os.sysconf("SC_PAGE_SIZE"),
        "py_threads": threading.active_count(),
        "os_threads": len(os.listdir("/proc/self/task")),
        "fds": len(os.listdir("/proc/self/fd")),  # includes the one listdir opens: the same in every sample
        "thread_names": sorted(t.name for t in threading.enumerate()),
    }


def _model(hidden: int = HIDDEN) -> torch.nn.ModuleList:
    torch.manual_seed(1234)
    model = torch.nn.ModuleList(torch.nn.Linear(i, o) for i, o in layers(hidden))
    with torch.no_grad():  # dyadic starting values (multiples of 1/16), so the ledger stays exact
        g = torch.Generator().manual_seed(99)
        for p in model.parameters():
            p.copy_(torch.randint(-16, 17, p.shape, generator=g).float() / 16)
    return model


def buffer_bound(opt) -> dict[str, int]:
    """The most bytes this rank's pyasync buffers can hold (CPU engine, TCP transport), term by term:
    the formula of docs/reliability.md ("Memory per rank"), evaluated on ``opt``'s own layout."""
    import pyasync
    from pyasync.engine import wire
    from pyasync.engine.p2p.intake import local_limit
    from pyasync.engine.p2p.owner import intake_limit

    n, rank, comp = opt.world_size, opt.rank, opt.compressor
    lays = opt.bucket_layouts
    spec = wire.WireSpec.for_compressor(
        comp, rank, n, shard_numels=[[s.numel for s in lay.shards] for lay in lays],
        mask_lens=[[len(s.segments) for s in lay.shards] for lay in lays],
    )
    h = wire.HEADER_BYTES
    own = [b for b, lay in enumerate(lays) if lay.shards[rank].numel > 0]
    own_numel = sum(lays[b].shards[rank].numel for b in own)
    remote = [(b, r) for b, lay in enumerate(lays) for r in range(n) if r != rank and lay.shards[r].numel > 0]
    own_push = max((comp.wire_bytes(lays[b].shards[rank].numel) for b in own), default=0)
    aggregate = isinstance(opt.policy, (pyasync.BSP, pyasync.Quorum))
    return {
        "flat buckets": 4 * sum(lay.numel for lay in lays),
        "residuals": 2 * 4 * sum(lay.numel for lay in lays) if comp.error_feedback else 0,
        "push frames": sum(h + spec.push_bytes(b, r) for b, r in remote),
        "control frames": (n - 1) * h,
        "reply frames": sum((n - 1) * (h + wire.reply_parts(lays[b].shards[rank].numel, n)[1]) for b in own),
        "push intake": intake_limit(n, len(own)) * spec.max_push_frame(),
        "own pushes": (len(lays) + local_limit(n, len(own))) * own_push,
        "reply pool": (2 * len(remote) + 1) * spec.max_reply_frame(),
        "own replies": 2 * 4 * own_numel,
        "masters": 4 * own_numel,
        "scratch": 0 if opt.fused_rule and comp.name != "topk" else 4 * own_numel,
        "aggregate": 4 * own_numel if aggregate else 0,
        # coded replies (a lossy codec): what each worker (ours too) holds of our shards, what we hold of
        # theirs, and one change per owned shard (engine/core/replies.py)
        "held (owner)": 4 * n * own_numel if comp.replies else 0,
        "held (worker)": 4 * sum(lays[b].shards[r].numel for b, r in remote) if comp.replies else 0,
        "reply scratch": 4 * own_numel if comp.replies else 0,
    }


def soak_worker(rank: int, world: int, cfg: SoakConfig) -> dict[str, Any]:
    """One rank of the soak run (torch.distributed already initialised): train, sample, return the
    samples, the ledger (per parameter: what this worker sent, float64), stats and final values."""
    import pyasync
    from pyasync.engine.p2p.owner import intake_limit

    global _slow_owner_s
    slow = cfg.slow_owner_ms > 0
    if slow and rank == cfg.slow_owner_rank:
        _slow_owner_s = cfg.slow_owner_ms / 1e3
    t0 = time.monotonic()
    samples = [dict(step=-1, phase="start", t=0.0, **_resources())]
    model = _model(cfg.hidden)
    params = list(model.parameters())
    # Before the optimizer, so that RSS from "built" on shows the optimizer's memory, not the ledger's.
    ledger = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
    opt = pyasync.DistributedOptimizer(
        (SlowOwnerSGD if slow else torch.optim.SGD)(params, lr=LR),
        policy=cfg.policy,
        compression=None if cfg.compression == "none" else cfg.compression,
        bucket_cap_mb=BUCKET_CAP_MB,
        timeout=datetime.timedelta(seconds=cfg.timeout_s),
    )
    p0 = [p.detach().clone() for p in params]  # rank 0's values, broadcast at construction
    pool = opt.engine.owner.push_pool  # read only: the owner's push receive buffers (Note [Bounded intake])

    def pool_live() -> int:
        """Receive buffers of the owner's push pool alive now: taken, or kept for reuse."""
        return pool.out + pool.free()

    samples.append(dict(step=0, phase="built", t=time.monotonic() - t0, intake_live=pool_live(),
                        **_resources()))
    gen = torch.Generator().manual_seed(cfg.seed * 100003 + rank)
    rng = random.Random(cfg.seed * 7919 + rank)
    max_delay = cfg.delay_ms / 1000.0 * (3.0 if rank == world - 1 else 1.0)
    warm = cfg.warm_step()
    for t in range(cfg.steps):
        time.sleep(rng.uniform(0.0, max_delay))  # emulated compute time: workers drift apart
        xs = [torch.randint(-2, 3, (BATCH, i), generator=gen) for i, _ in layers(cfg.hidden)]
        us = [torch.randint(-1, 2, (BATCH, o), generator=gen) for _, o in layers(cfg.hidden)]
        opt.zero_grad()
        loss = sum((layer(x.float()) * u.float()).sum() for layer, x, u in zip(model, xs, us, strict=True))
        loss.backward()
        opt.step()
        for i, (x, u) in enumerate(zip(xs, us, strict=True)):  # the gradients, without autograd, in float64
            ledger[2 * i].addmm_(u.double().T, x.double())  # in place: no temporary of the layer's size
            ledger[2 * i + 1] += u.double().sum(0)
        done = t + 1
        if done == warm or done % cfg.sample_every == 0:
            samples.append(dict(step=done, phase="warm" if done == warm else "run", t=time.monotonic() - t0,
                                intake_live=pool_live(), **_resources()))
    samples.append(dict(step=cfg.steps, phase="end", t=time.monotonic() - t0, intake_live=pool_live(),
                        **_resources()))
    t_close = time.monotonic()
    opt.close()
    close_s = time.monotonic() - t_close
    samples.append(dict(step=cfg.steps, phase="closed", t=time.monotonic() - t0, intake_live=pool_live(),
                        **_resources()))
    owned = sum(lay.shards[rank].numel > 0 for lay in opt.bucket_layouts)

    # What this worker sent = its gradients minus what error feedback still holds back.
    residual = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
    index = {id(p): i for i, p in enumerate(params)}
    nonempty = 0
    for b, lay in enumerate(opt.bucket_layouts):
        full = torch.zeros(lay.numel, dtype=torch.float64)
        for r, sh in enumerate(lay.shards):
            nonempty += sh.numel > 0
            e = opt.compressor.residual((b, r))
            if e is not None:
                full[sh.begin : sh.end] = e.double().cpu()
        for p, off, n in zip(lay.params, lay.offsets, lay.numels, strict=True):
            i = index[id(opt._params[p])]
            residual[i] = full[off : off + n].reshape(params[i].shape)
    st = opt.stats()
    return {
        "rank": rank,
        "samples": samples,
        "p0": p0,
        "final": [p.detach().clone() for p in params],
        "sent": [g - e for g, e in zip(ledger, residual, strict=True)],
        "residual_abs_max": max(float(e.abs().max()) for e in residual),
        "nonempty_shards": nonempty,
        "stats": dataclasses.asdict(st),
        "push_pool": {
            "owned_shards": owned,
            "limit": intake_limit(world, owned),
            "peak": pool.peak,  # most buffers out at once (= stats().intake_peak)
            "allocated": pool.allocated,  # buffers made over the run (dropped ones are made again)
            "frame_bytes": pool.nbytes,
            "live_max": max(sm["intake_live"] for sm in samples[1:]),  # most alive at a sample
        },
        "close_s": close_s,
        "buffer_bound": buffer_bound(opt),
        "wall_s": time.monotonic() - t0,
    }


# -- verdict ----------------------------------------------------------------------------------------
def _slope(points: list[tuple[int, int]]) -> float | None:
    """Least-squares slope of (step, bytes) points: bytes per step."""
    if len(points) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else None


def evaluate(results: list[dict[str, Any]], cfg: SoakConfig) -> dict[str, Any]:
    """Every check of the soak run on the workers' results; ``ok`` is True when all pass."""
    n = cfg.workers
    checks: list[dict[str, Any]] = []

    def check(name: str, ok: bool, detail: str) -> None:
        checks.append({"name": name, "ok": bool(ok), "detail": detail})

    # Ledger: final = p0 - lr / n * sum_w sent_w, in float64.
    exact = (n & (n - 1)) == 0 and (cfg.compression == "none" or cfg.compression.startswith("topk"))
    tol = 0.0 if exact else cfg.ledger_tol
    p0 = results[0]["p0"]
    finals = [r["final"] for r in results]
    same = all(torch.equal(a, b) for f in finals[1:] for a, b in zip(finals[0], f, strict=True))
    check("replicas_equal", same, "every rank ends with the same parameters after close()")
    worst, elements = 0.0, 0
    for i, p in enumerate(p0):
        want = p.double() - LR / n * sum(r["sent"][i] for r in results)
        worst = max(worst, float((finals[0][i].double() - want).abs().max()))
        elements += p.numel()
    moved = max(float((f.double() - p.double()).abs().max()) for f, p in zip(finals[0], p0, strict=True))
    check(
        "ledger",
        worst <= tol and moved > 0,
        f"max |final - (p0 - lr/n * sum of sent gradients)| = {worst:.3g} over {elements} elements "
        f"({'exact' if exact else f'tolerance {tol:g}'}); parameters moved by up to {moved:.3g}",
    )
    # Counters.
    sent = sum(r["stats"]["pushes_sent"] for r in results)
    applied = sum(r["stats"]["pushes_applied"] for r in results)
    dropped = sum(r["stats"]["pushes_dropped"] for r in results)
    skipped = sum(r["stats"]["nonfinite_skipped"] for r in results)
    expected = n * cfg.steps * results[0]["nonempty_shards"]
    check(
        "pushes",
        applied == sent == expected and dropped == 0 and skipped == 0,
        f"applied {applied}, sent {sent}, expected {expected} (n x steps x non-empty shards), "
        f"dropped {dropped}, non-finite skipped {skipped}",
    )
    clocks = [r["stats"]["clock"] for r in results]
    mics = [r["stats"]["min_included_clock"] for r in results]
    check(
        "clocks",
        all(c == cfg.steps for c in clocks) and all(m == cfg.steps - 1 for m in mics),
        f"clocks {clocks}, min_included_clock {mics} (want {cfg.steps} and {cfg.steps - 1})",
    )
    # Resources, per rank: the warm-up sample against the last one before close().
    per_rank = []
    for r in results:
        by_phase = {s["phase"]: s for s in r["samples"]}
        warm, end = by_phase["warm"], by_phase["end"]
        growth = {k: end[k] - warm[k] for k in ("rss_bytes", "py_threads", "os_threads", "fds")}
        pts = [(s["step"], s["rss_bytes"]) for s in r["samples"]
               if s["phase"] in ("warm", "run", "end") and s["step"] >= warm["step"]]
        mid = min(pts, key=lambda q: abs(q[0] - cfg.steps / 2))  # the sample nearest half-way
        per_rank.append({
            "rank": r["rank"],
            "growth": growth,
            "warm": {k: warm[k] for k in growth},
            "end": {k: end[k] for k in growth},
            "rss_max_bytes": max(s["rss_bytes"] for s in r["samples"]),
            "rss_slope_bytes_per_step": _slope(pts),
            "rss_growth_second_half_bytes": end["rss_bytes"] - mid[1],
            "before_optimizer": {k: by_phase["start"][k] for k in growth},
            "after_close": {k: by_phase["closed"][k] for k in growth},
            "wall_s": r["wall_s"],
            "close_s": r["close_s"],
            "push_pool": r["push_pool"],
            "buffer_bound_bytes": sum(r["buffer_bound"].values()),
            "buffer_bound": r["buffer_bound"],
            "rss_growth_from_built_bytes": end["rss_bytes"] - by_phase["built"]["rss_bytes"],
            "stats": r["stats"],
            "samples": r["samples"],
        })
    kinds = ("py_threads", "os_threads")
    grew = [(p["rank"], k, p["growth"][k]) for p in per_rank for k in kinds if p["growth"][k] > 0]
    check("threads", not grew, f"growth after warm-up (rank, kind, count): {grew or 'none'}")
    grew = [(p["rank"], p["growth"]["fds"]) for p in per_rank if p["growth"]["fds"] > 0]
    check("fds", not grew, f"descriptor growth after warm-up (rank, count): {grew or 'none'}")
    left = [
        (p["rank"], k, p["after_close"][k] - p["before_optimizer"][k])
        for p in per_rank
        for k in ("py_threads", "os_threads", "fds")
        if p["after_close"][k] > p["before_optimizer"][k]
    ]
    check("close_releases", not left, f"threads / descriptors left after close() beyond those before the "
          f"optimizer was built (rank, kind, count): {left or 'none'}")
    mib = [round(p["growth"]["rss_bytes"] / 2**20, 2) for p in per_rank]
    if cfg.rss_limit_mib is not None:
        check("rss", all(m <= cfg.rss_limit_mib for m in mib),
              f"RSS growth after warm-up per rank (MiB): {mib}, limit {cfg.rss_limit_mib:g}")
    if cfg.slow_owner_ms > 0:
        # Note [Bounded intake]: an owner holds at most intake_limit(n, S) received pushes, however slow.
        pools = [(r["rank"], r["stats"]["intake_peak"], r["push_pool"]["live_max"], r["push_pool"]["limit"])
                 for r in results]
        slow = results[cfg.slow_owner_rank]
        check(
            "intake",
            all(peak <= limit and live <= limit for _, peak, live, limit in pools),
            f"slow owner rank {cfg.slow_owner_rank} (+{cfg.slow_owner_ms:g} ms per update): intake_peak "
            f"{slow['stats']['intake_peak']} of limit {slow['push_pool']['limit']} (2nS + 2n, S = "
            f"{slow['push_pool']['owned_shards']}), {slow['push_pool']['allocated']} buffers allocated over "
            f"the run, close() took {slow['close_s']:.1f} s; every rank (rank, peak, most alive at a sample, "
            f"limit): {pools}",
        )
    return {
        "ok": all(c["ok"] for c in checks),
        "checks": checks,
        "ledger": {"exact": exact, "tolerance": tol, "max_abs_error": worst, "elements": elements,
                   "residual_abs_max": max(r["residual_abs_max"] for r in results)},
        "per_rank": per_rank,
    }


# -- harness ----------------------------------------------------------------------------------------
class SoakError(RuntimeError):
    """A worker failed, or the run did not finish within its timeout."""


def _entry(rank: int, world: int, cfg: SoakConfig) -> bytes:
    """One rank (started by harness.launch.run_ranks): :func:`soak_worker`'s result, serialized."""
    out = soak_worker(rank, world, cfg)
    buf = io.BytesIO()  # bytes, not tensors: shared-memory tensors die with this process
    torch.save(out, buf)
    return buf.getvalue()


def run_workers(cfg: SoakConfig) -> list[dict[str, Any]]:
    """Spawn ``cfg.workers`` ranks (gloo over loopback, a TCPStore served here); their results by
    rank. Raises SoakError with every failed rank's traceback, or when the run exceeds its timeout
    (the workers are killed either way)."""
    got = run_ranks(
        _entry, cfg.workers, (cfg,), name="soak", timeout_s=cfg.timeout_s, run_timeout_s=cfg.run_timeout(),
        env=ONE_THREAD_ENV, threads=1, daemon=True, error=SoakError,
    )
    return [torch.load(io.BytesIO(b), weights_only=False) for b in got]


def run(cfg: SoakConfig) -> dict[str, Any]:
    """The whole soak: spawn, train, evaluate. A record with the configuration, the per-rank figures,
    every check and ``ok``; a failed or timed-out run gives ``ok`` False and the error."""
    t0 = time.monotonic()
    record: dict[str, Any] = {"bench": "soak", "config": dataclasses.asdict(cfg)}
    try:
        results = run_workers(cfg)
    except SoakError as e:
        record.update(ok=False, error=str(e), wall_s=time.monotonic() - t0, checks=[])
        return record
    record.update(evaluate(results, cfg))
    record["wall_s"] = time.monotonic() - t0
    return record


def summary(record: dict[str, Any]) -> str:
    cfg = record["config"]
    lines = [
        f"soak: {cfg['workers']} workers x {cfg['steps']} steps, policy {cfg['policy']}, compression "
        f"{cfg['compression']}, delay <= {cfg['delay_ms']:g} ms (last rank 3x), wall {record['wall_s']:.1f} s"
    ]
    if cfg.get("slow_owner_ms", 0) > 0:
        lines.append(f"slow owner: rank {cfg['slow_owner_rank']}'s owner sleeps {cfg['slow_owner_ms']:g} ms "
                     "per update it applies")
    if "per_rank" in record:
        bound = max(p["buffer_bound_bytes"] for p in record["per_rank"]) / 2**20
        built = [round(p["rss_growth_from_built_bytes"] / 2**20, 1) for p in record["per_rank"]]
        lines.append(f"pyasync's buffers: at most {bound:.2f} MiB per rank (docs/reliability.md, Memory per "
                     f"rank); RSS from construction to the last step (MiB): {built}")
    if "error" in record:
        return "\n".join([*lines, record["error"], "verdict: FAIL"])
    lines.append(
        f"{'rank':>4} {'rss warm MiB':>12} {'rss end MiB':>11} {'growth MiB':>10} {'2nd half':>8} "
        f"{'slope B/step':>12} {'py thr':>9} {'os thr':>9} {'fds':>9} {'steps/s':>8}"
    )
    for p in record["per_rank"]:
        w, e, g = p["warm"], p["end"], p["growth"]
        slope = p["rss_slope_bytes_per_step"]
        lines.append(
            f"{p['rank']:>4} {w['rss_bytes'] / 2**20:>12.1f} {e['rss_bytes'] / 2**20:>11.1f} "
            f"{g['rss_bytes'] / 2**20:>+10.2f} {p['rss_growth_second_half_bytes'] / 2**20:>+8.2f} "
            f"{'-' if slope is None else f'{slope:+.1f}':>12} "
            f"{w['py_threads']:>4}->{e['py_threads']:<4} {w['os_threads']:>4}->{e['os_threads']:<4} "
            f"{w['fds']:>4}->{e['fds']:<4} {cfg['steps'] / p['wall_s']:>8.1f}"
            + (f"  intake {p['stats']['intake_peak']}/{p['push_pool']['limit']}, close {p['close_s']:.1f} s"
               if cfg.get("slow_owner_ms", 0) > 0 else "")
        )
    for c in record["checks"]:
        lines.append(f"  [{'ok' if c['ok'] else 'FAIL'}] {c['name']}: {c['detail']}")
    lines.append(f"verdict: {'PASS' if record['ok'] else 'FAIL'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    d = SoakConfig()
    ap.add_argument("--steps", type=int, default=d.steps, help="steps per worker (default %(default)s)")
    ap.add_argument("--workers", type=int, default=d.workers, help="worker processes (default %(default)s)")
    add_systems_option(ap, "--policy", default=d.policy,
                       help="one pyasync policy: asp, ssp:S, ... (default asp)")
    ap.add_argument("--compression", default=d.compression, help="none | int8 | topk:RATIO (default none)")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--delay-ms", type=float, default=d.delay_ms,
                    help="max random sleep before a step, ms; the last rank: up to 3x (default %(default)s)")
    ap.add_argument("--sample-every", type=int, default=d.sample_every, help="steps between samples")
    ap.add_argument("--warmup", type=float, default=d.warmup,
                    help="fraction of the steps before the reference sample (default %(default)s)")
    ap.add_argument("--rss-limit-mib", type=float, default=d.rss_limit_mib,
                    help="allowed RSS growth per rank after warm-up, MiB; <0: report only (default 16)")
    ap.add_argument("--ledger-tol", type=float, default=d.ledger_tol,
                    help="ledger tolerance where it cannot be exact (int8; n not a power of two)")
    ap.add_argument("--timeout", type=float, default=d.timeout_s, help="optimizer / process-group timeout, s")
    ap.add_argument("--run-timeout", type=float, default=None,
                    help="the whole run, s (default 120 + 0.05 x steps, plus workers x steps x\n"
                         "buckets x the slow owner's delay)")
    ap.add_argument("--slow-owner-ms", type=float, default=d.slow_owner_ms,
                    help="one rank's owner takes MS longer per update it applies (default: none)")
    ap.add_argument("--slow-owner-rank", type=int, default=d.slow_owner_rank,
                    help="the rank whose owner is slow (default %(default)s)")
    ap.add_argument("--hidden", type=int, default=d.hidden,
                    help="width of the middle layer (default 64: 7312 parameters; 2048: 4.3M, 16.6 MiB)")
    ap.add_argument("--out", default="", help="write the JSON record (a list of one) here")
    a = ap.parse_args(argv)
    if a.steps < 10 or a.workers < 2 or a.sample_every < 1 or not 0 < a.warmup < 1:
        ap.error("need --steps >= 10, --workers >= 2, --sample-every >= 1 and 0 < --warmup < 1")
    if a.hidden < 1:
        ap.error(f"--hidden must be >= 1, got {a.hidden}")
    if not 0 <= a.slow_owner_ms < float("inf") or not 0 <= a.slow_owner_rank < a.workers:
        ap.error(f"need 0 <= --slow-owner-ms < inf and 0 <= --slow-owner-rank < --workers ({a.workers})")
    from pyasync.policy import Quorum, parse_policy

    try:
        systems = parse_system_specs(a.systems, a.workers, kinds=("pyasync",))
    except ValueError as e:
        ap.error(str(e))
    if len(systems) != 1:
        ap.error(f"--systems takes one pyasync policy here, got {a.systems!r}")
    policy, compression = systems[0].policy, a.compression
    if systems[0].compression is not None:  # asp+int8: the compression in the spec
        if compression != d.compression:
            ap.error(f"--systems {a.systems} names a compression: leave --compression out")
        compression = systems[0].compression
    pol = parse_policy(policy)
    if isinstance(pol, Quorum) or getattr(pol, "lr_scale", None) == "inverse":
        ap.error(f"--systems {a.systems}: the ledger needs every push applied as lr * g / n; Quorum drops "
                 "(or folds, divided by k) and lr_scale='inverse' rescales pushes: use bsp, ssp:S or asp")
    cfg = SoakConfig(
        steps=a.steps, workers=a.workers, policy=policy, compression=compression, seed=a.seed,
        delay_ms=a.delay_ms, sample_every=a.sample_every, warmup=a.warmup,
        rss_limit_mib=None if a.rss_limit_mib < 0 else a.rss_limit_mib, ledger_tol=a.ledger_tol,
        timeout_s=a.timeout, run_timeout_s=a.run_timeout, slow_owner_ms=a.slow_owner_ms,
        slow_owner_rank=a.slow_owner_rank, hidden=a.hidden,
    )
    record = run(cfg)
    record["machine"] = common.machine_info()
    record["command"] = common.command_line()
    print(summary(record))
    common.write_results(a.out, [record])
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
