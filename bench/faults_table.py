"""What each rank sees when another rank fails, and how long until it sees it.

    python bench/faults_table.py                        # 4 ranks, 3 runs of every fault, timeout 5 s
    python bench/faults_table.py --runs 5 --out bench/results/faults_cpu.json
    python bench/faults_table.py --faults kill-bsp,stop-bsp --world 3

Every run spawns ``--world`` ranks (gloo over loopback, a TCPStore served by this process, one torch
thread each) that train a small model with ``DistributedOptimizer(timeout=--timeout)``. One rank (the
victim, rank 1) causes the fault at step 3; it writes the wall-clock time of the fault into shared
memory just before it happens. Every other rank records the first exception it gets, from which call,
and the wall-clock time; the figure is "seconds from the fault to the exception", median (and range)
over every rank that saw one, in every run. The ranks do what a user would: a rank that gets an
exception calls close() at once (nothing coordinates them), so what they see includes one rank's
close() being mistaken for a death by another (see docs/reliability.md).

Faults (``--faults``, comma-separated names):

=================  =======================================================================================
kill-<policy>      SIGKILL of the victim just before its step() (bsp, bsp-p2p, ssp1, asp, quorum = n-1)
kill-barrier       SIGKILL while the others are in opt.barrier() (BSP)
kill-save          SIGKILL inside save_checkpoint, writing its file (BSP)
stop-bsp           SIGSTOP of the victim before its step() (BSP); the others' step() fails
stop-bsp-p2p       the same under bsp:p2p: the others' step() times out
stop-asp           SIGSTOP (ASP): the others take 50 steps, then close(); measured from close()'s start
late               the victim reaches the constructor only after the others gave up (timeout)
dead-before        SIGKILL of the victim before the constructor
                   (late, dead-before: measured from each rank's entry into the constructor)
corrupt            the victim sends rank 0 a message with a corrupt header (codec 7), then trains on (ASP)
exit               the victim returns from its worker function without close() (ASP)
=================  =======================================================================================

The tests that check what is promised are tests/faults/test_failures.py and
tests/faults/test_failures_stalls.py; this script only measures.
"""

from __future__ import annotations

import argparse
import datetime
import io
import os
import queue
import secrets
import signal
import statistics
import sys
import time
import traceback
from typing import Any

import _path  # noqa: F401  (first: sys.path, see bench/_path.py)
import common
import torch
import torch.distributed as dist
from harness.launch import spawn_ranks, start_store

FAULT_AT = 3  # the step at which the victim causes the fault
VICTIM = 1
MAX_STEPS = 2000  # ranks that never wait (ASP) step at most this many times looking for the failure
ASP_STEPS = 50  # steps the others take while the victim is stopped (stop-asp)
POLICIES = {"bsp": "bsp", "bsp-p2p": "bsp:p2p", "ssp1": "ssp:1", "asp": "asp", "quorum": "quorum"}
FAULTS = [f"kill-{p}" for p in POLICIES] + [
    "kill-barrier", "kill-save", "stop-bsp", "stop-bsp-p2p", "stop-asp", "late", "dead-before", "corrupt",
    "exit",
]


# -- the ranks ------------------------------------------------------------------------------------------


def _model_and_opt(policy: str, world: int, timeout_s: float):
    import pyasync

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    spec = f"quorum:{world - 1}" if policy == "quorum" else policy
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), policy=spec, bucket_cap_mb=200 / 2**20,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return model, opt


def _step(model, opt, rank: int, t: int) -> None:
    g = torch.Generator().manual_seed(1000 * rank + t)
    opt.zero_grad()
    model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
    opt.step()


def _gist(e: BaseException) -> str:
    """The exception's type and message, shortened to what a table cell can hold."""
    msg = str(e).replace("\n", " ")
    for prefix in ("pyasync engine failed: ", "owner receiver thread: ", "worker reply receiver thread: ",
                   "push thread: ", "pyasync: "):
        msg = msg.replace(prefix, "")
    return f"{type(e).__name__}: {msg[:150]}"


def _record(out: dict, call: str, e: BaseException, ranks_of: BaseException | None = None) -> None:
    """The first exception a rank got: when, from which call, what, naming which ranks."""
    if "t_exc" in out:
        return
    src = e if ranks_of is None else ranks_of
    out.update(t_exc=time.time(), call=call, sees=_gist(e), ranks=list(getattr(src, "ranks", ()) or ()))


def _mark(shared) -> None:
    shared["t_fault"].value = time.time()


def _victim(fault: str, rank: int, world: int, model, opt, shared, out: dict) -> None:
    """The victim's part once it reached step FAULT_AT (constructed, FAULT_AT steps done)."""
    if fault.startswith("kill-") and fault not in ("kill-barrier", "kill-save"):
        _mark(shared)
        os.kill(os.getpid(), signal.SIGKILL)
    if "t_exc" in out:
        pass
    elif fault == "kill-barrier":
        shared["ready"].wait(60)
        _mark(shared)
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "kill-save":
        import pyasync
        import pyasync.checkpoint.save as save_mod

        def die(*a, **k):
            _mark(shared)
            os.kill(os.getpid(), signal.SIGKILL)

        save_mod.atomic_write = die
        pyasync.save_checkpoint(shared["dir"], opt)
    if fault.startswith("stop-"):
        shared["pid"].value = os.getpid()
        _mark(shared)
        os.kill(os.getpid(), signal.SIGSTOP)
    if fault == "corrupt":
        from pyasync.engine import wire

        head = wire.Header(kind=wire.PUSH, sender=rank, clock=0, version=0, bucket=0, shard=0, codec=7,
                           numel=4, nbytes=16)
        bad = wire.encode_header(head)
        _mark(shared)
        opt.engine.transport.send(bad.view(torch.uint8), 0, "push")
        _train_until_failure(model, opt, rank, FAULT_AT, out)
    if fault == "exit":
        _mark(shared)
        # returns without close(): the optimizer is freed with this frame (its finalizer aborts it)


def _train_until_failure(model, opt, rank: int, t0: int, out: dict) -> None:
    """Step until a call raises (at most MAX_STEPS), then close(); record the first exception."""
    call = "step"
    try:
        for t in range(t0, MAX_STEPS):
            _step(model, opt, rank, t)
        call = "close"
        opt.close()
    except Exception as e:
        _record(out, call, e)
    try:
        opt.close()
    except Exception as e:
        out.setdefault("close", _gist(e))


def fault_worker(rank: int, world: int, fault: str, timeout_s: float, shared) -> dict[str, Any]:
    out: dict[str, Any] = {"rank": rank, "victim": rank == VICTIM}
    victim = rank == VICTIM
    if fault in ("late", "dead-before"):
        if victim and fault == "dead-before":
            _mark(shared)
            os.kill(os.getpid(), signal.SIGKILL)
        if victim:
            shared["gave_up"].wait(600)  # late: it arrives once every other rank has given up
        # Before the clock starts: importing pyasync, and torch's own first optimizer (it imports
        # torch._dynamo), take seconds.
        import pyasync

        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        t0 = time.time()
        try:
            _, opt = _model_and_opt("bsp", world, timeout_s)
            opt.close()
        except Exception as e:
            _record(out, "constructor", e)
            out["t_entry"] = t0  # the rank was missing from the start: measured from this rank's entry
        if fault == "late" and not victim:
            shared["gave_up"].wait(600)
            shared["done"].wait(600)  # stay until the late rank has its answer
        elif fault == "late":
            shared["done"].set()
        return out

    policy = POLICIES.get(fault[5:], "asp" if fault in ("stop-asp", "corrupt", "exit") else "bsp")
    model, opt = _model_and_opt(policy, world, timeout_s)
    try:
        for t in range(FAULT_AT):
            _step(model, opt, rank, t)
    except Exception as e:  # the victim left early (ASP: it may be ahead)
        _record(out, "step", e)
    if victim:
        _victim(fault, rank, world, model, opt, shared, out)  # a stopped victim is killed, never returns
        return out
    if "t_exc" in out:  # seen in the first steps already
        pass
    elif fault == "kill-barrier":
        shared["ready"].wait(60)
        try:
            opt.barrier()
        except Exception as e:
            _record(out, "barrier", e)
    elif fault == "kill-save":
        import pyasync

        try:
            pyasync.save_checkpoint(shared["dir"], opt)
        except Exception as e:
            _record(out, "save_checkpoint", e, ranks_of=e.__cause__)
    elif fault == "stop-asp":
        while shared["pid"].value == 0:
            time.sleep(0.01)
        for t in range(FAULT_AT, FAULT_AT + ASP_STEPS):
            _step(model, opt, rank, t)
        out["steps_while_stopped"] = ASP_STEPS
        t_close = time.time()
        try:
            opt.close()
        except Exception as e:
            _record(out, "close", e)
            out["t_entry"] = t_close
        shared["timed_out"].wait(600)
        if rank == 0:
            os.kill(shared["pid"].value, signal.SIGKILL)
        return out
    if "t_exc" not in out:
        _train_until_failure(model, opt, rank, FAULT_AT, out)
    if fault in ("stop-bsp", "stop-bsp-p2p"):
        shared["timed_out"].wait(600)
        if rank == 0:
            os.kill(shared["pid"].value, signal.SIGKILL)
    try:
        opt.close()
    except Exception as e:
        out.setdefault("close", _gist(e))
    return out


# -- harness ----------------------------------------------------------------------------------------------


def _entry(rank: int, world: int, port: int, prefix: str, fault: str, timeout_s: float, shared,
           results) -> None:
    os.environ["PYASYNC_NUM_THREADS"] = "1"
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=600))
        dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=600))
        out = fault_worker(rank, world, fault, timeout_s, shared)
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_once(fault: str, world: int, timeout_s: float, run_timeout_s: float, tmp: str) -> dict[str, Any]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    store = start_store(600.0)
    survivors = world - 1
    shared = {
        "t_fault": ctx.Value("d", 0.0),
        "pid": ctx.Value("i", 0),
        "ready": ctx.Barrier(world),
        "timed_out": ctx.Barrier(survivors),
        "gave_up": ctx.Barrier(world),
        "done": ctx.Event(),
        "dir": tmp,
    }
    results = ctx.Queue()
    prefix = f"faults-{secrets.token_hex(4)}/"
    entry_args = (world, store.port, prefix, fault, timeout_s, shared, results)
    procs = spawn_ranks(_entry, world, entry_args, name="faults_table", daemon=True, ctx=ctx)
    got: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + run_timeout_s
    try:
        while time.monotonic() < deadline:
            if all(r in got or (r == VICTIM and not procs[r].is_alive()) for r in range(world)):
                break
            try:
                rank, status, value = results.get(timeout=0.5)
                got[rank] = (status, value)
            except queue.Empty:
                pass
        for r in got:  # a rank that reported exits by itself: let it, to see how it exits
            procs[r].join(10)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(10)
    errors = {r: v for r, (s, v) in got.items() if s != "ok"}
    ranks = {r: torch.load(io.BytesIO(v), weights_only=False) for r, (s, v) in got.items() if s == "ok"}
    return {
        "fault": fault,
        "t_fault": shared["t_fault"].value,
        "ranks": ranks,
        "errors": errors,
        "missing": [r for r in range(world) if r not in got and r != VICTIM],
        "exitcodes": [p.exitcode for p in procs],
    }


def summarize(fault: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One table row: what the other ranks and the victim saw, and the seconds until they saw it."""
    delays, sees, victim_sees, victim_delays = [], {}, {}, []
    for run in runs:
        for rec in run["ranks"].values():
            if "t_exc" not in rec:
                continue
            start = rec.get("t_entry", run["t_fault"])
            what = f"{rec['call']}: {rec['sees']}"
            if rec["victim"]:
                victim_sees[what] = victim_sees.get(what, 0) + 1
                victim_delays.append(rec["t_exc"] - start)
            else:
                sees[what] = sees.get(what, 0) + 1
                delays.append(rec["t_exc"] - start)
    unaffected = sum(1 for run in runs for rec in run["ranks"].values()
                     if not rec["victim"] and "t_exc" not in rec)
    return {
        "fault": fault,
        "runs": len(runs),
        "seen_by": len(delays),
        "unaffected": unaffected,
        "median_s": statistics.median(delays) if delays else None,
        "min_s": min(delays) if delays else None,
        "max_s": max(delays) if delays else None,
        "sees": sees,
        "victim_sees": victim_sees,
        "victim_median_s": statistics.median(victim_delays) if victim_delays else None,
        "exitcodes": [run["exitcodes"] for run in runs],
        "errors": [run["errors"] for run in runs if run["errors"]],
        "missing": [run["missing"] for run in runs if run["missing"]],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=5.0, help="the optimizer's timeout, seconds")
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    bad = [f for f in faults if f not in FAULTS]
    if bad:
        ap.error(f"unknown faults {bad}; known: {FAULTS}")
    import tempfile

    rows = []
    for fault in faults:
        runs = []
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as tmp:
                runs.append(run_once(fault, args.world, args.timeout, 120 + 10 * args.timeout, tmp))
        row = summarize(fault, runs)
        rows.append(row)
        print(f"{fault}: {row['seen_by']} saw it, median {common._fmt(row['median_s'])} s "
              f"[{common._fmt(row['min_s'])}, {common._fmt(row['max_s'])}]; exit codes {row['exitcodes']}")
        for what, n in sorted(row["sees"].items(), key=lambda kv: -kv[1]):
            print(f"    {n:3d} x {what}")
        for what, n in row["victim_sees"].items():
            print(f"    victim {n} x {what}")
        for err in row["errors"]:
            print(f"    worker errors: {err}")
    record = {
        "bench": "faults_table",
        "machine": common.machine_info(),
        "command": common.command_line(),
        "loadavg": common.loadavg(),
        "config": {"world": args.world, "runs": args.runs, "timeout_s": args.timeout, "victim": VICTIM,
                   "fault_at_step": FAULT_AT},
        "rows": rows,
    }
    common.write_results(args.out, [record])
    return 0


if __name__ == "__main__":
    sys.exit(main())
