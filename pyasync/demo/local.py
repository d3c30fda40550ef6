"""Local runs: one system trained by spawned worker processes on this machine, gloo over loopback.

Note [Worker process trees]
    A worker may start processes of its own (hivemind's DHT and averagers, their libp2p daemons), and
    terminating the worker does not end them. So every worker makes itself the leader of a new process
    group first thing (``os.setpgid(0, 0)``); what it starts stays in that group unless it moves itself
    out. When a run ends, however it ends (result, failure, timeout, Ctrl-C in the parent), the parent
    sends SIGTERM to each worker's whole group, waits up to ``grace_s`` for the group to empty, and
    then sends SIGKILL to whatever is left (:func:`end_process_groups`). A worker's group id is its pid;
    the kernel does not hand out a pid again while a process group of that id has members, so the id
    names no other group while anything of the worker's is left. Linux only (the group's members are
    read from /proc); elsewhere the signals still go to the groups but nothing waits for them.

Note [Which worker failed]
    When one worker fails, its peers fail soon after (a reset connection in their next collective),
    and torch's ``ProcessContext.join`` names whichever failed process it happens to look at first:
    the consequence as often as the cause. So each worker also puts its own traceback, with the time
    it failed, on the result queue before it exits, and the parent names every rank that failed by
    itself (:func:`failure_report`): first those that died without a traceback (an exit code or a
    signal: nothing raised, so nothing of the run's made them die), then those that raised, earliest
    first. Ranks ended by the SIGTERM that follows the first failure are left out.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import queue as queue_mod
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pyasync.demo.config import TrainConfig
from pyasync.demo.data import Digits
from pyasync.demo.train import join_run, train_worker
from pyasync.launch import describe_exit

#: What a local run executes on every rank: ``worker(cfg, rank, store, progress, data)`` returns rank 0's
#: result (None elsewhere). It must be a module-level function (it is pickled by name for the workers).
Worker = Callable[[TrainConfig, int, dist.Store, Callable[[int], None] | None, Digits], Any]


def start_store_server(timeout_s: float = 60.0) -> dist.TCPStore:
    """A TCPStore server on a free loopback port (read ``.port``) for local runs; keep it alive."""
    return dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


class WorkerError(RuntimeError):
    """A worker process of a local run failed or the run timed out."""


def _local_worker(
    rank: int, worker: Worker, cfg: TrainConfig, data: Digits, port: int, prefix: str, queue: Any
) -> None:
    os.setpgid(0, 0)  # a group of its own, ended whole when the run ends: Note [Worker process trees]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    progress = (lambda samples: queue.put(("progress", samples))) if rank == 0 else None
    try:
        timeout = datetime.timedelta(seconds=cfg.timeout_s)
        base = dist.TCPStore("127.0.0.1", port, None, False, timeout=timeout)
        store = join_run(base, prefix, rank, cfg.workers, cfg.timeout_s)
        record = worker(cfg, rank, store, progress, data)
    except Exception:
        # What failed here and when, for the parent's report (Note [Which worker failed]); torch's
        # wrapper still records the traceback and exits with status 1. Its tail only: a message under
        # PIPE_BUF (4 KiB) goes down the pipe whole, so a worker terminated mid-send cannot leave the
        # parent a partial message to block on.
        tail = traceback.format_exc().encode()[-3000:].decode(errors="ignore")
        queue.put(("error", rank, time.time(), tail))
        queue.close()
        queue.join_thread()
        raise
    if rank == 0:
        queue.put(("result", record))
    dist.destroy_process_group()
    # Skip the interpreter's teardown of torch (seconds per process on a loaded machine): flush what
    # this process wrote, hand the queued result to the parent, and leave with status 0.
    queue.close()
    queue.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def process_group_members(pgid: int) -> list[int]:
    """The pids of the live (not zombie) processes of process group ``pgid``, read from /proc (Linux);
    an empty list where there is no /proc."""
    pids = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses, so split after the last ")"
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 3 and fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


def end_process_groups(pgids: list[int], grace_s: float = 10.0) -> list[int]:
    """SIGTERM every process of the process groups ``pgids``, wait up to ``grace_s`` seconds for them to
    exit, SIGKILL those left; returns the pids that were still there for SIGKILL (empty when all went on
    SIGTERM). See Note [Worker process trees]."""
    live = []
    for g in pgids:
        try:
            os.killpg(g, signal.SIGTERM)
            live.append(g)
        except (ProcessLookupError, PermissionError):  # empty group
            pass

    def wait_empty(seconds: float) -> list[int]:
        deadline = time.monotonic() + seconds
        left = [pid for g in live for pid in process_group_members(g)]
        while left and time.monotonic() < deadline:
            time.sleep(0.05)  # polling /proc: no event tells the parent when a grandchild exits
            left = [pid for g in live for pid in process_group_members(g)]
        return left

    left = wait_empty(grace_s)
    if left:
        for g in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(g, signal.SIGKILL)
        wait_empty(10.0)  # SIGKILL cannot be refused, but it lands asynchronously
    return left


def failure_report(exitcodes: list[int | None], errors: dict[int, tuple[float, str]], first: int) -> str:
    """Every rank of a failed run that failed by itself, the likely cause first (Note [Which worker
    failed]). ``exitcodes``: each process's exit code (None: still running); ``errors``: rank ->
    (time it failed, traceback) as the workers reported them; ``first``: the rank torch noticed
    first, always named (its own exit status where it reported no traceback)."""
    died = [
        r
        for r, code in enumerate(exitcodes)
        if r not in errors and code not in (None, 0) and (code != -signal.SIGTERM or r == first)
    ]
    if first not in errors and first not in died:
        died.insert(0, first)
    parts = [
        f"-- Process {r} terminated with {describe_exit(exitcodes[r] or 0)} (no traceback: it exited or "
        "was killed without raising)"
        for r in died
    ]
    parts += [
        f"-- Process {r} terminated with the following error:\n{tb}"
        for r, (_, tb) in sorted(errors.items(), key=lambda kv: kv[1][0])
    ]
    return "\n\n".join(parts)


def run_local(
    cfg: TrainConfig,
    store: dist.TCPStore,
    prefix: str,
    progress: Callable[[int], None] | None = None,
    run_timeout_s: float = 600.0,
    worker: Worker = train_worker,
    label: str | None = None,
) -> Any:
    """Run ``worker`` (default :func:`train_worker`: train ``cfg``) on ``cfg.workers`` spawned local
    processes; returns rank 0's result (a record).

    ``store`` is a server from :func:`start_store_server` (kept by the caller across runs); ``prefix``
    must be unique per run. ``progress(samples)`` is called in this process as training advances.
    Raises :class:`WorkerError` with the worker's traceback when a worker fails, and when the run takes
    longer than ``run_timeout_s`` seconds (the workers are terminated either way). Whatever the workers
    started is ended with them (Note [Worker process trees]). ``label`` names the run in errors
    (default: ``run 'SYSTEM'``).
    """
    label = f"run {cfg.system.name!r}" if label is None else label
    return _spawn(worker, label, cfg, store, prefix, progress, run_timeout_s)


def _spawn(
    worker: Worker,
    label: str,
    cfg: TrainConfig,
    store: dist.TCPStore,
    prefix: str,
    progress: Callable[[int], None] | None,
    run_timeout_s: float,
) -> Any:
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = mp.start_processes(
        _local_worker,
        args=(worker, cfg, cfg.load_data(), store.port, prefix, queue),
        nprocs=cfg.workers,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + run_timeout_s
    record = None
    errors: dict[int, tuple[float, str]] = {}  # rank -> (when, traceback): Note [Which worker failed]

    def drain(wait_s: float) -> None:
        nonlocal record
        try:
            msg = queue.get(timeout=wait_s)
            while True:
                if msg[0] == "progress" and progress is not None:
                    progress(msg[1])
                elif msg[0] == "result":
                    record = msg[1]
                elif msg[0] == "error":
                    errors[msg[1]] = (msg[2], msg[3])
                msg = queue.get_nowait()
        except queue_mod.Empty:
            pass

    try:
        while True:
            drain(0.2)
            try:
                done = procs.join(timeout=0)
            except ProcessException as e:  # raised or exited: the others are terminated
                # The failed workers put their tracebacks on the queue before exiting.
                with contextlib.suppress(Exception):  # a worker killed mid-put can leave it unreadable
                    drain(0.5)
                codes = [p.exitcode for p in procs.processes]
                report = failure_report(codes, errors, e.error_index)
                raise WorkerError(f"{label}: a worker failed:\n\n{report}") from e
            if done:
                break
            if time.monotonic() > deadline:
                raise WorkerError(
                    f"{label} did not finish within {run_timeout_s:.0f} s; workers "
                    "terminated (raise --run-timeout if the machine is just slow)"
                )
    finally:
        # Each worker leads a process group of its own (Note [Worker process trees]): end them whole.
        end_process_groups([p.pid for p in procs.processes])
        for p in procs.processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    if record is None:
        drain(5.0)
    if record is None:
        raise WorkerError(f"{label}: workers exited without a result")
    return record


def progress_bar(total_samples: int, desc: str, disable: bool = False, leave: bool = True):
    """A tqdm bar of samples on stderr, and the ``progress(samples)`` callback that moves it to
    ``samples`` (the count the cluster has claimed so far). Close the bar when done."""
    from tqdm.auto import tqdm

    bar = tqdm(
        total=total_samples,
        desc=desc,
        unit="sample",
        unit_scale=True,
        disable=disable,
        leave=leave,
        file=sys.stderr,
    )

    def advance(samples: int) -> None:
        bar.update(max(0, samples - bar.n))

    return bar, advance
