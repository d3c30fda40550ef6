"""A small spawn helper for multi-process gloo tests (CPU).

    results = run_workers(my_worker, world_size=3, args=(cfg,))   # my_worker(rank, world_size, *args)

Each worker runs in a fresh process (torch.multiprocessing "spawn"), with torch.distributed initialised
on gloo over a free localhost port, torch and the pyasync kernels limited to one thread, and returns a
picklable value. The helper waits at most ``timeout`` seconds in all; on a failure or a timeout it
kills the remaining workers it started and fails with every rank's traceback, or, for a rank that never
reported, the time it was stopped after and its threads' stacks (dumped to the captured stderr first).
Worker functions must live at module level of an importable test module.
"""

from __future__ import annotations

import datetime
import faulthandler
import io
import os
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

__all__ = ["free_port", "multiproc", "run_with_replacements", "run_workers", "world_size"]

multiproc = pytest.mark.multiproc


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    fn: Callable,
    rank: int,
    world: int,
    port: int,
    args: Sequence,
    results,
    pg_timeout: float,
    external_store: bool = False,
    join: bool = False,
    report_as: int | None = None,
) -> None:
    os.environ["PYASYNC_NUM_THREADS"] = "1"
    os.environ["OMP_NUM_THREADS"] = "1"
    # the parent asks a rank that never reported where it is stuck before it kills it (_stop)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        torch.set_num_threads(1)
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=pg_timeout)
        if join:  # a joiner: a default group of its own on the job's store (Note [Joining a running job])
            os.environ["PYASYNC_JOIN"] = "1"
            store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timeout)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timeout)
        elif external_store:  # the parent hosts the store: any rank may die
            store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timeout)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        else:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world,
                timeout=timeout,
            )
        try:
            out = fn(rank, world, *args)
        finally:
            # No barrier here: a failed rank must not hang the others; the parent reports it.
            dist.destroy_process_group()
        buf = io.BytesIO()  # bytes, not tensors: shared-memory tensors die with the worker process
        torch.save(out, buf)
        results.put((rank if report_as is None else report_as, "ok", buf.getvalue()))
    except BaseException:
        results.put((rank if report_as is None else report_as, "error", traceback.format_exc()))


def _stop(procs, quiet) -> None:
    """Kill the processes still running; those not in quiet (ranks that reported, or may die) first
    print every thread's stack to stderr (the test's captured output), so that a hang names the wait
    that did not end."""
    stuck = [p for i, p in procs if i not in quiet and p.is_alive()]
    for p in stuck:
        os.kill(p.pid, signal.SIGUSR1)
    end = time.monotonic() + 2  # faulthandler writes from a signal handler: a moment is enough
    for p in stuck:
        p.join(max(0.0, end - time.monotonic()))
    for _, p in procs:
        if p.is_alive():
            p.kill()
    for _, p in procs:
        p.join(5)


def run_workers(
    fn: Callable,
    world_size: int,
    args: Sequence = (),
    timeout: float = 60.0,
    may_die: Sequence[int] = (),
    exitcodes: list | None = None,
    external_store: bool = False,
) -> list[Any]:
    """Run fn(rank, world_size, *args) on world_size spawned ranks; their return values by rank.

    may_die: ranks allowed to end without a result (e.g. killed on purpose); their value is None.
    exitcodes: a list to fill with every rank's exit code once the ranks have ended (0: a normal exit;
    negative: the signal that ended it, e.g. -6 for SIGABRT).
    external_store: this (parent) process hosts the job's TCPStore, so that no rank's death takes it
    down (as torchrun's agent hosts it)."""
    may_die = set(may_die)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    store = None
    if external_store:
        import torch.distributed as dist

        store = dist.TCPStore(
            "127.0.0.1",
            port,
            world_size,
            True,
            timeout=datetime.timedelta(seconds=timeout),
            wait_for_workers=False,
        )
    procs = [
        ctx.Process(
            target=_entry,
            args=(fn, r, world_size, port, tuple(args), results, timeout, external_store),
            name=f"rank{r}",
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[str, Any]] = {}
    start = time.monotonic()
    deadline = start + timeout

    def settled() -> bool:
        return all(i in got or (i in may_die and not p.is_alive()) for i, p in enumerate(procs))

    try:
        while not settled():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                if any(
                    not p.is_alive() and p.exitcode not in (0, None) and i not in got and i not in may_die
                    for i, p in enumerate(procs)
                ):
                    time.sleep(0.2)  # let a dying rank's report reach the queue
                    while True:
                        try:
                            rank, status, value = results.get_nowait()
                            got[rank] = (status, value)
                        except queue.Empty:
                            break
                    break
                continue
            got[rank] = (status, value)
            if status == "error":
                # Give the others a moment to report their own view of the failure, then stop.
                end = time.monotonic() + min(10.0, max(0.0, deadline - time.monotonic()))
                while len(got) < world_size and time.monotonic() < end:
                    try:
                        r2, s2, v2 = results.get(timeout=0.5)
                        got[r2] = (s2, v2)
                    except queue.Empty:
                        pass
                break
    finally:
        for i, p in enumerate(procs):
            if i in got:
                p.join(10)  # a rank that reported exits by itself: let it, to see how it exits
        stopped_after = time.monotonic() - start
        _stop(list(enumerate(procs)), set(got) | may_die)
        if exitcodes is not None:
            exitcodes[:] = [p.exitcode for p in procs]
        del store  # a store hosted here lives until every rank has ended
    if settled() and all(s == "ok" for s, _ in got.values()):
        return [
            torch.load(io.BytesIO(got[r][1]), weights_only=False) if r in got else None
            for r in range(world_size)
        ]
    report = []
    for r, p in enumerate(procs):
        if r in got and got[r][0] == "error":
            report.append(f"--- rank {r} failed:\n{got[r][1]}")
        elif r in got:
            report.append(f"--- rank {r} finished")
        else:
            report.append(
                f"--- rank {r} had not reported when the run was stopped after {stopped_after:.0f} s "
                f"(limit {timeout:g} s; exit code {p.exitcode}; its stacks, if it was stuck, are in the "
                "captured stderr)"
            )
    pytest.fail(f"{fn.__name__} on {world_size} ranks failed:\n" + "\n".join(report), pytrace=False)


@pytest.fixture(params=[2, 3], ids=lambda n: f"n{n}")
def world_size(request) -> int:
    """2 and 3 ranks (3 is not a power of two: uneven shards)."""
    return request.param


#: Where the job's record (pyasync/session/joining.py's JOB_KEY) lies in the raw store: under the default
#: group's prefix (the workers pass this store to init_process_group), as torch.distributed writes it.
JOB_RECORD = "0//pyasync/elastic/job"


def run_with_replacements(
    fn: Callable,
    world_size: int,
    replacements: int,
    args: Sequence = (),
    timeout: float = 120.0,
    joiners: int = 0,
) -> tuple[list[Any], list[Any]]:
    """Run fn(rank, world_size, None, *args) on world_size ranks over a store hosted here, and ``joiners``
    workers that join the job from the start; each time a process ends without a result (it was killed),
    start a replacement, at most ``replacements`` times. A joiner or replacement runs fn(0, world_size, k,
    *args) (k: its number) and joins the running job (PYASYNC_JOIN=1, its own one-rank default group on
    the job's store). Returns (the ranks' results, the joiners' and replacements' results); None for a
    process that died. Every wait is bounded by ``timeout``."""
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    limit = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore("127.0.0.1", port, world_size, True, timeout=limit, wait_for_workers=False)
    procs: dict[int, Any] = {}  # id -> process; ranks 0..world-1, replacements world + k

    def start(i: int) -> None:
        k = None if i < world_size else i - world_size
        rank = i if k is None else 0
        procs[i] = ctx.Process(
            target=_entry,
            args=(fn, rank, world_size, port, (k, *args), results, timeout, True, k is not None, i),
            name=f"worker{i}",
            daemon=True,
        )
        procs[i].start()

    for r in range(world_size):
        start(r)
    if joiners:  # a joiner's own one-rank default group must not meet the job's while that one forms
        end = time.monotonic() + timeout
        while not store.check([JOB_RECORD]) and time.monotonic() < end:
            store.wait([JOB_RECORD], datetime.timedelta(seconds=timeout))
        for r in range(world_size, world_size + joiners):
            start(r)
    got: dict[int, tuple[str, Any]] = {}
    replaced: set[int] = set()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                i, status, value = results.get(timeout=0.2)
                got[i] = (status, value)
            except queue.Empty:
                pass
            for i, p in list(procs.items()):
                if not p.is_alive() and i not in got and i not in replaced and p.exitcode != 0:
                    replaced.add(i)
                    if len(procs) - world_size - joiners < replacements:
                        start(len(procs))
            if all(i in got or (i in replaced and not p.is_alive()) for i, p in procs.items()):
                break
    finally:
        for p in procs.values():
            p.join(max(0.0, min(10.0, deadline - time.monotonic())))
        _stop(list(procs.items()), got)
        del store
    failed = [f"--- worker {i} failed:\n{v}" for i, (s_, v) in got.items() if s_ == "error"]
    missing = [i for i in procs if i not in got and i not in replaced]
    if failed or missing:
        pytest.fail(
            f"{fn.__name__}: " + "\n".join(failed + [f"--- worker {i} did not finish" for i in missing]),
            pytrace=False,
        )

    def value(i):
        return torch.load(io.BytesIO(got[i][1]), weights_only=False) if i in got else None

    return [value(i) for i in range(world_size)], [value(i) for i in sorted(procs) if i >= world_size]
