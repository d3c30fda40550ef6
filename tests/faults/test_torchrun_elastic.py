"""The README's recipe for a launch that survives, with real torchrun processes on loopback: the job's
store in its own process (``pyasync.store``, here this test's), one torchrun agent per worker with the
c10d rendezvous and ``is_host=false``, rank 0 SIGKILLed at its step 15. The other three agents' workers
finish every step in membership epoch 1, on equal replicas; only the dead worker's agent fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _dist import multiproc

from pyasync.store import serve

ROOT = Path(__file__).resolve().parents[2]


@multiproc
def test_torchrun_agents_survive_a_dead_rank_zero(tmp_path):
    store = serve("127.0.0.1", 0)
    env = dict(os.environ, PYASYNC_NUM_THREADS="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "4", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{store.port}",
        "--rdzv-id", "elastic-test", "--rdzv-conf", "is_host=false", "--max-restarts", "0",
        "--monitor-interval", "0.5",
        str(ROOT / "examples" / "train_elastic.py"),
        "--steps", "40", "--kill-rank", "0", "--kill-at", "15", "--timeout", "30", "--out", str(tmp_path),
    ]  # fmt: skip
    agents = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(4)
    ]
    files = [tmp_path / f"rank{r}.json" for r in (1, 2, 3)]
    end = time.monotonic() + 240
    try:
        # The survivors' workers finish and write their files; the dead worker's agent exits non-zero.
        # (The survivors' agents then wait in torchelastic's exit barrier for the dead agent, up to
        # its 300 s, which torchrun cannot shorten: they are stopped here once their workers are done.)
        while time.monotonic() < end and not (
            all(f.exists() for f in files) and any(a.poll() not in (None, 0) for a in agents)
        ):
            time.sleep(0.2)  # polling files and exit codes, observable states
    finally:
        seen = [a.poll() for a in agents]  # None: still running (its worker done, in the exit barrier)
        for a in agents:
            if a.poll() is None:
                a.terminate()
        outs = [a.communicate(timeout=30)[0] for a in agents]
    tails = [o[-1500:] for o in outs]
    assert sorted(c in (None, 0) for c in seen) == [False, True, True, True], (seen, tails)
    recs = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (1, 2, 3)}
    assert not (tmp_path / "rank0.json").exists()
    for r, rec in recs.items():
        assert rec["steps"] == 40, rec
        assert rec["members"] == [1, 2, 3] and rec["epoch"] == 1, rec
        assert rec["epochs"][0]["lost"] == [0]
        assert rec["checksum"] == recs[1]["checksum"], (r, rec["checksum"], recs[1]["checksum"])
    del store
