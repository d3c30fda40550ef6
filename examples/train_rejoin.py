"""Train the digits MLP elastically while workers die and their replacements join the running job.

    python -m pyasync.launch --nproc 4 --max-restarts 10 examples/train_rejoin.py --policy asp --cycles 10

``pyasync.launch`` hosts the job's store, starts 4 workers and starts a replacement for each one that
fails; the replacement (``PYASYNC_JOIN=1``) runs this same script, and its ``DistributedOptimizer(...,
elastic=True)`` joins the job at the members' next epoch change (Note [Joining a running job] in
pyasync/session/joining.py). ``--cycles N`` makes it a fault drill: N times, the newest member SIGKILLs
itself ``--kill-after`` steps after the job is back at full size, and its replacement joins. Each worker
that finishes prints one JSON line (its id, steps, membership, test accuracy and a checksum of its
replica).

Each worker trains on the shard of its launcher slot (a replacement takes its predecessor's). The
workers that never die train ``--steps`` steps, and on until the last replacement has joined and
trained ``--after`` steps with them; while the job is short of a worker they pace their steps (the
replacement's start takes seconds).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

import pyasync
from pyasync.demo.data import accuracy, batches, load_digits_split, make_model, shard_indices


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", default="asp", help="ssp:S, asp, quorum:K or bsp:p2p (default asp)")
    p.add_argument("--steps", type=int, default=200, help="steps of the workers that never die (default 200)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--cycles", type=int, default=0, help="kill/replace cycles (default 0)")
    p.add_argument("--kill-after", type=int, default=10, help="steps at full size before a kill (default 10)")
    p.add_argument("--after", type=int, default=20, help="steps after the last join (default 20)")
    p.add_argument("--timeout", type=float, default=60.0, help="every wait's limit, in seconds")
    args = p.parse_args(argv)

    timeout = datetime.timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", timeout=timeout)
    slot = int(os.environ.get("PYASYNC_SLOT", dist.get_rank()))
    nproc = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    torch.set_num_threads(1)
    data = load_digits_split(0)
    idx = shard_indices(len(data.x_train), slot, nproc, 0)
    model = make_model(256, 0)
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr), policy=args.policy, timeout=timeout, elastic=True
    )
    me = opt.epoch.members[opt.epoch.rank]  # this worker's id in the job (a replacement: a new one)
    last = nproc - 1 + args.cycles  # the id of the last worker to join (ids grow by one per join)
    draw = batches(data.x_train[idx], data.y_train[idx], max(1, len(idx) // 32), 32, 0, me)
    t, full_at, done_at = 0, None, None
    while True:
        members = opt.stats().members
        full = len(members) == nproc
        full_at = (t if full_at is None else full_at) if full else None
        if full and me == max(members) and me < last and t - full_at >= args.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)  # the drill: the newest member dies
        if full and max(members) == last and done_at is None:
            done_at = t
        if done_at is not None and t - done_at >= args.after and (me >= nproc or t >= args.steps):
            break
        if not full:
            time.sleep(0.02)  # a replacement is starting: pace the steps
        x, y = next(draw)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        t += 1
    opt.close()
    st = opt.stats()
    rec = {
        "id": me,
        "slot": slot,
        "steps": t,
        "members": st.members,
        "changes": len(st.epochs),
        "joined": [g for c in st.epochs for g in c["joined"]],
        "accuracy": accuracy(model, data.x_test, data.y_test),
        "checksum": sum(float(p.detach().double().sum()) for p in model.parameters()),
    }
    os.write(1, (json.dumps(rec) + "\n").encode())  # one write: the workers share the launcher's stdout


if __name__ == "__main__":
    main()
