"""The smallest launcher in which a dead worker's replacement starts on its own and joins the running job:
``python -m pyasync.launch --nproc 4 --max-restarts 10 train.py [args...]``.

torchrun cannot do this: when one worker fails its agent stops every worker of the node and restarts the
whole group (a new rendezvous, training from the script's start). This launcher hosts the job's store
itself (so no worker's death takes it down), starts ``--nproc`` workers with the environment that
``init_process_group()``'s ``env://`` reads (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, and
the agent-store variables torchrun's agents set, so every worker is a client of this store), and when a
worker ends with a failure (a non-zero exit code, or a signal) starts a replacement in its slot with
``PYASYNC_JOIN=1``, ``RANK=0`` and ``WORLD_SIZE=1``: the same script, unchanged, builds a one-rank
default group on the job's store and its ``DistributedOptimizer(elastic=True)`` joins the running job
(Note [Joining a running job] in pyasync/session/joining.py). A worker that exits 0 is done. The launcher
exits 0 when the last worker of every slot exited 0, else 1; SIGINT and SIGTERM are passed on to the
workers (then, after ``--grace`` seconds, SIGKILL).

RANK means nothing to a replacement (it is 0): a script shards its data by ``PYASYNC_SLOT`` (the
launcher's slot, which a replacement takes over) and reads its place in the job from the optimizer
(``opt.epoch.rank``, ``opt.epoch.members``). Every worker gets the job's id in ``PYASYNC_JOB_ID`` (a
fresh one per launch unless set): a replacement pointed at another job's store is refused.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence

from pyasync.store import serve

__all__ = ["main"]


def _env(
    base: dict[str, str], port: int, host: str, slot: int, nproc: int, join: bool, job: str
) -> dict[str, str]:
    env = dict(base)
    env.update(
        MASTER_ADDR=host,
        MASTER_PORT=str(port),
        RANK="0" if join else str(slot),
        WORLD_SIZE="1" if join else str(nproc),
        LOCAL_RANK=str(slot),
        LOCAL_WORLD_SIZE=str(nproc),
        TORCHELASTIC_USE_AGENT_STORE="True",  # every worker is a client of the store hosted here
        TORCHELASTIC_RESTART_COUNT="0",  # one namespace for the whole job, replacements included
        PYASYNC_SLOT=str(slot),
    )
    env.setdefault("PYASYNC_JOB_ID", job)  # one per job: a replacement of another job is refused
    if join:
        env["PYASYNC_JOIN"] = "1"
    else:
        env.pop("PYASYNC_JOIN", None)
    return env


def describe_exit(code: int) -> str:
    """A process's exit status in words: "exit code N", or "signal NAME" for -N (a number where the
    signal has no name)."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"


def run(
    cmd: Sequence[str],
    nproc: int,
    max_restarts: int,
    host: str = "127.0.0.1",
    port: int = 0,
    grace: float = 30.0,
) -> int:
    """Run ``cmd`` as ``nproc`` workers, replacing failed ones at most ``max_restarts`` times in all;
    returns the launcher's exit code."""
    store = serve(host, port)
    job = uuid.uuid4().hex[:12]  # the job's id (Note [Joining a running job]), unless the caller set one
    port = store.port
    procs: list[subprocess.Popen] = []
    restarts = 0
    stopping = False

    def stop(signum, _frame) -> None:
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for slot in range(nproc):
            procs.append(
                subprocess.Popen(list(cmd), env=_env(os.environ, port, host, slot, nproc, False, job))
            )
        while any(p.poll() is None for p in procs):
            time.sleep(0.1)
            for slot, p in enumerate(procs):
                code = p.poll()
                if code is None or code == 0 or stopping or restarts >= max_restarts:
                    continue
                restarts += 1
                print(
                    f"pyasync.launch: worker {slot} (pid {p.pid}) failed ({describe_exit(code)}); starting a "
                    f"replacement that joins the job (restart {restarts} of {max_restarts})",
                    file=sys.stderr,
                    flush=True,
                )
                procs[slot] = subprocess.Popen(
                    list(cmd), env=_env(os.environ, port, host, slot, nproc, True, job)
                )
        if stopping:
            end = time.monotonic() + grace
            while any(p.poll() is None for p in procs) and time.monotonic() < end:
                time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for s, h in old.items():
            signal.signal(s, h)
        del store
    codes = [p.returncode for p in procs]
    bad = {slot: c for slot, c in enumerate(codes) if c != 0}
    if bad:
        print(
            "pyasync.launch: "
            + "; ".join(f"worker {s} ended with {describe_exit(c)}" for s, c in bad.items())
            + f" ({restarts} restarts used of {max_restarts})",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m pyasync.launch", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    p.add_argument("--nproc", type=int, required=True, help="workers to run (at full size)")
    p.add_argument("--max-restarts", type=int, default=0, help="replacements to start, in all (default 0)")
    p.add_argument("--host", default="127.0.0.1", help="address of the store hosted here (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="the store's port (default: a free one)")
    p.add_argument(
        "--grace", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL (default 30)"
    )
    p.add_argument("script", help="the training script (run with this Python)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    a = p.parse_args(argv)
    if a.nproc < 1 or a.max_restarts < 0:
        p.error("--nproc must be at least 1 and --max-restarts at least 0")
    cmd = [sys.executable, a.script, *a.args]
    sys.exit(run(cmd, a.nproc, a.max_restarts, a.host, a.port, a.grace))


if __name__ == "__main__":
    main()
