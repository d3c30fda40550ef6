"""Starting N local rank processes, the same way for every benchmark: see Note [One launcher].

- :func:`start_store`: the rendezvous, a ``TCPStore`` server on a port the OS picks, held by the parent;
- :func:`spawn_ranks`: start ``world`` spawned processes of one function (each rank ``r`` gets ``r`` first);
- :func:`collect_results`: the ``(rank, "ok" | "error", value)`` each rank reports, bounded by a deadline;
- :func:`run_ranks`: all of it: a store, ranks that join a gloo group and return a value, the values by
  rank or one error naming every rank that failed.

Note [One launcher]
~~~~~~~~~~~~~~~~~~~
Every benchmark that trains or communicates on several ranks starts them here, so that they share
the same habits: the ``spawn`` start method (a fresh interpreter per rank, no forked torch state); a
``TCPStore`` server on port 0 held by the parent (the OS picks the port while the server binds it, so
two runs never race for one number, as they could with a port found free, closed, then handed to
the ranks: the ``_free_port`` the scripts used to copy); a run-unique key prefix on it; the thread
settings fixed in the environment before torch does any work; a bounded wait for every result (a
rank that dies without reporting is noticed by its exit code; one that fails gives the others a grace
period to report their own view of the failure); and nothing outliving the call: every rank still
alive afterwards is killed and joined. A rank reports exactly once, ``(rank, "ok", value)`` or
``(rank, "error", traceback)``. bench/engine.py, bench/collectives.py, bench/overlap.py and
bench/soak.py use :func:`run_ranks`. Benchmarks whose parent must act on ranks while they run
(bench/faults.py kills a victim, bench/faults_table.py shares barriers and flags) use
:func:`start_store` and :func:`spawn_ranks` and keep their own loop. bench/e2e.py and bench/capture.py
train through the demo's launcher (``pyasync.demo.local.run_local``, which also ends the process
trees its workers start), on the same store server.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import queue as queue_mod
import secrets
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pyasync.demo.local import start_store_server

#: The environment of a rank that must not compete with its siblings for cores: one thread each for
#: pyasync's kernels and OpenMP (the benchmarks start several ranks on a few cores).
ONE_THREAD_ENV: Mapping[str, str] = {"PYASYNC_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def start_store(timeout_s: float) -> dist.TCPStore:
    """A ``TCPStore`` server on a free loopback port (read ``.port``), for the ranks of local runs;
    the caller keeps it alive for the run. ``timeout_s``: seconds any wait on it may take. The same
    server as the demo's runs use (``pyasync.demo.local.start_store_server``, which bench/e2e.py and
    bench/capture.py hand to ``run_local``)."""
    return start_store_server(timeout_s)


def spawn_ranks(
    target: Callable[..., Any],
    world: int,
    args: Sequence[Any] = (),
    *,
    name: str,
    daemon: bool = False,
    ctx: Any = None,
) -> list[multiprocessing.Process]:
    """Start ``world`` processes running ``target(rank, *args)`` with the ``spawn`` start method
    (``ctx``: a spawn context the caller already made its queues and locks with); named
    ``{name}-rank{r}``; returns them started. ``target`` must be importable by the child (a module
    level function)."""
    ctx = multiprocessing.get_context("spawn") if ctx is None else ctx
    procs = [
        ctx.Process(target=target, args=(r, *args), name=f"{name}-rank{r}", daemon=daemon)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    return procs


def collect_results(
    procs: list, results, deadline: float, grace_s: float = 10.0
) -> dict[int, tuple[str, Any]]:
    """Results of spawned worker processes: ``results`` is a queue each worker puts one
    ``(rank, "ok" | "error", value)`` on. Returns {rank: (status, value)} once every worker reported,
    the monotonic ``deadline`` passed, or a worker failed (then the others get ``grace_s`` to report
    their own view of the failure) or died without a result (reported as an error with its exit
    code). Every worker still alive afterwards is killed and joined, so nothing outlives the call."""
    got: dict[int, tuple[str, Any]] = {}
    n = len(procs)
    try:
        while len(got) < n and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [i for i, p in enumerate(procs) if i not in got and not p.is_alive()]
                if not dead:
                    continue
                try:  # a rank that reported just before exiting
                    rank, status, value = results.get(timeout=5.0)
                except queue_mod.Empty:
                    for i in dead:
                        got[i] = ("error", f"exited with code {procs[i].exitcode} without a result")
                    break
            got[rank] = (status, value)
            if status == "error":
                end = min(deadline, time.monotonic() + grace_s)
                while len(got) < n and time.monotonic() < end:
                    try:
                        r2, s2, v2 = results.get(timeout=0.5)
                        got[r2] = (s2, v2)
                    except queue_mod.Empty:
                        pass
                break
        for p in procs:  # finished: let them exit on their own first
            p.join(timeout=max(1.0, min(30.0, deadline - time.monotonic())) if len(got) == n else 0)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(10)
    return got


def _rank_entry(
    rank: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    world: int,
    port: int,
    prefix: str,
    timeout_s: float,
    env: Mapping[str, str],
    threads: int | None,
    fast_exit: bool,
    results: Any,
) -> None:
    """One rank of :func:`run_ranks`: the environment, a gloo group on the parent's store, then
    ``fn(rank, world, *args)``; reports its value or its traceback once (Note [One launcher])."""
    os.environ.update(env)
    try:
        if threads is not None:
            torch.set_num_threads(threads)
            torch.set_num_interop_threads(threads)
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timeout)
        dist.init_process_group(
            "gloo", store=dist.PrefixStore(prefix, store), rank=rank, world_size=world, timeout=timeout
        )
        try:
            out = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, "ok", out))
    except BaseException:  # shipped to the parent as text
        results.put((rank, "error", traceback.format_exc()))
    if fast_exit:
        # Skip the interpreter's slow teardown of torch: hand the queued result over and leave.
        results.close()
        results.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    args: Sequence[Any] = (),
    *,
    name: str,
    timeout_s: float,
    run_timeout_s: float,
    env: Mapping[str, str] | None = None,
    threads: int | None = 1,
    fast_exit: bool = False,
    daemon: bool = False,
    error: type[Exception] = RuntimeError,
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned ranks joined in one gloo process group (on a
    store served here, under a run-unique prefix) and return their values by rank.

    ``timeout_s``: seconds any wait of a rank may take (store, process group); ``run_timeout_s``:
    seconds the whole run may take; ``env``: variables set in each rank before anything else (e.g.
    :data:`ONE_THREAD_ENV`); ``threads``: torch's intra- and inter-op threads per rank (None: torch's
    defaults); ``fast_exit``: ranks leave with ``os._exit(0)`` once their result is handed over (the
    interpreter's teardown of torch takes seconds on a loaded machine). ``fn`` and ``args`` must
    pickle, and the values returned must too. Raises ``error`` naming every rank's fate (its
    traceback, finished, or no result) when a rank fails or the run passes ``run_timeout_s``; the
    ranks are ended either way (Note [One launcher]).
    """
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    store = start_store(timeout_s)
    prefix = f"{name}-{secrets.token_hex(4)}/"
    env = dict(env or {})
    entry_args = (fn, tuple(args), world, store.port, prefix, timeout_s, env, threads, fast_exit, results)
    procs = spawn_ranks(_rank_entry, world, entry_args, name=name, daemon=daemon, ctx=ctx)
    deadline = time.monotonic() + run_timeout_s
    got = collect_results(procs, results, deadline)
    if len(got) == world and all(s == "ok" for s, _ in got.values()):
        return [got[r][1] for r in range(world)]
    lines = []
    for r, p in enumerate(procs):
        if r in got and got[r][0] == "error":
            lines.append(f"--- rank {r} failed:\n{got[r][1]}")
        elif r in got:
            lines.append(f"--- rank {r} finished")
        else:
            lines.append(f"--- rank {r} gave no result within {run_timeout_s:g} s (exit code {p.exitcode})")
    what = "failed" if time.monotonic() < deadline else f"did not finish within {run_timeout_s:g} s"
    raise error(f"{name} run {what}:\n" + "\n".join(lines))
