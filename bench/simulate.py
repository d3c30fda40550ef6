"""Discrete-event scale model of DDP and pyasync's policies (BSP, SSP(s), ASP, Quorum(k), local steps):
samples/s, staleness and waiting for n = 8 to 1024 workers under stragglers, calibrated from this
repository's measurements and checked against its measured 4-worker end-to-end runs (GitHub issue 14,
part 3).

    python bench/simulate.py --out bench/results/simulate.json --plot bench/results/simulate   # the grid
    python bench/simulate.py --n 8,64,512 --systems ddp,asp,quorum:n-1 --scenarios one-slow --link 10g
    python bench/simulate.py --n 8,64,512,1024 --scenarios one-slow --link 10g \\
        --systems ddp,asp,quorum:n-1,local:16,local:16:quorum:n-1,local:16:async     # local steps
    python bench/simulate.py --check bench/results/e2e_cpu bench/results/e2e_cpu_wide \\
        bench/results/e2e_cpu_wide_1gbps --check-out check.json        # predicted vs measured, 4 workers

Output: a table on stdout and, with ``--out``, a JSON list with one record per (link, scenario, n, policy);
``--check`` prints and (``--check-out``) writes one record per measured run. Fields: bench/README.md and
docs/benchmarks.md ("Scale model (bench/simulate.py)").

Note [The model]
    Each worker repeats: a *device* phase (time that uses no host CPU: an accelerator, or a sleep),
    a *host* phase before its push (``host_c``: CPU work), the push, a host phase after it (``host_m``),
    then the wait its policy asks for. Step ``k`` of worker ``w`` takes ``f[w, k]`` times the base
    compute time ``c``; the scenario gives ``f``: per-rank speeds and a straggler (multiplicative),
    log-normal noise ``exp(sigma Z - sigma^2 / 2)`` (mean 1), a transient slowdown (``x factor`` with
    probability ``prob``) and rare long pauses (``+ L`` with probability ``p``; ``L`` in units of ``c``).
    Draws come from one ``numpy.random.Generator`` seeded with ``--seed``: the run is deterministic.

    * **DDP and BSP (on collectives)**: a barrier of every worker, then the collective:
      ``2 (n - 1) (alpha + latency) per bucket + 2 (n - 1) / n * bytes * beta`` (a ring all-reduce; BSP:
      reduce-scatter, or an all-to-all of compressed frames, plus an all-gather, the same terms), the
      update (DDP: the local optimizer step on M elements; BSP: the fused apply of M / n) and BSP's
      install. Every worker then starts its next step.
    * **Point-to-point policies** (SSP, ASP, Quorum, ``bsp:p2p``): a push is one burst on the worker's
      own sending link (``(n - 1)`` messages per bucket, ``(n - 1) / n * M`` elements at the codec's bytes
      per element); every owner receives it when the burst has left (plus ``latency``). Owners are
      symmetric (each holds M / n of every bucket and every push reaches them all at once), so one
      *representative owner*, a FIFO server, applies pushes: per push the decode + apply of its M / n
      elements (ASP/SSP), or the decode-and-sum (BSP/Quorum) plus one apply per round. Each owner
      answers with one message per bucket of ``M / n`` fp32 values, sent on **its own** sending link:
      every rank's link is a FIFO that carries its pushes and its replies (as bench/linkemu.py models a
      NIC), so replies queue behind pushes and grow with ``n`` (each owner answers n pushes per round).
      A worker gets its answer when the last remote owner's reply has arrived.
    * Round rules, pyasync's own (Note [Round rules]): **SSP(s)** answers a push of clock t once every
      not-closed worker's pushes up to clock ``t - s`` are applied; the worker starts ``t + 1`` after
      that answer (so no worker is more than s clocks ahead of the slowest). **ASP** answers at once,
      and the worker does not wait for it: it starts its next step when its host work is done and its
      push frames are free (at most ``--window`` pushes in flight on its link, the engine's send rings);
      it installs the newest answer that has arrived (this is ``asp:unanswered=inf``; the engine's
      default ``asp`` also waits for the answers to its last push, as SSP waits for its own, which
      the model has only as the outer policy of ``local:H:async``, below). **Quorum(k)** applies round v
      at the k-th push computed on version v; a push computed on an older version is dropped and answered
      at once with the newest values (the late worker catches up); a worker waits for a version newer than
      the one it pushed on. When fewer than k workers are left (closed), a round needs what can still come.
      **bsp:p2p** is Quorum(n).
    * **Local steps** (``local:H``, ``local:H:quorum:K``, ``local:H:async``; pyasync.Local, Note [Local
      steps] in pyasync/local.py): a step that is not an H-th one is compute only: the device phase and
      the inner optimizer step on the worker (``local_host_s``: ``apply:none`` on M, the update DDP's step
      also pays), no push and no wait. Every H-th step also pays that, forms the pseudo-gradient and keeps
      the new anchor (two passes over M at the ``flatten`` rate, in ``host_c``), and pushes: a push of the
      size and cost of its outer policy's gradient push, after which it waits as the outer policy says.
      ``local:H``: BSP on collectives (the barrier and collective above, every H steps); ``local:H:quorum:K``:
      Quorum(K); ``local:H:async``: ASP whose worker waits for every owner's answer to its push before its
      next step (``max_unanswered=0``; kind ``asp:wait``: applied on arrival and answered at once as ASP,
      awaited as SSP's answers are). So the bytes per step fall by H. Staleness counts outer updates.
    * Staleness of an applied push: versions applied to the shard between the one the push was computed
      on (the newest answer the worker had installed when its step started) and the push's own apply,
      as pyasync's ``Stats.staleness``. Under ASP with n equal workers and no costs it is n - 1.
    * Work is a budget of steps, as in bench/e2e.py: DDP and BSP take ``budget / n`` steps per worker,
      the others claim steps from a shared counter (fast workers take more). ``samples_per_s`` counts every
      step computed (Quorum's dropped pushes included, as the e2e benchmark does); ``applied_samples_per_s``
      leaves the dropped ones out. For the grid, ``samples_per_s`` is the steady rate between the 20% and
      80% marks of the budget (no start-up or tail); for ``--check`` it is the budget over the makespan
      (last worker done, every push applied and answered), as e2e.py measures it. Local steps count as
      steps (each is ``batch`` samples); a local policy's grid budget is H times the others', so that its
      workers make as many pushes as the others' make steps.
    * **Processor sharing** (``cores``, the check's 4 workers on 2 cores): host work is CPU work shared
      by every worker in a host phase: with ``a`` such workers on ``cores`` cores each progresses at rate
      ``min(1, cores / a)``. A sleeping (device phase) or waiting worker uses no CPU and lends its share
      to the others, which is why an injected straggler barely slows DDP on the 2-core machine. Without
      ``cores`` (the grid) every worker has its own processor and accelerator.

Note [Round rules]
    The representative owner of the point-to-point kinds runs pyasync's own state machine of a shard,
    ``policy.round(n, 1)`` (pyasync/engine/core/round.py, the same object an owner of the engine keeps
    per shard), driven with events as tests/engine/test_round.py drives it: every push that reaches
    the owner is ``Round.push(w, clock, version)`` and every close ``Round.close(w)``; the actions it
    returns decide what happens: an Answer's workers get their reply, a Release is Quorum's dropped
    late push, an Update is one round's apply (Quorum, bsp:p2p). So the model cannot drift from the
    rules the engine runs. What stays the model's own is time: when an apply ends (a FIFO owner:
    ``owner_push_s`` per push, ``owner_round_s`` per round), when replies leave and arrive (the links),
    and the order of one batch of answers on the owner's link (by clock, then rank, as the answers
    queue). A worker's CLOSE reaches the owner after its last push (it follows the pushes on the same
    connection), which matters under ASP, where a worker may close while its last push is on the way.
    A local policy's owner runs ``pyasync.Local(H, mode, k).round(n, 1)``, which is its outer policy's
    machine (Local.round delegates to Local.outer(): ASP's PushRound for ``local:H:async``, Quorum(k)'s
    AggregateRound for ``local:H:quorum:K``; ``local:H`` on collectives has the barrier instead), driven
    with one event per push: ``Round.push(w, clock, version)`` where the clock counts the worker's pushes
    (outer steps), not its steps; the local steps in between reach no owner.
    DDP and BSP on collectives have no owner: their rule is the barrier above. The rules the model
    used to re-implement here (an incremental minimum for SSP, a member count for Quorum) gave the same
    records to the last digit on the grid (n = 8 to 512, every policy and scenario; n = 1024 spot-checked)
    and on ``--check``; driving the Round costs time at large n instead (its SSP check scans the
    workers for every waiting answer: about 3x the CPU time at n = 1024).

Note [Calibration]
    Grid defaults (every figure is in each record's ``calibration``):
    * Link ``loopback`` (default): fitted by least squares to ``bench/results/overlap_cpu.json`` (2 workers,
      one core each, 80 MiB of gradients in 80, 16 and 4 buckets, communication time = serial step -
      compute step): DDP's ring gives ``alpha = 269 us`` per message and ``beta = 1.03 ns/byte`` (0.97
      GB/s); pyasync's point-to-point BSP in the same run gives ``853 us`` per message, used as the
      point-to-point policies' per-message cost ``alpha_p2p`` (its threads, its Python per message and gloo's
      rendezvous). Latency 0 (it is inside alpha). ``1g``, ``10g``, ``100g``: assumed data-centre links (that
      bandwidth, 10 us per message, 5 us latency), not measurements. ``--bandwidth-gbps``,
      ``--latency-us``, ``--msg-us`` override.
    * Kernel costs per element (encode, decode, fused SGD apply per codec, flatten, unflatten) from
      ``bench/results/kernels_cpu_2core.json`` at 25M elements (2 threads).
    * Workload: the e2e benchmark's ``wide`` model (4,743,178 parameters, one bucket for pyasync and for
      DDP: torch's DDP would make 2, its first capped at 1 MiB, which doubles the ring's latency term;
      ``--ddp-buckets 2`` models that), batch 64, ``c = 56.8 ms`` (its measured compute time per step).
      No communication is hidden behind the backward pass (DDP hid 7-22% in bench/results/overlap_cpu.json;
      ``--overlap F`` hides the fraction F of DDP's and BSP's collective communication).
    ``--check`` calibrates each measured run separately (Note [Check]).

Note [Check]
    The measured runs are 4 workers sharing 2 cores: their step is mostly CPU (compute, gloo, pyasync's
    threads), so microbenchmark costs cannot predict them. The check instead fits one number per system,
    the host CPU seconds per step ``W``, to the system's ``equal``-scenario run (bisection on the model,
    with the same workers, cores, budget and device time), and predicts every other run of that system
    from it: the straggler, transient and heterogeneous scenarios (the sleeps e2e.py injects, drawn by the
    model), and runs behind an emulated link (``bandwidth_gbps``: the link from the record, the bytes from
    the bytes model, W from the same system's unthrottled ``equal`` run in another folder given to
    ``--check`` or ``--calibrate``). ``W`` is
    split into the compute (``compute_s`` scaled by cores / workers, before the push) and the rest
    (after it, concurrent with the link). ``equal`` runs are fits (``role: "fit"``, error ~0 by
    construction); the others are predictions (``role: "predict"``), judged against 15%. A record whose
    policy is ``bsp`` ran on collectives when it counts no bytes received, else on the point-to-point
    engine (the e2e runs before 2026-12-01).

What the model leaves out: CPU contention unless ``cores`` is given (and then only as processor sharing:
no caches, no GIL, no scheduler); NCCL's tree and hierarchical algorithms (every collective is a ring);
receive-side contention and switch congestion (only each sender's link is a queue); overlap of
communication with the backward pass (pushes and all-reduces start when compute ends); owners that are
not symmetric (one representative owner); the reply lag of pyasync's threads on an oversubscribed
machine (so the check's ASP staleness is lower than measured); Quorum's ``late="fold"``; failures.
For local steps it models time only: not what H local steps do to convergence per sample (it counts a
local step's samples as a synchronous step's), not the outer optimizer beyond one apply per push or
round, not ``elastic`` (outer BSP point to point) nor ``--check`` of measured local runs.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import glob
import heapq
import json
import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import _path  # noqa: F401  (first: sys.path, see bench/_path.py)
import common
import numpy as np
from harness.cli import add_systems_option, split_systems

import pyasync
from pyasync.engine.core.round import Answer, Release, Round, Update

# ------------------------------------------------------------------------------------------------
# Costs and their calibration

REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Link:
    """Each rank's sending link: a message costs ``alpha`` (per-message overhead, serialised on the
    sender) plus ``bytes * beta``, and arrives ``latency`` after it has left."""

    name: str
    alpha_s: float  # per message of a collective (ring step)
    alpha_p2p_s: float  # per point-to-point message (a push slice or a reply)
    beta_s_per_byte: float  # 1 / bandwidth
    latency_s: float  # propagation, per hop
    source: str

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def loopback_from_overlap(path: str | os.PathLike) -> dict[str, float]:
    """``alpha`` and ``beta`` fitted to bench/overlap.py's records (Note [Calibration]): per system, least
    squares of ``comm = 2 (n - 1) buckets alpha + 2 (n - 1) / n * 4 params * beta`` over bucket sizes."""
    recs = json.loads(Path(path).read_text())
    out = {}
    for system in ("ddp", "pyasync"):
        rows = [r for r in recs if r.get("system") == system]
        a = np.array(
            [
                [
                    2 * (r["workers"] - 1) * r["buckets"],
                    2 * (r["workers"] - 1) / r["workers"] * 4 * r["params"],
                ]
                for r in rows
            ],
            dtype=float,
        )
        y = np.array([r["comm_ms"] * 1e-3 for r in rows])
        (alpha, beta), *_ = np.linalg.lstsq(a, y, rcond=None)
        out[f"{system}_alpha_s"], out[f"{system}_beta_s_per_byte"] = float(alpha), float(beta)
    return out


#: The presets. ``loopback`` is loopback_from_overlap(bench/results/overlap_cpu.json), rounded
#: (tests/benchmarks/test_simulate.py checks the constants against the file); the others are assumptions.
LINKS = {
    "loopback": Link(
        "loopback", 269e-6, 853e-6, 1.03e-9, 0.0, "fit to bench/results/overlap_cpu.json (2 workers, 2 cores)"
    ),
    "1g": Link("1g", 10e-6, 10e-6, 8e-9, 5e-6, "assumed: 1 Gbit/s, 10 us per message, 5 us latency"),
    "10g": Link("10g", 10e-6, 10e-6, 0.8e-9, 5e-6, "assumed: 10 Gbit/s, 10 us per message, 5 us latency"),
    "100g": Link("100g", 10e-6, 10e-6, 0.08e-9, 5e-6, "assumed: 100 Gbit/s, 10 us per message, 5 us latency"),
}
#: A link that costs nothing (the check's unthrottled loopback: its communication is CPU work inside W).
FREE_LINK = Link("free", 0.0, 0.0, 0.0, 0.0, "no link cost")

CODECS = ("none", "fp16", "bf16", "int8", "sign", "topk")


def kernels_from_file(path: str | os.PathLike, numel: int = 25_000_000) -> dict[str, float]:
    """Seconds per element of each kernel (``encode:<codec>``, ``decode:<codec>``, ``apply:<codec>`` (SGD),
    ``flatten``, ``unflatten``) from bench/kernels.py's records of size ``numel``."""
    out = {}
    for r in json.loads(Path(path).read_text()):
        if r.get("numel") != numel or r.get("ms") is None or r.get("device", "cpu") != "cpu":
            continue
        op = r["op"]
        if op.startswith("apply:sgd:"):
            op = "apply:" + op.split(":")[2]
        elif op.startswith("apply:"):
            continue
        out[op] = r["ms"] * 1e-3 / numel
    return out


#: kernels_from_file(bench/results/kernels_cpu_2core.json), seconds per element, rounded.
KERNELS = {
    "flatten": 0.2668e-9, "unflatten": 0.2311e-9,
    "encode:none": 0.3959e-9, "encode:fp16": 0.5982e-9, "encode:bf16": 0.4885e-9,
    "encode:int8": 0.4398e-9, "encode:sign": 0.4727e-9, "encode:topk": 0.4562e-9,
    "decode:none": 0.2663e-9, "decode:fp16": 0.2104e-9, "decode:bf16": 0.2044e-9,
    "decode:int8": 0.1871e-9, "decode:sign": 0.1673e-9, "decode:topk": 0.1751e-9,
    "apply:none": 0.5280e-9, "apply:fp16": 0.4153e-9, "apply:bf16": 0.4188e-9,
    "apply:int8": 0.3621e-9, "apply:sign": 0.5169e-9, "apply:topk": 0.7472e-9,
}  # fmt: skip
KERNELS_SOURCE = "bench/results/kernels_cpu_2core.json, 25M elements, 2 threads"

HEADER_BYTES = 128  # every pyasync frame's header


def wire_bytes_per_element(codec: str) -> float:
    """Bytes a push carries per fp32 element under ``codec`` (the payload layouts of bench/README.md):
    none 4, fp16/bf16 2, int8[:block] 1 + 4 / block, sign[:block] 1/8 + 4 / block, topk[:ratio] 8 ratio."""
    name, _, arg = codec.partition(":")
    if name == "none":
        return 4.0
    if name in ("fp16", "bf16"):
        return 2.0
    if name == "int8":
        return 1.0 + 4.0 / int(arg or 256)
    if name == "sign":
        return 1.0 / 8 + 4.0 / int(arg or 256)
    if name == "topk":
        return 8.0 * float(arg or 0.01)
    raise ValueError(f"unknown codec {codec!r}: choose from {', '.join(CODECS)} (with :arg)")


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one step computes and sends."""

    params: int = 4_743_178  # the e2e `wide` model
    batch: int = 64
    compute_s: float = 0.0568  # its measured compute time per step, C (bench/results/e2e_cpu_wide)
    buckets: int = 1  # pyasync's buckets (25 MiB cap)
    ddp_buckets: int = (
        1  # DDP's (in e2e.py 2: torch caps its first bucket at 1 MiB; 1 compares like with like)
    )
    overlap: float = 0.0  # DDP/BSP: the fraction of the collective's communication hidden behind backward


# ------------------------------------------------------------------------------------------------
# Policies and scenarios


@dataclasses.dataclass(frozen=True)
class Policy:
    """A system: ``kind`` is ddp, bsp (on collectives), bsp:p2p, ssp, asp, quorum or asp:wait (ASP whose
    worker waits for the answers to its push: the outer policy of ``local:H:async``). Local steps
    (``local`` set: "sync", "quorum" or "async") push every ``local_steps``-th step only, under the
    outer policy's ``kind`` (bsp, quorum, asp:wait)."""

    spec: str
    kind: str
    staleness: int = 0  # SSP's s
    quorum: int = 0  # Quorum's k
    codec: str = "none"
    local: str = ""  # Local's mode ("sync", "quorum", "async"); "" for the per-step policies
    local_steps: int = 1  # Local's H: steps per push

    @property
    def synchronous(self) -> bool:
        """Every worker takes the same number of steps (the e2e benchmark's rule: DDP and BSP)."""
        return self.kind in ("ddp", "bsp", "bsp:p2p")

    @property
    def barrier(self) -> bool:
        return self.kind in ("ddp", "bsp")

    @property
    def family(self) -> str:
        return "local" if self.local else {"bsp:p2p": "bsp"}.get(self.kind, self.kind)

    @property
    def resolved(self) -> str:
        """The spec with n-relative sizes resolved (``quorum:7``, ``local:16:quorum:7``), no codec."""
        if self.local:
            outer = {"sync": "", "quorum": f":quorum:{self.quorum}", "async": ":async"}[self.local]
            return f"local:{self.local_steps}{outer}"
        return (
            self.kind
            + (f":{self.staleness}" if self.kind == "ssp" else "")
            + (f":{self.quorum}" if self.kind == "quorum" else "")
        )

    def round(self, n: int) -> Round | None:
        """The owner's state machine of one shard, pyasync's own (pyasync/engine/core/round.py), for the
        point-to-point kinds; None for DDP and BSP on collectives (a barrier, no owner). A local policy's
        is ``pyasync.Local(...).round(n, 1)``: its outer policy's machine."""
        if self.local and not self.barrier:
            k = self.quorum if self.local == "quorum" else 0
            return pyasync.Local(self.local_steps, mode=self.local, k=k).round(n, 1)
        pol = {
            "bsp:p2p": lambda: pyasync.BSP(p2p=True),
            "ssp": lambda: pyasync.SSP(self.staleness),
            "asp": lambda: pyasync.ASP(),
            "quorum": lambda: pyasync.Quorum(self.quorum),
        }.get(self.kind)
        return None if pol is None else pol().round(n, 1)


def parse_policy(spec: str, n: int) -> Policy:
    """``ddp``, ``ddp+fp16``, ``bsp``, ``bsp:p2p``, ``ssp:S``, ``asp``, ``quorum:K`` (``K`` may be ``n``,
    ``n-1``, ``n-J``), ``local:H``, ``local:H:quorum:K``, ``local:H:async``, each optionally ``+CODEC``
    (int8, int8:64, topk:0.01, fp16, bf16, sign)."""
    name, _, codec = spec.strip().lower().partition("+")
    codec = codec or "none"
    wire_bytes_per_element(codec)  # validates
    head, _, arg = name.partition(":")
    if head == "ddp" and not arg:
        if codec not in ("none", "fp16", "bf16"):
            raise ValueError(f"{spec!r}: DDP takes no compression but fp16/bf16")
        return Policy(spec, "ddp", codec=codec)
    if head == "quorum":  # n-relative sizes first: pyasync.parse_policy reads quorum:K only
        name = f"quorum:{_n_relative(arg, n)}"
    if head == "local":
        return _local_policy(spec, arg, codec, n)
    pol = _pyasync_policy(spec, name)
    if isinstance(pol, pyasync.BSP):
        return Policy(spec, "bsp:p2p" if pol.p2p else "bsp", codec=codec)
    if isinstance(pol, pyasync.Quorum):
        if not 1 <= pol.k <= n:
            raise ValueError(f"{spec!r}: Quorum needs 1 <= k <= n = {n} (quorum:3, quorum:n-1)")
        return Policy(spec, "quorum", quorum=pol.k, codec=codec)
    if isinstance(pol, pyasync.SSP):
        return Policy(spec, "ssp", staleness=pol.staleness, codec=codec)
    return Policy(spec, "asp", codec=codec)


def _n_relative(size: str, n: int) -> str:
    """A size that may be ``n`` or ``n-J`` (quorum:n-1) as an integer's text; other text unchanged."""
    a = size.replace(" ", "")
    if a == "n":
        return str(n)
    if a.startswith("n-") and a[2:].isdigit():
        return str(n - int(a[2:]))
    return size


def _local_policy(spec: str, arg: str, codec: str, n: int) -> Policy:
    """``local:H`` (outer BSP on collectives), ``local:H:quorum:K`` (``K`` may be n-relative; outer
    Quorum(k)) or ``local:H:async`` (outer ASP that waits for its own answers), read by
    ``pyasync.parse_policy`` (no ``lr=``/``momentum=`` options: they change no time)."""
    parts = arg.split(":")
    if len(parts) == 3 and parts[1] == "quorum":
        parts[2] = _n_relative(parts[2], n)
    name = "local:" + ":".join(parts)
    usage = "local:H, local:H:quorum:K, local:H:async (+codec), without options"
    if "=" in name:
        raise ValueError(f"policy {spec!r}: the model knows {usage}")
    try:
        pol = pyasync.parse_policy(name)
        pol.validate(n)
    except (ValueError, TypeError) as e:
        raise ValueError(f"policy {spec!r}: {e}; the model knows {usage}") from None
    kind = {"sync": "bsp", "quorum": "quorum", "async": "asp:wait"}[pol.mode]
    return Policy(spec, kind, quorum=pol.k, codec=codec, local=pol.mode, local_steps=pol.steps)


def _pyasync_policy(spec: str, name: str) -> Any:
    """``pyasync.parse_policy(name)`` for :func:`parse_policy`, restricted to what the model models:
    BSP (collectives or ``p2p``), SSP(s), ASP and Quorum(k) without options (``:inverse``, ``:fold``,
    ``key=value``); ValueError naming ``spec`` otherwise."""
    usage = "ddp, bsp, bsp:p2p, ssp:S, asp, quorum:K, local:H[:quorum:K|:async] (+codec)"
    try:
        pol = pyasync.parse_policy(name)
    except (ValueError, TypeError) as e:
        raise ValueError(f"unknown policy {spec!r}: {e}; the model knows {usage}") from None
    # Only the forms the model has rules for: no options (asp:inverse, ssp:2:inverse, quorum:3:fold).
    if name.count(":") > (0 if isinstance(pol, pyasync.ASP) else 1):
        raise ValueError(f"policy {spec!r}: the model knows {usage} only, without options")
    return pol


@dataclasses.dataclass(frozen=True)
class Scenario:
    """How step times vary: ``f[w, k]``, the time of step k of worker w in units of the base compute."""

    name: str
    straggler: tuple[int, float] | None = None  # (rank, factor); rank -1: the last
    speeds: tuple[float, ...] | None = None  # per rank (the e2e `hetero`); cycled if shorter than n
    sigma: float = 0.0  # log-normal noise, mean 1
    transient: tuple[float, float] | None = None  # (prob, factor)
    pause: tuple[float, float] | None = None  # (prob, length in units of the base compute)
    about: str = ""

    def factors(self, rng: np.random.Generator, n: int, steps: int) -> np.ndarray:
        """``f`` for ``n`` workers and ``steps`` steps (float64, shape (n, steps))."""
        f = np.ones((n, steps))
        if self.speeds is not None:
            sp = np.resize(np.asarray(self.speeds, dtype=float), n)
            f *= sp[:, None]
        if self.straggler is not None:
            rank, factor = self.straggler
            f[rank if rank >= 0 else n + rank] *= factor
        if self.sigma > 0:
            f *= np.exp(self.sigma * rng.standard_normal((n, steps)) - self.sigma**2 / 2)
        if self.transient is not None:
            prob, factor = self.transient
            f *= np.where(rng.random((n, steps)) < prob, factor, 1.0)
        if self.pause is not None:
            prob, length = self.pause
            f += np.where(rng.random((n, steps)) < prob, length, 0.0)
        return f

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: Pauses: 1% of steps get an extra 10 compute times (a preemption, a GC or I/O stall).
PAUSE = (0.01, 10.0)


def scenario(name: str) -> Scenario:
    """``equal``, ``one-slow`` (the last worker 2x: e2e's slow2x), ``lognormal:SIGMA``, ``pauses``
    (``pauses:P:L``), ``transient`` (e2e's: 5x with probability 0.1), ``hetero`` (e2e's speeds 1, 1, 1.5, 2,
    repeated over the ranks)."""
    head, _, arg = name.strip().lower().partition(":")
    if head == "equal":
        return Scenario("equal", about="all workers at equal speed")
    if head in ("one-slow", "slow2x"):
        factor = float(arg or 2.0)
        return Scenario(f"one-slow{':' + arg if arg else ''}", straggler=(-1, factor),
                        about=f"the last worker {factor:g}x slower")  # fmt: skip
    if head == "lognormal":
        sigma = float(arg or 0.3)
        return Scenario(f"lognormal:{sigma:g}", sigma=sigma, about=f"log-normal step times, sigma {sigma:g}")
    if head == "pauses":
        prob, length = (float(x) for x in arg.split(":")) if arg else PAUSE
        return Scenario(f"pauses{':' + arg if arg else ''}", pause=(prob, length),
                        about=f"{prob:g} of steps pause {length:g}x the compute time")  # fmt: skip
    if head == "transient":
        return Scenario("transient", transient=(0.1, 5.0), about="each step 5x slower with probability 0.1")
    if head == "hetero":
        return Scenario("hetero", speeds=(1.0, 1.0, 1.5, 2.0), about="speeds 1, 1, 1.5, 2 (cycled)")
    raise ValueError(
        f"unknown scenario {name!r}: equal, one-slow, lognormal:S, pauses[:P:L], transient, hetero"
    )


# ------------------------------------------------------------------------------------------------
# Per-step costs of one system at n workers


@dataclasses.dataclass(frozen=True)
class Costs:
    """Everything the event loop needs (seconds). ``device_s`` is the base the factors multiply;
    ``extra_only``: a step sleeps ``(f - 1) device_s`` (the check's CPU-only runs, where the compute is
    host work) instead of ``f device_s``."""

    device_s: float
    host_c_s: float = 0.0  # CPU work before the push
    host_m_s: float = 0.0  # CPU work after it
    push_tx_s: float = 0.0  # a push burst on the sender's link
    reply_tx_s: float = 0.0  # one owner's answer to one worker, on the owner's link
    latency_s: float = 0.0
    own_link_s: float = 0.0  # barrier systems: link time each worker reserves at its push (e2e's DDP hook)
    collective_s: float = 0.0  # barrier systems: after the barrier
    owner_push_s: float = 0.0  # representative owner, per push
    owner_round_s: float = 0.0  # per round (BSP/Quorum)
    extra_only: bool = False
    bytes_per_step: float = 0.0  # what a rank sends per step (model), for the records
    local_host_s: float = 0.0  # local policies: CPU work of every step (the inner optimizer step)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def model_costs(policy: Policy, n: int, work: Workload, link: Link, kernels: Mapping[str, float]) -> Costs:
    """The grid's costs (Note [The model], Note [Calibration]): device compute ``c``, link and kernels. A
    local policy's push costs what its outer policy's does; on top, every step runs the inner optimizer
    on the worker (``apply:none`` on M, as DDP's step) and each push computes the pseudo-gradient and
    keeps the new anchor (two passes over M at the ``flatten`` rate); its bytes per step fall by H."""
    m = float(work.params)
    if policy.local:
        outer = model_costs(dataclasses.replace(policy, local="", local_steps=1), n, work, link, kernels)
        return dataclasses.replace(
            outer,
            host_c_s=outer.host_c_s + 2 * kernels["flatten"] * m,
            local_host_s=kernels["apply:none"] * m,
            bytes_per_step=outer.bytes_per_step / policy.local_steps,
        )
    codec = policy.codec.split(":")[0]
    r = wire_bytes_per_element(policy.codec)
    beta, lat = link.beta_s_per_byte, link.latency_s
    if policy.kind == "ddp":
        b = work.ddp_buckets
        wire = m * r
        coll = 2 * (n - 1) * b * (link.alpha_s + lat) + 2 * (n - 1) / n * wire * beta
        coll *= 1.0 - work.overlap
        host = (kernels["encode:" + codec] * 2 * m if codec != "none" else 0.0) + kernels["apply:none"] * m
        return Costs(work.compute_s, collective_s=coll + host, bytes_per_step=2 * (n - 1) / n * wire)
    b = work.buckets
    hdr = HEADER_BYTES
    if policy.kind == "bsp":
        lossy = codec != "none"
        rs = (n - 1) * b * (link.alpha_s + lat) + (n - 1) / n * (m * r + b * hdr * lossy) * beta
        reply_r = r if lossy else 4.0
        ag = (n - 1) * b * (link.alpha_s + lat) + (n - 1) / n * m * reply_r * beta
        enc = kernels["encode:" + codec] * m if lossy else kernels["flatten"] * m
        own = (kernels["decode:" + codec] * m if lossy else 0.0) + kernels["apply:none"] * m / n
        if lossy:  # compressed replies: encode the delta, every rank decodes every frame
            own += kernels["encode:" + codec] * m / n + kernels["decode:" + codec] * m
        install = kernels["unflatten"] * m
        sent = (n - 1) / n * m * (r + reply_r)
        comm = (rs + ag) * (1.0 - work.overlap)
        return Costs(work.compute_s, collective_s=enc + comm + own + install, bytes_per_step=sent)
    # point to point: one push burst, one reply per owner
    push_bytes = (n - 1) / n * m * r + (n - 1) * b * hdr
    reply_bytes = m / n * 4.0 + b * hdr
    push = (n - 1) * b * link.alpha_p2p_s + push_bytes * beta
    reply = b * link.alpha_p2p_s + reply_bytes * beta
    if policy.kind in ("ssp", "asp", "asp:wait"):
        owner_push, owner_round = kernels["apply:" + codec] * m / n, 0.0
    else:
        owner_push, owner_round = kernels["decode:" + codec] * m / n, kernels["apply:none"] * m / n
    host = kernels["encode:" + codec] * m + kernels["unflatten"] * m
    return Costs(
        work.compute_s,
        host_c_s=host,
        push_tx_s=push,
        reply_tx_s=reply,
        latency_s=lat,
        owner_push_s=owner_push,
        owner_round_s=owner_round,
        bytes_per_step=push_bytes + (n - 1) * reply_bytes,
    )


# ------------------------------------------------------------------------------------------------
# The event loop

_START, _DEV, _CPU, _PUSH, _ARRIVE, _REPLY, _BARRIER = range(7)


@dataclasses.dataclass
class Result:
    """One simulated run."""

    samples_per_s: float  # budget (samples) over the makespan
    window_samples_per_s: float  # steady rate between the 20% and 80% marks of the budget
    makespan_s: float
    steps: list[int]  # per worker
    pushes_applied: int
    pushes_dropped: int
    staleness: np.ndarray  # of applied pushes
    wait_s: list[float]  # per worker: time between its host work's end and its next start
    trace: dict[str, list] | None = None

    @property
    def applied_fraction(self) -> float:
        total = self.pushes_applied + self.pushes_dropped
        return self.pushes_applied / total if total else 1.0

    def staleness_stats(self) -> dict[str, float | None]:
        s = self.staleness
        if s.size == 0:
            return {"mean": None, "p50": None, "p99": None, "max": None}
        ss = np.sort(s)

        def q(p: float) -> int:  # nearest rank, as pyasync.demo.report.histogram_percentile
            return int(ss[max(0, math.ceil(p * ss.size) - 1)])

        return {"mean": float(s.mean()), "p50": q(0.5), "p99": q(0.99), "max": int(ss[-1])}


_MASK = (True,)  # every push covers the one segment of the representative shard


class _Sim:
    """One run of one system; see Note [The model]. Events: a worker's start, the end of its device phase
    (processor sharing only), a CPU job's end, its push, the push's arrival at the owners, an answer's
    arrival at the worker (not under ASP, which reads its answers when it starts a step), a barrier's end.
    The representative owner applies a push on arrival: a FIFO server, so the finish time is known then,
    and the answers are sent at that finish time (only the order in which an owner's link takes an answer
    and a push of its own that start within one apply of each other can differ from a strict FIFO)."""

    def __init__(
        self,
        policy: Policy,
        n: int,
        costs: Costs,
        factors: Callable[[int], np.ndarray],
        steps0: int,
        budget: int,
        batch: int,
        cores: float | None,
        window: int,
        trace: bool,
    ) -> None:
        self.p, self.n, self.c = policy, n, costs
        self.kind = policy.kind
        self.H = policy.local_steps  # steps per push (local steps; 1 for the others)
        self.factors_fn = factors
        self.frows: list[list[float]] = factors(steps0).tolist()  # per worker, extended on demand
        self.budget, self.batch, self.cores, self.window = budget, batch, cores, window
        self.per_rank = budget // n if policy.synchronous else None
        self.claimed = 0
        self.heap: list[tuple] = []
        self.seq = 0
        self.now = 0.0
        # workers
        self.steps = [0] * n  # steps started
        self.closed = [False] * n
        self.live = n
        self.ready_at = [0.0] * n  # when its host work after the push ended (waiting since)
        self.is_ready = [False] * n
        self.wait = [0.0] * n
        self.installed = [0] * n  # version of the newest answer installed
        self.read = [0] * n  # version its current step computes on
        self.answered = [-1] * n  # newest clock answered
        self.inbox: list[list[tuple[float, int]]] = [
            [] for _ in range(n)
        ]  # ASP: answers on their way (heaps)
        self.departs: list[deque] = [deque() for _ in range(n)]
        self.push_times: list[float] = []  # when each step's compute ended (a push, or a local step)
        # links (every rank's sending link) and the representative owner
        self.tx = np.zeros(n)
        self.buf = np.zeros(n)
        self.tx_max = 0.0
        self.srv = 0.0  # the owner is busy until
        self.version = 0  # barriers: updates (the point-to-point kinds read their Round's version)
        self.staleness: list[int] = []
        self.applied = 0  # pushes applied (or summed into an update)
        self.dropped = 0
        self.last_t = 0.0  # the latest answer or apply
        # the point-to-point kinds: pyasync's Round decides applies, drops and answers (Note [Round rules])
        self.round = policy.round(n)
        self.in_flight = [0] * n  # pushes sent, not yet at the owner
        self.close_behind = [False] * n  # closed while pushes were in flight
        # barrier
        self.n_ready = 0
        self.link_done = [0.0] * n
        # CPU (processor sharing)
        self.jobs: dict[tuple[int, int], float] = {}
        self.cpu_t = 0.0
        self.cpu_gen = 0
        self.trace = {"starts": [], "pushes": [], "answers": [], "closes": []} if trace else None

    # -- plumbing
    def at(self, t: float, kind: int, a: int = 0, b: int = 0, c: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b, c))

    def factor(self, w: int, k: int) -> float:
        row = self.frows[w]
        if k >= len(row):  # every row has the same length: extend them all, doubling
            for r, extra in zip(self.frows, self.factors_fn(len(row)).tolist()):
                r.extend(extra)
        return row[k]

    def run(self) -> Result:
        for w in range(self.n):
            self.start(w)
        heap, pop = self.heap, heapq.heappop
        push, arrive, reply, cpu_event = self.push, self.arrive, self.reply, self.cpu_event
        while heap:
            t, _, kind, a, b, c = pop(heap)
            self.now = t
            if kind == _PUSH:
                push(a)
            elif kind == _ARRIVE:
                self.in_flight[a] -= 1
                arrive(a, b, c)
                if self.close_behind[a] and not self.in_flight[a]:
                    self.owner_close(a)
            elif kind == _REPLY:
                reply(a, b, c)
            elif kind == _CPU:
                cpu_event(a, b, c)
            elif kind == _DEV:
                if self.local_step(a):
                    self.cpu_add(a, 2, self.c.local_host_s)
                else:
                    self.cpu_add(a, 0, self.c.host_c_s + self.c.local_host_s)
            elif kind == _BARRIER:
                self.barrier_done()
            else:
                self.start(a)
        makespan = max(self.now, self.srv, self.last_t)
        steps = list(self.steps)
        samples = sum(steps) * self.batch
        overall = samples / makespan if makespan > 0 else math.inf
        pt = sorted(self.push_times)
        window = overall
        if len(pt) >= 10:
            t_lo, t_hi = pt[int(0.2 * len(pt))], pt[int(0.8 * len(pt)) - 1]
            if t_hi > t_lo:
                count = bisect.bisect_right(pt, t_hi) - bisect.bisect_right(pt, t_lo)
                window = count * self.batch / (t_hi - t_lo)
        return Result(
            samples_per_s=overall,
            window_samples_per_s=window,
            makespan_s=makespan,
            steps=steps,
            pushes_applied=self.applied,
            pushes_dropped=self.dropped,
            staleness=np.asarray(self.staleness, dtype=np.int64),
            wait_s=self.wait,
            trace=self.trace,
        )

    # -- processor sharing (cores) or a processor per worker (cores None)
    def cpu_add(self, w: int, phase: int, work: float) -> None:
        if self.cores is None or work <= 0:
            self.at(self.now + max(work, 0.0), _CPU, w, phase, -1)
            return
        self.cpu_advance()
        self.jobs[(w, phase)] = work
        self.cpu_schedule()

    def cpu_rate(self) -> float:
        return min(1.0, self.cores / len(self.jobs)) if self.jobs else 1.0

    def cpu_advance(self) -> None:
        dt = self.now - self.cpu_t
        if dt > 0 and self.jobs:
            done = dt * self.cpu_rate()
            for key in self.jobs:
                self.jobs[key] -= done
        self.cpu_t = self.now

    def cpu_schedule(self) -> None:
        self.cpu_gen += 1
        if self.jobs:
            key = min(self.jobs, key=lambda j: (self.jobs[j], j))
            t = self.now + max(self.jobs[key], 0.0) / self.cpu_rate()
            self.at(t, _CPU, key[0], key[1], self.cpu_gen)

    def cpu_event(self, w: int, phase: int, gen: int) -> None:
        if gen >= 0:  # processor sharing: only the newest schedule counts
            if gen != self.cpu_gen:
                return
            self.cpu_advance()
            del self.jobs[(w, phase)]
            self.cpu_schedule()
        if phase == 0:
            self.push(w)
        elif phase == 2:
            self.local_done(w)
        else:
            self.host_done(w)

    # -- a worker's step
    def local_step(self, w: int) -> bool:
        """Is w's current step a local one (no push: not every H-th)?"""
        return self.H > 1 and self.steps[w] % self.H != 0

    def local_done(self, w: int) -> None:
        """A local step's compute is done: no push, no wait, the next step starts."""
        self.push_times.append(self.now)
        self.start(w)

    def start(self, w: int) -> None:
        if self.is_ready[w]:
            self.is_ready[w] = False
            self.wait[w] += self.now - self.ready_at[w]
        if self.per_rank is not None:
            if self.steps[w] >= self.per_rank:
                return self.close(w)
        elif self.claimed >= self.budget:
            return self.close(w)
        self.claimed += 1
        k = self.steps[w]
        self.steps[w] += 1
        if self.kind == "asp":  # installs the newest answers that have arrived
            box = self.inbox[w]
            while box and box[0][0] <= self.now:
                v = heapq.heappop(box)[1]
                if v > self.installed[w]:
                    self.installed[w] = v
        self.read[w] = self.installed[w]
        if self.trace is not None:
            self.trace["starts"].append((self.now, w, k, self.read[w]))
        f = self.factor(w, k)
        d = max(self.c.device_s * ((f - 1.0) if self.c.extra_only else f), 0.0)
        if self.cores is None and self.local_step(w):  # compute only (the device and the inner step)
            self.at(self.now + d + self.c.local_host_s, _CPU, w, 2, -1)
        elif self.cores is None:  # no sharing: the device and the first host phase in one event
            t = self.now + d + self.c.host_c_s + self.c.local_host_s
            dq = self.departs[w]
            if len(dq) >= self.window and dq[-self.window] > t:  # its send frames are still busy then
                self.wait[w] += dq[-self.window] - t
                t = dq[-self.window]
            self.at(t, _PUSH, w)
        else:
            self.at(self.now + d, _DEV, w)

    def push(self, w: int) -> None:
        """Worker w's compute of its current step is done: send it (its clock counts pushes: outer steps)."""
        k = self.steps[w] // self.H - 1
        if self.p.barrier:
            if self.c.own_link_s > 0:
                start = max(self.now, float(self.tx[w]))
                self.link_done[w] = start + self.c.own_link_s
                self.tx[w] = self.link_done[w]
            self.record_push(w, k)
            return self.host_after(w)
        dq = self.departs[w]
        if len(dq) >= self.window and dq[-self.window] > self.now:  # its send frames are busy
            self.wait[w] += dq[-self.window] - self.now
            return self.at(dq[-self.window], _PUSH, w)
        self.record_push(w, k)
        txw = float(self.tx[w])
        if self.c.push_tx_s > 0 or txw > self.now:
            depart = max(self.now, txw) + self.c.push_tx_s
            self.tx[w] = depart
            if depart > self.tx_max:
                self.tx_max = depart
        else:
            depart = self.now
        dq.append(depart)
        if len(dq) > self.window:
            dq.popleft()
        arrival = depart + self.c.latency_s
        if arrival > self.now:
            self.in_flight[w] += 1
            self.at(arrival, _ARRIVE, w, k, self.read[w])
        else:
            self.arrive(w, k, self.read[w])
        self.host_after(w)

    def record_push(self, w: int, k: int) -> None:
        self.push_times.append(self.now)
        if self.trace is not None:
            self.trace["pushes"].append((self.now, w, k))

    def host_after(self, w: int) -> None:
        if self.cores is None and self.c.host_m_s <= 0:
            return self.host_done(w)
        self.cpu_add(w, 1, self.c.host_m_s)

    def host_done(self, w: int) -> None:
        self.is_ready[w] = True
        self.ready_at[w] = self.now
        if self.p.barrier:
            self.n_ready += 1
            if self.n_ready == self.live:
                self.barrier()
        else:
            self.try_continue(w)

    def try_continue(self, w: int) -> None:
        if not self.is_ready[w] or self.closed[w]:
            return
        if self.kind != "asp" and self.answered[w] < self.steps[w] // self.H - 1:
            return  # waits for the answer to its push
        self.start(w)

    def close(self, w: int) -> None:
        if self.trace is not None:
            self.trace["closes"].append((self.now, w))
        self.closed[w] = True
        self.live -= 1
        if self.round is not None and not self.in_flight[w]:
            self.owner_close(w)
        elif self.round is not None:  # its CLOSE travels behind its pushes: the owner hears of it after them
            self.close_behind[w] = True
        elif self.p.barrier and self.live and self.n_ready == self.live:
            self.barrier()

    # -- DDP and BSP on collectives
    def barrier(self) -> None:
        t = max([self.now] + [self.link_done[w] for w in range(self.n) if not self.closed[w]])
        self.n_ready = 0
        self.at(t + self.c.collective_s, _BARRIER)

    def barrier_done(self) -> None:
        self.version += 1
        for w in range(self.n):
            if not self.closed[w]:
                self.applied += 1
                self.staleness.append(0)
                self.start(w)

    # -- the representative owner
    def arrive(self, w: int, k: int, ver: int) -> None:
        """Worker w's push of clock k, computed on version ``ver``, reaches the owner: its Round decides
        (Note [Round rules]); the model adds the owner's time."""
        rnd = self.round
        if self.kind in ("ssp", "asp", "asp:wait"):  # applied on arrival, a FIFO server: answers once applied
            done = max(self.now, self.srv) + self.c.owner_push_s
            self.srv = done
            self.staleness.append(rnd.version - ver)
            self.applied += 1
            return self.owner_actions(rnd.push(w, k, ver, True, _MASK, (w, k)), done)
        if not rnd.policy.is_late(ver, rnd.version):  # a fresh push: decoded and summed on arrival
            self.srv = max(self.now, self.srv) + self.c.owner_push_s
        self.owner_actions(rnd.push(w, k, ver, True, _MASK, (w, k)), self.now)

    def owner_close(self, w: int) -> None:
        """Worker w's CLOSE reaches the owner (after its last push): what waited for w may go on."""
        self.owner_actions(self.round.close(w), max(self.now, self.srv))

    def owner_actions(self, actions: list, t: float) -> None:
        """Carry out what the Round asked for: a Release is a dropped push (Quorum's late ones: the only
        pushes released here, all being finite); an Update costs the owner one apply, then its Answer
        is one reply per member from every owner (:meth:`reply_batch`); any other Answer goes out at
        time ``t``, in clock order (the order the owner's queue holds them). The final answer (every
        worker closed) reaches nobody who still waits."""
        rnd, updated = self.round, False
        for act in actions:
            if isinstance(act, Release):
                self.dropped += 1
            elif isinstance(act, Update):
                updated = True
                self.srv = max(self.now, self.srv) + self.c.owner_round_s
            elif isinstance(act, Answer) and not act.final:
                if updated:  # a round's update: every member has pushed on the version before it
                    self.applied += len(act.dests)
                    self.staleness.extend([0] * len(act.dests))
                    ws = [w for w, _ in act.dests]
                    for (w, k), at in zip(act.dests, self.reply_batch(ws, self.srv)):
                        self.reply_at(at, w, k, rnd.version)
                else:
                    for w, k in sorted(act.dests, key=lambda d: (d[1], d[0])):
                        self.answer(w, k, rnd.version, t)

    # -- answers
    def answer(self, w: int, k: int, version: int, t: float) -> None:
        """Every remote owner sends w one reply at time t; w has its answer when the last one arrived."""
        rm = self.c.reply_tx_s
        if self.n == 1:
            arrival = t
        elif rm <= 0 and self.tx_max <= t:
            arrival = t + self.c.latency_s
        else:
            buf = np.maximum(self.tx, t, out=self.buf)
            buf += rm
            mine = self.tx[w]
            buf[w] = -math.inf
            last = float(buf.max())
            buf[w] = mine
            self.buf, self.tx = self.tx, buf
            arrival = last + self.c.latency_s
            if last > self.tx_max:
                self.tx_max = last
        self.reply_at(arrival, w, k, version)

    def reply_batch(self, ws: list[int], t: float) -> list[float]:
        """A round's answers, sent at time t: each owner r sends one reply to every member but itself, in
        rank order; a member has its answer when the last remote owner's reply to it has arrived."""
        rm, lat = self.c.reply_tx_s, self.c.latency_s
        if self.n == 1:
            return [t] * len(ws)
        if rm <= 0 and self.tx_max <= t:
            return [t + lat] * len(ws)
        order = sorted(range(len(ws)), key=lambda i: ws[i])
        sw = np.array([ws[i] for i in order])
        start = np.maximum(self.tx, t)
        is_member = np.zeros(self.n, dtype=bool)
        is_member[sw] = True
        m = len(sw)
        pos = np.arange(m)
        outside = start[~is_member]
        a = float(outside.max()) if outside.size else -math.inf
        ms = start[sw]
        before = np.maximum.accumulate(np.concatenate([[-math.inf], ms[:-1]]))  # members ranked below
        after = np.concatenate([np.maximum.accumulate(ms[::-1])[::-1][1:], [-math.inf]])  # ranked above
        arr = np.maximum(np.maximum(a + (pos + 1) * rm, before + pos * rm), after + (pos + 1) * rm) + lat
        self.tx = start + rm * (m - is_member)
        self.tx_max = max(self.tx_max, float(self.tx.max()))
        out = [0.0] * len(ws)
        for j, i in enumerate(order):
            out[i] = float(arr[j])
        return out

    def reply_at(self, t: float, w: int, k: int, version: int) -> None:
        if self.trace is not None:
            self.trace["answers"].append((t, w, k, version))
        if t > self.last_t:
            self.last_t = t
        if self.kind == "asp":  # it does not wait: the answer is installed at a later start
            if t <= self.now and version > self.installed[w]:
                self.installed[w] = version
            elif t > self.now:
                heapq.heappush(self.inbox[w], (t, version))
            return
        if t > self.now:
            self.at(t, _REPLY, w, k, version)
        else:
            self.reply(w, k, version)

    def reply(self, w: int, k: int, version: int) -> None:
        if version > self.installed[w]:
            self.installed[w] = version
        if k > self.answered[w]:
            self.answered[w] = k
        self.try_continue(w)


def simulate(
    policy: Policy,
    n: int,
    costs: Costs,
    scen: Scenario,
    budget: int,
    batch: int = 1,
    seed: int = 0,
    cores: float | None = None,
    window: int = 2,
    trace: bool = False,
) -> Result:
    """Run ``policy`` on ``n`` workers for a budget of ``budget`` steps of ``batch`` samples each (Note [The
    model]); ``cores``: processor sharing of the host work, None: a processor per worker."""
    if n < 1 or budget < n:
        raise ValueError(f"need n >= 1 and a budget of at least n steps, got n={n}, budget={budget}")
    if cores is not None and cores <= 0:
        raise ValueError(f"cores must be > 0, got {cores}")
    rng = np.random.default_rng(seed)
    steps0 = budget // n + 2  # the same for every policy: equal draws for equal (worker, step)

    def factors(steps: int) -> np.ndarray:
        return scen.factors(rng, n, steps)

    return _Sim(policy, n, costs, factors, steps0, budget, batch, cores, window, trace).run()


# ------------------------------------------------------------------------------------------------
# The grid


def grid_budget(n: int, min_steps: int, worker_steps: int) -> int:
    """Steps of a grid run: at least ``min_steps`` per worker and ``worker_steps`` in all, a multiple of n."""
    per = max(min_steps, math.ceil(worker_steps / n))
    return per * n


def run_grid(
    ns: Sequence[int],
    policies: Sequence[str],
    scenarios: Sequence[str],
    link: Link,
    work: Workload,
    kernels: Mapping[str, float] = KERNELS,
    seed: int = 0,
    min_steps: int = 24,
    worker_steps: int = 3072,
    window: int = 2,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """One record per (scenario, n, policy) of the scale model (Note [The model], Note [Calibration]). A
    local policy's budget is H times the others' (as many pushes per worker as they make steps)."""
    records: list[dict[str, Any]] = []
    base = {"link": link.as_dict(), "kernels_source": KERNELS_SOURCE, "workload": dataclasses.asdict(work)}
    for sname in scenarios:
        scen = scenario(sname)
        for n in ns:
            rows = []
            for spec in policies:
                pol = parse_policy(spec, n)
                budget = grid_budget(n, min_steps * pol.local_steps, worker_steps * pol.local_steps)
                costs = model_costs(pol, n, work, link, kernels)
                codec = pol.codec.split(":")[0]
                used = (
                    "flatten",
                    "unflatten",
                    f"encode:{codec}",
                    f"decode:{codec}",
                    "apply:none",
                    f"apply:{codec}",
                )
                calibration = {**base, "kernels_s_per_element": {k: kernels[k] for k in dict.fromkeys(used)}}
                t0 = time.perf_counter()
                res = simulate(pol, n, costs, scen, budget, batch=work.batch, seed=seed, window=window)
                st = res.staleness_stats()
                rows.append(
                    {
                        "bench": "simulate",
                        "link": link.name,
                        "scenario": scen.name,
                        "scenario_about": scen.about,
                        "n": n,
                        "policy": spec,
                        "policy_resolved": pol.resolved,
                        "compression": pol.codec,
                        "samples_per_s": res.window_samples_per_s,
                        "samples_per_s_vs_ddp": None,
                        "applied_samples_per_s": res.window_samples_per_s * res.applied_fraction,
                        "makespan_samples_per_s": res.samples_per_s,
                        "compute_bound_samples_per_s": n * work.batch / work.compute_s,
                        "staleness_mean": st["mean"],
                        "staleness_p50": st["p50"],
                        "staleness_p99": st["p99"],
                        "staleness_max": st["max"],
                        "wait_fraction": float(np.mean(res.wait_s)) / res.makespan_s
                        if res.makespan_s
                        else 0.0,
                        "dropped_fraction": 1.0 - res.applied_fraction,
                        "steps_per_worker": {
                            "mean": float(np.mean(res.steps)),
                            "min": int(min(res.steps)),
                            "max": int(max(res.steps)),
                        },
                        "bytes_per_step": costs.bytes_per_step,
                        "budget_steps": budget,
                        "batch": work.batch,
                        "costs": costs.as_dict(),
                        "scenario_params": scen.as_dict(),
                        "calibration": calibration,
                        "seed": seed,
                        "window": window,
                        "sim_s": time.perf_counter() - t0,
                    }
                )
            ddp = next(
                (r for r in rows if r["policy_resolved"] == "ddp" and r["compression"] == "none"), None
            )
            for r in rows:
                if ddp is not None and ddp["samples_per_s"] > 0:
                    r["samples_per_s_vs_ddp"] = r["samples_per_s"] / ddp["samples_per_s"]
            records += rows
            if progress is not None:
                progress(
                    f"{scen.name:>14} n={n:<5} "
                    + "  ".join(f"{r['policy']}={r['samples_per_s']:.0f}" for r in rows)
                    + f"  ({sum(r['sim_s'] for r in rows):.1f} s)"
                )
    return records


# ------------------------------------------------------------------------------------------------
# The check against measured runs (Note [Check])


def load_e2e(paths: Iterable[str]) -> list[dict[str, Any]]:
    """The e2e records of every folder (its e2e.json) or file in ``paths``, each with ``_folder``."""
    out = []
    for p in paths:
        path = Path(p)
        files = [path / "e2e.json"] if path.is_dir() else [path]
        if path.is_dir() and not files[0].exists():
            files = [Path(f) for f in sorted(glob.glob(str(path / "*.json")))]
        for f in files:
            recs = json.loads(f.read_text())
            for r in recs if isinstance(recs, list) else [recs]:
                if isinstance(r, dict) and "samples_per_s" in r:
                    out.append({**r, "_folder": str(path)})
    return out


def _usable(r: Mapping[str, Any]) -> bool:
    return (
        not r.get("skipped")
        and not r.get("error")
        and r.get("kind") in ("ddp", "pyasync")
        and bool(r.get("samples_per_s"))
        and bool(r.get("workers"))
    )


def record_policy(r: Mapping[str, Any]) -> Policy:
    """The model's policy for an e2e record: DDP (its hooks: the bytes come from the record), or the
    pyasync policy with its codec; ``bsp`` on collectives unless it counted bytes received (then the
    point-to-point BSP of the runs before 2026-12-01)."""
    n = int(r["workers"])
    if r["kind"] == "ddp":
        return Policy(r["system"], "ddp", codec="none")
    pol = parse_policy(r["policy"] + ("+" + r["compression"] if r.get("compression") else ""), n)
    if pol.kind == "bsp" and (r.get("mb_received") or 0) > 0:
        pol = dataclasses.replace(pol, kind="bsp:p2p")
    return pol


def check_bytes_per_step(pol: Policy, n: int, params: int, steps: float, buckets: int = 1) -> float | None:
    """Bytes a rank sends per step in an e2e run (pyasync's counters): pushes and replies (point to point:
    pushes and answers, plus the final answers of close() spread over the steps; collectives: the
    reduce-scatter/all-to-all and all-gather, plus close()'s gather of the exact masters). None for DDP
    (the record's own count is used)."""
    m = float(params)
    if pol.kind == "ddp":
        return None
    r = wire_bytes_per_element(pol.codec)
    if pol.kind == "bsp":
        reply_r = r if pol.codec != "none" else 4.0
        return (n - 1) / n * m * (r + reply_r) + (n - 1) / n * m * 4.0 / steps
    push = (n - 1) / n * m * r + (n - 1) * buckets * HEADER_BYTES
    reply = (n - 1) * (m / n * 4.0 + buckets * HEADER_BYTES)
    return push + reply * (steps + 1) / steps


def check_costs(
    r: Mapping[str, Any],
    pol: Policy,
    host_s: float,
    compute_s: float | None,
    bytes_ddp: float | None,
    cores: float,
) -> Costs:
    """The model's costs for one measured run: its injected sleeps, host CPU ``host_s`` per step (split
    into compute and the rest), and its emulated link if any (Note [Check])."""
    n = int(r["workers"])
    device_ms = r.get("device_ms")
    if device_ms:
        device_s, extra_only, host_c = device_ms / 1e3, False, 0.0
    else:
        device_s, extra_only = compute_s or 0.0, True
        host_c = min(host_s, (compute_s or 0.0) * min(1.0, cores / n))
    costs = Costs(device_s, host_c_s=host_c, host_m_s=max(host_s - host_c, 0.0), extra_only=extra_only)
    gbps = r.get("bandwidth_gbps")
    if gbps:
        beta = 8.0 / (gbps * 1e9)
        m = float(r["params"])
        if pol.barrier:
            if pol.kind == "ddp":
                ring = bytes_ddp if bytes_ddp is not None else 2 * (n - 1) / n * m * 4.0
            else:
                ring = (n - 1) / n * m * (wire_bytes_per_element(pol.codec) + 4.0)
            costs = dataclasses.replace(costs, own_link_s=ring * beta)
        else:
            push = (n - 1) / n * m * wire_bytes_per_element(pol.codec) + (n - 1) * HEADER_BYTES
            reply = m / n * 4.0 + HEADER_BYTES
            costs = dataclasses.replace(costs, push_tx_s=push * beta, reply_tx_s=reply * beta)
    return costs


def _scenario_of(r: Mapping[str, Any]) -> Scenario:
    """The model's scenario for an e2e record, from what the record says was injected (``straggler``:
    ``{rank, factor}``, ``transient``: ``{prob, factor}``, ``speeds``)."""

    def pair(v: Any, a: str, b: str) -> tuple[float, float] | None:
        if not v:
            return None
        return (v[a], v[b]) if isinstance(v, Mapping) else (v[0], v[1])

    straggler = pair(r.get("straggler"), "rank", "factor")
    transient = pair(r.get("transient"), "prob", "factor")
    return Scenario(
        r.get("scenario", "?"),
        straggler=(int(straggler[0]), float(straggler[1])) if straggler else None,
        speeds=tuple(float(x) for x in r["speeds"]) if r.get("speeds") else None,
        transient=(float(transient[0]), float(transient[1])) if transient else None,
    )


def _sim_record(
    r: Mapping[str, Any], pol: Policy, costs: Costs, scen: Scenario, cores: float, seed: int, window: int
) -> Result:
    n = int(r["workers"])
    budget = int(r["config"]["budget_steps"])
    batch = int(r["config"]["batch_size"])
    return simulate(pol, n, costs, scen, budget, batch=batch, seed=seed, cores=cores, window=window)


def calibrate_host(
    r: Mapping[str, Any], pol: Policy, compute_s: float | None, cores: float, seed: int, window: int
) -> float:
    """Host CPU seconds per step that make the model's ``equal`` run of ``r`` match its samples/s
    (bisection: the model's samples/s falls as the host work grows)."""
    target = float(r["samples_per_s"])
    n, batch = int(r["workers"]), int(r["config"]["batch_size"])
    equal = Scenario("equal")
    plain = {**r, "bandwidth_gbps": None}

    def sps(host_s: float) -> float:
        costs = check_costs(plain, pol, host_s, compute_s, None, cores)
        return _sim_record(plain, pol, costs, equal, cores, seed, window).samples_per_s

    lo, hi = 0.0, n * batch / target * max(1.0, n / cores)
    while sps(hi) > target:
        hi *= 2
    if sps(lo) <= target:
        return 0.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if sps(mid) > target:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-5 * hi:
            break
    return (lo + hi) / 2


def run_check(
    paths: Sequence[str],
    calibrate: Sequence[str] = (),
    cores: float | None = None,
    seed: int = 0,
    window: int = 2,
    tolerance: float = 0.15,
) -> list[dict[str, Any]]:
    """Predicted against measured samples/s for every usable record in ``paths`` (Note [Check])."""
    checked = [r for r in load_e2e(paths) if _usable(r)]
    pool = checked + [r for r in load_e2e([p for p in calibrate if p not in paths]) if _usable(r)]
    fitted: dict[tuple, tuple[float, Mapping[str, Any]]] = {}
    out = []

    def key(r: Mapping[str, Any]) -> tuple:
        return (r.get("model"), r["system"], int(r["workers"]), r.get("device_ms"))

    def source(r: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """The equal, unthrottled run of the same system: this folder's first, then any other's."""
        cands = [
            c
            for c in pool
            if key(c) == key(r) and c.get("scenario") == "equal" and not c.get("bandwidth_gbps")
        ]
        same = [c for c in cands if c["_folder"] == r["_folder"]]
        return (same or cands or [None])[0]

    def compute_of(r: Mapping[str, Any], src: Mapping[str, Any]) -> float | None:
        for c in (
            r,
            src,
            *[c for c in pool if c.get("model") == r.get("model") and c["_folder"] == r["_folder"]],
        ):
            if c.get("compute_s"):
                return float(c["compute_s"])
        for c in pool:
            if c.get("model") == r.get("model") and c.get("compute_s"):
                return float(c["compute_s"])
        return None

    for r in checked:
        src = source(r)
        n = int(r["workers"])
        core_count = (
            cores or (r.get("machine") or {}).get("cpu_affinity") or (r.get("machine") or {}).get("cpu_count")
        )
        row: dict[str, Any] = {
            "bench": "simulate-check",
            "folder": r["_folder"],
            "model": r.get("model"),
            "scenario": r.get("scenario"),
            "system": r["system"],
            "workers": n,
            "cores": core_count,
            "device_ms": r.get("device_ms"),
            "bandwidth_gbps": r.get("bandwidth_gbps"),
            "measured_samples_per_s": r["samples_per_s"],
        }
        if src is None or not core_count:
            out.append({**row, "role": "skipped", "note": "no equal, unthrottled run of this system to fit"})
            continue
        pol = record_policy(r)
        compute_s = compute_of(r, src)
        fkey = (src["_folder"], *key(src))
        if fkey not in fitted:
            fitted[fkey] = (calibrate_host(src, pol, compute_s, float(core_count), seed, window), src)
        host_s, _ = fitted[fkey]
        steps = sum(r["steps_per_rank"]) / n if r.get("steps_per_rank") else r["config"]["budget_steps"] / n
        bytes_model = check_bytes_per_step(pol, n, int(r["params"]), steps)
        bytes_ddp = src.get("bytes_per_step") if pol.kind == "ddp" else None
        costs = check_costs(r, pol, host_s, compute_s, bytes_ddp, float(core_count))
        res = _sim_record(r, pol, costs, _scenario_of(r), float(core_count), seed, window)
        st = res.staleness_stats()
        role = "fit" if r is src else "predict"
        err = res.samples_per_s / r["samples_per_s"] - 1.0
        row.update(
            {
                "role": role,
                "calibrated_from": f"{src['_folder']} ({src.get('scenario')})",
                "policy_model": pol.kind,
                "compression": pol.codec,
                "host_cpu_ms": host_s * 1e3,
                "host_compute_ms": costs.host_c_s * 1e3,
                "compute_s": compute_s,
                "predicted_samples_per_s": res.samples_per_s,
                "error": err,
                "within_tolerance": abs(err) <= tolerance,
                "tolerance": tolerance,
                "measured_vs_ddp": r.get("samples_per_s_vs_ddp"),
                "measured_bytes_per_step": r.get("bytes_per_step"),
                "predicted_bytes_per_step": bytes_model if bytes_model is not None else bytes_ddp,
                "bytes_source": "model" if bytes_model is not None else "the fitted run's count",
                "measured_staleness_p50": r.get("staleness_p50"),
                "measured_staleness_p99": r.get("staleness_p99"),
                "predicted_staleness_p50": st["p50"] if pol.kind != "ddp" else None,
                "predicted_staleness_p99": st["p99"] if pol.kind != "ddp" else None,
                "measured_dropped": r.get("pushes_dropped"),
                "predicted_dropped_fraction": 1.0 - res.applied_fraction,
                "costs": costs.as_dict(),
                "seed": seed,
                "window": window,
            }
        )
        if row["measured_bytes_per_step"] and row["predicted_bytes_per_step"]:
            row["bytes_error"] = row["predicted_bytes_per_step"] / row["measured_bytes_per_step"] - 1.0
        out.append(row)
    # predicted ratios to DDP, within each (folder, model, scenario, bandwidth)
    for row in out:
        ddp = next(
            (
                o
                for o in out
                if o["system"] == "ddp"
                and o.get("predicted_samples_per_s")
                and (o["folder"], o["model"], o["scenario"], o["bandwidth_gbps"])
                == (row["folder"], row["model"], row["scenario"], row["bandwidth_gbps"])
            ),
            None,
        )
        if ddp is not None and row.get("predicted_samples_per_s"):
            row["predicted_vs_ddp"] = row["predicted_samples_per_s"] / ddp["predicted_samples_per_s"]
    return out


def check_summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """How many predictions are within the tolerance, and the error figures."""
    pred = [r for r in rows if r.get("role") == "predict"]
    errs = [abs(r["error"]) for r in pred]
    return {
        "predictions": len(pred),
        "within_tolerance": sum(1 for r in pred if r["within_tolerance"]),
        "fits": sum(1 for r in rows if r.get("role") == "fit"),
        "skipped": sum(1 for r in rows if r.get("role") == "skipped"),
        "median_abs_error": float(np.median(errs)) if errs else None,
        "max_abs_error": max(errs) if errs else None,
    }


# ------------------------------------------------------------------------------------------------
# Plots

_COLORS = {
    "ddp": "black", "bsp": "tab:blue", "ssp": "tab:orange", "asp": "tab:green", "quorum": "tab:red",
    "local": "tab:purple",
}  # fmt: skip


def plot_grid(records: Sequence[Mapping[str, Any]], out_dir: str) -> list[str]:
    """One PNG per (link, scenario): samples/s against n per policy (log-log), and the ratio to DDP."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for link in dict.fromkeys(r["link"] for r in records):
        for scen in dict.fromkeys(r["scenario"] for r in records if r["link"] == link):
            mine = [r for r in records if r["link"] == link and r["scenario"] == scen]
            fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
            styles = ["-", "--", ":", "-."]
            seen: dict[str, int] = {}
            for pol in dict.fromkeys(r["policy"] for r in mine):
                rs = sorted((r for r in mine if r["policy"] == pol), key=lambda r: r["n"])
                fam = rs[0]["policy_resolved"].split(":")[0]
                ls = styles[seen.get(fam, 0) % len(styles)]
                seen[fam] = seen.get(fam, 0) + 1
                kw = {"color": _COLORS.get(fam, "tab:gray"), "linestyle": ls, "marker": "o", "ms": 3}
                ns = [r["n"] for r in rs]
                ax1.plot(ns, [r["samples_per_s"] for r in rs], label=pol, **kw)
                if all(r["samples_per_s_vs_ddp"] is not None for r in rs):
                    ax2.plot(ns, [r["samples_per_s_vs_ddp"] for r in rs], label=pol, **kw)
            ns = sorted({r["n"] for r in mine})
            per_worker = mine[0]["compute_bound_samples_per_s"] / mine[0]["n"]
            ax1.plot(ns, [per_worker * x for x in ns], color="gray", linewidth=0.8, label="n x batch / c")
            for ax in (ax1, ax2):
                ax.set_xscale("log", base=2)
                ax.set_xlabel("workers n")
                ax.grid(True, which="both", alpha=0.3)
            ax1.set_yscale("log")
            ax1.set_ylabel("samples/s")
            ax2.set_ylabel("samples/s vs DDP")
            ax2.axhline(1.0, color="black", linewidth=0.8)
            ax1.legend(fontsize=7, ncol=2)
            fig.suptitle(f"scale model: {scen} ({mine[0]['scenario_about']}), link {link}", fontsize=10)
            fig.tight_layout()
            path = os.path.join(out_dir, f"simulate_{link}_{scen.replace(':', '_')}.png")
            fig.savefig(path, dpi=80)
            plt.close(fig)
            paths.append(path)
    return paths


# ------------------------------------------------------------------------------------------------
# Command line


def _link_from_args(args: argparse.Namespace) -> Link:
    link = LINKS[args.link]
    changes: dict[str, Any] = {}
    if args.bandwidth_gbps is not None:
        changes["beta_s_per_byte"] = 8.0 / (args.bandwidth_gbps * 1e9)
    if args.latency_us is not None:
        changes["latency_s"] = args.latency_us * 1e-6
    if args.msg_us is not None:
        changes["alpha_s"] = changes["alpha_p2p_s"] = args.msg_us * 1e-6
    if changes:
        desc = ", ".join(f"{k}={v:g}" for k, v in changes.items())
        link = dataclasses.replace(
            link, name=f"{link.name}*", source=f"{link.source}; overridden: {desc}", **changes
        )
    return link


def _positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        v = kind(text)
        if not v > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return v

    return parse


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON output path of the grid")
    ap.add_argument("--plot", metavar="DIR", help="write the grid's PNGs (samples/s against n) into DIR")
    ap.add_argument("--n", default="8,16,32,64,128,256,512,1024", help="worker counts")
    add_systems_option(ap, "--policies", default="ddp,bsp,ssp:1,ssp:3,asp,quorum:n-1",
                       help="ddp, ddp+fp16, bsp, bsp:p2p, ssp:S, asp, quorum:K (K may be n-J), local:H, "
                       "local:H:quorum:K, local:H:async, each +CODEC")  # fmt: skip
    ap.add_argument("--scenarios", default="one-slow,lognormal:0.3,lognormal:0.6,pauses")
    ap.add_argument("--link", default="loopback", choices=sorted(LINKS))
    ap.add_argument("--bandwidth-gbps", type=_positive(float), help="override the link's bandwidth")
    ap.add_argument("--latency-us", type=float, help="override the link's latency per hop")
    ap.add_argument(
        "--msg-us", type=float, help="override the per-message cost (collectives and point to point)"
    )
    ap.add_argument("--params", type=_positive(int), default=Workload.params, help="model elements (fp32)")
    ap.add_argument(
        "--batch", type=_positive(int), default=Workload.batch, help="samples per step per worker"
    )
    ap.add_argument(
        "--compute-ms", type=_positive(float), default=Workload.compute_s * 1e3, help="c per step"
    )
    ap.add_argument("--buckets", type=_positive(int), default=Workload.buckets, help="pyasync's buckets")
    ap.add_argument("--ddp-buckets", type=_positive(int), default=Workload.ddp_buckets)
    ap.add_argument(
        "--overlap",
        type=float,
        default=0.0,
        help="DDP/BSP: fraction of the collective hidden behind backward",
    )
    ap.add_argument(
        "--steps", type=_positive(int), default=24, help="grid: at least this many steps per worker"
    )
    ap.add_argument(
        "--worker-steps", type=_positive(int), default=3072, help="grid: at least this many in all"
    )
    ap.add_argument(
        "--window", type=_positive(int), default=2, help="pushes in flight per worker (send frames)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", nargs="+", metavar="PATH", help="e2e result folders (or files) to check")
    ap.add_argument("--calibrate", nargs="+", default=[], metavar="PATH", help="more folders to fit from")
    ap.add_argument("--check-out", metavar="PATH", help="JSON output path of the check")
    ap.add_argument(
        "--cores", type=_positive(float), help="check: cores shared (default: the record's machine)"
    )
    ap.add_argument("--tolerance", type=_positive(float), default=0.15, help="check: relative error judged")
    args = ap.parse_args(argv)
    machine, cmd = common.machine_info("cpu"), common.command_line()
    if args.check:
        for p in args.check + args.calibrate:
            if not Path(p).exists():
                ap.error(f"--check/--calibrate: {p} does not exist")
        rows = run_check(args.check, args.calibrate, args.cores, args.seed, args.window, args.tolerance)
        for row in rows:
            row["machine"], row["command"] = machine, cmd
            row["calibration_note"] = "host CPU per step fitted to the equal run named in calibrated_from"
        printable = [
            {**r, "folder": Path(r["folder"]).name, "err%": None if "error" not in r else 100 * r["error"]}
            for r in rows
        ]
        print(
            common.format_table(
                printable,
                [
                    ("folder", "folder"),
                    ("scenario", "scenario"),
                    ("system", "system"),
                    ("role", "role"),
                    ("host_cpu_ms", "W ms"),
                    ("measured_samples_per_s", "measured"),
                    ("predicted_samples_per_s", "predicted"),
                    ("err%", "err %"),
                    ("within_tolerance", "ok"),
                    ("bytes_error", "bytes err"),
                    ("measured_staleness_p50", "stale p50 m"),
                    ("predicted_staleness_p50", "p50 pred"),
                ],
            )
        )
        summ = check_summary(rows)
        print(
            f"\n{summ['within_tolerance']} of {summ['predictions']} predictions within "
            f"{100 * args.tolerance:g}% (median |error| {100 * (summ['median_abs_error'] or 0):.1f}%, "
            f"max {100 * (summ['max_abs_error'] or 0):.1f}%); {summ['fits']} fits, {summ['skipped']} skipped"
        )
        common.write_results(args.check_out, rows)
        if not args.out and not args.plot:
            return 0
    try:
        ns = [int(x) for x in args.n.split(",") if x.strip()]
        policies = split_systems(args.systems)
        scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
        for n in ns:
            if n < 2:
                raise ValueError(f"--n: every worker count must be >= 2, got {n}")
            for p in policies:
                parse_policy(p, n)
        for s in scenarios:
            scenario(s)
    except ValueError as e:
        ap.error(str(e))
    if not ns or not policies or not scenarios:
        ap.error("--n, --systems and --scenarios need at least one entry each")
    if not 0.0 <= args.overlap <= 1.0:
        ap.error(f"--overlap must be in [0, 1], got {args.overlap}")
    work = Workload(
        args.params, args.batch, args.compute_ms / 1e3, args.buckets, args.ddp_buckets, args.overlap
    )
    link = _link_from_args(args)
    t0 = time.perf_counter()
    records = run_grid(
        ns, policies, scenarios, link, work, KERNELS, args.seed, args.steps, args.worker_steps, args.window,
        progress=lambda line: print(line, flush=True),
    )  # fmt: skip
    for r in records:
        r["machine"], r["command"] = machine, cmd
    print(f"grid: {len(records)} runs in {time.perf_counter() - t0:.1f} s (link {link.name})\n")
    print(
        common.format_table(
            records,
            [
                ("scenario", "scenario"),
                ("n", "n"),
                ("policy", "policy"),
                ("samples_per_s", "samples/s"),
                ("samples_per_s_vs_ddp", "x DDP"),
                ("staleness_mean", "stale mean"),
                ("staleness_p99", "p99"),
                ("wait_fraction", "wait"),
                ("dropped_fraction", "dropped"),
            ],
        )
    )
    common.write_results(args.out, records)
    if args.plot:
        for path in plot_grid(records, args.plot):
            print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
