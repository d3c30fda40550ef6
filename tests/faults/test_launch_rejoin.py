"""Repeated kill -> restart cycles under ``python -m pyasync.launch``: the launcher starts a replacement for
every worker that dies, the replacement joins the running job (Note [Joining a running job]), and the job
ends at full size with equal replicas and an uninterrupted run's accuracy. Real processes, real SIGKILLs
(examples/train_rejoin.py's drill), every wait bounded (the launcher's run by the subprocess timeout)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _dist import multiproc

ROOT = Path(__file__).resolve().parents[2]
NPROC = 4


def _launch(policy: str, cycles: int, steps: int) -> tuple[int, list[dict], str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYASYNC_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pyasync.launch", "--nproc", str(NPROC), "--max-restarts", str(cycles)]
    cmd += [str(ROOT / "examples" / "train_rejoin.py"), "--policy", policy, "--cycles", str(cycles)]
    cmd += ["--steps", str(steps), "--timeout", "30"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    recs = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    return r.returncode, recs, r.stderr


@multiproc
@pytest.mark.parametrize("policy", ["asp", "quorum:3"])
def test_ten_kill_restart_cycles_end_at_full_size(policy):
    cycles = 10
    rc, recs, err = _launch(policy, cycles, 100)
    assert rc == 0, err[-4000:]
    assert len(recs) == NPROC, (recs, err[-4000:])
    last = NPROC - 1 + cycles
    ids = sorted(r["id"] for r in recs)
    assert ids == [0, 1, 2, last], ids
    assert err.count("starting a replacement that joins the job") == cycles
    for r in recs:
        assert r["members"] == ids
        assert r["checksum"] == recs[0]["checksum"] and r["accuracy"] == recs[0]["accuracy"]
        if r["id"] < NPROC:  # the workers that never died saw every death and every join
            assert r["changes"] == 2 * cycles and r["joined"] == list(range(NPROC, last + 1)), r
    steps = max(r["steps"] for r in recs)
    rc0, base, err0 = _launch(policy, 0, steps)  # the same number of steps, no fault
    assert rc0 == 0 and len(base) == NPROC, err0[-4000:]
    assert abs(recs[0]["accuracy"] - base[0]["accuracy"]) <= 0.01, (recs[0]["accuracy"], base[0]["accuracy"])
