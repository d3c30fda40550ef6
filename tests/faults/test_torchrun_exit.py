"""Workers exit with code 0 under torchrun, every time (pyasync issue 25, item 8).

A worker that trained with pyasync used to crash now and then *after* its last line ran ("terminate
called without an active exception", SIGABRT, or SIGSEGV), which fails the whole torchrun job: the
default gloo group it had destroyed stayed alive, pinned by torch.distributed.nn.functional, and its
native threads met the interpreter's teardown (Note [A destroyed group that stays alive] in
pyasync/teardown.py). The spawn-based tests cannot see this: they collect results before the workers
exit and the demo's workers leave with ``os._exit``. Here real torchrun jobs run on loopback:

* the README's command, many times, each run's exit code 0 (the crash is rare: this catches a return
  of it with some probability, and checks every run's exit);
* a script that never calls ``close()`` (imported pyasync after ``init_process_group`` and after its
  first optimizer, the worst order), several times: exit code 0, and, deterministically, no gloo
  thread left alive when its last atexit hook runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _dist import free_port, multiproc

ROOT = Path(__file__).resolve().parents[2]
RUNS = int(os.environ.get("PYASYNC_EXIT_RUNS", "20"))  # README runs (the issue: 20)
PARALLEL = 2  # torchrun jobs at once (each is 5 processes; this machine may have 2 cores)
RUN_TIMEOUT_S = 300.0  # one job, start-up (importing torch and torch._dynamo) included

# Registered before anything else, so it runs last at exit: by then every hook of pyasync (and of
# weakref.finalize) has run, and no gloo thread may be left for the interpreter's teardown.
_NO_CLOSE = textwrap.dedent(
    """
    import atexit, os

    def native_threads_left():
        names = []
        for t in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{t}/comm") as f:
                    names.append(f.read().strip())
            except OSError:
                pass  # the thread ended meanwhile
        left = sorted(n for n in names if n.startswith(("gloo", "pt_gloo")))
        if left:
            print(f"rank {os.environ['RANK']}: gloo threads alive at exit: {left}", flush=True)
            os._exit(7)

    atexit.register(native_threads_left)

    import datetime, sys
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    inner = torch.optim.SGD(net.parameters(), lr=0.05)  # imports torch._dynamo now, after init

    import pyasync  # after init_process_group and the first optimizer: the worst order

    opt = pyasync.DistributedOptimizer(inner, policy=sys.argv[1], timeout=datetime.timedelta(seconds=60))
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(20):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    dist.barrier()  # every rank is done stepping before any leaves without close()
    dist.destroy_process_group()
    print(f"rank {os.environ['RANK']}: done", flush=True)
    # no opt.close(): the optimizer is still referenced when the interpreter exits
    """
)


def _torchrun(args: list[str], nproc: int = 4) -> tuple[int, str]:
    """One torchrun job on loopback: (exit code, its output). The job is killed whole (its own
    session) if it runs past RUN_TIMEOUT_S, which counts as a failure (exit code None -> -9)."""
    env = dict(
        os.environ,
        PYASYNC_NUM_THREADS="1",
        OMP_NUM_THREADS="1",
        PYTHONFAULTHANDLER="1",
        PYTHONPATH=str(ROOT),
        GLOO_SOCKET_IFNAME="lo",
    )
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        *args,
    ]  # fmt: skip
    p = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = p.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate(timeout=30)
        out += f"\n[test] killed after {RUN_TIMEOUT_S:g} s"
    return p.returncode, out


def _all_exit_zero(jobs: list[list[str]], must_print: str) -> None:
    with ThreadPoolExecutor(PARALLEL) as pool:
        results = list(pool.map(_torchrun, jobs))
    bad = [(i, rc, out) for i, (rc, out) in enumerate(results) if rc != 0 or must_print not in out]
    assert not bad, (
        f"{len(bad)} of {len(jobs)} torchrun jobs failed; first: run {bad[0][0]}, exit code {bad[0][1]}, "
        f"output tail:\n{bad[0][2][-6000:]}"
    )


@multiproc
def test_readme_command_exits_zero_every_time():
    """`torchrun --nproc-per-node 4 examples/train_digits.py --policy asp`, one epoch, RUNS times."""
    job = [str(ROOT / "examples" / "train_digits.py"), "--policy", "asp", "--epochs", "1", "--timeout", "60"]
    _all_exit_zero([job] * RUNS, "replicas equal after training: True")


@multiproc
def test_script_without_close_exits_zero_with_no_gloo_thread_left(tmp_path):
    """A script that never calls close() (ASP and SSP), twice each: exit code 0 on every rank, no
    gloo thread alive at its last atexit hook (exit code 7 otherwise)."""
    script = tmp_path / "no_close.py"
    script.write_text(_NO_CLOSE)
    jobs = [[str(script), policy] for policy in ("asp", "ssp:1") for _ in range(2)]
    _all_exit_zero(jobs, "rank 0: done")
