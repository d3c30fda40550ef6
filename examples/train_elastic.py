"""Train the digits MLP under torchrun with elastic membership: a worker that dies is survived.

    python -m pyasync.store --port 29400 &                 # the job's store, outside every worker
    for i in 0 1 2 3; do                                    # one torchrun agent per worker
      torchrun --nnodes 4 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 \\
               --rdzv-id digits --rdzv-conf is_host=false --max-restarts 0 \\
               examples/train_elastic.py --policy asp &
    done; wait

Why one agent per worker: torchrun's agent stops every worker it started when one of them fails; with
one worker per agent, a failure stops only that agent, and the other agents' workers go on (a closed
rendezvous does not restart healthy agents). Why the store outside: the agents' rendezvous store is
the job's store (``TORCHELASTIC_USE_AGENT_STORE``), where the survivors agree on each membership
epoch; ``is_host=false`` keeps every agent a client of ``pyasync.store``, so that no death takes the
store down (rank 0's included). The survivors' agents, once their workers are done, wait in
torchelastic's exit barrier for the dead worker's agent, which never comes: up to 300 s (not settable
from torchrun's command line); the training itself is over by then. ``--kill-rank R --kill-at K``
SIGKILLs rank R at its step K to try it.
Each rank prints one JSON line at the end (steps, membership epochs, test accuracy).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

import pyasync
from pyasync.demo.data import accuracy, batches, load_digits_split, make_model, shard_indices


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", default="asp", help="ssp:S, asp or quorum:K (elastic; default asp)")
    p.add_argument("--steps", type=int, default=200, help="steps per worker (default 200)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--timeout", type=float, default=60.0, help="every wait's limit, in seconds")
    p.add_argument("--kill-rank", type=int, default=None, help="SIGKILL this rank ...")
    p.add_argument("--kill-at", type=int, default=50, help="... at the start of this step (default 50)")
    p.add_argument("--out", default=None, help="directory for one JSON file per rank")
    args = p.parse_args(argv)

    timeout = datetime.timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    data = load_digits_split(0)
    idx = shard_indices(len(data.x_train), rank, world, 0)
    model = make_model(256, 0)
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr), policy=args.policy, timeout=timeout, elastic=True
    )
    draw = batches(data.x_train[idx], data.y_train[idx], max(1, len(idx) // 32), 32, 0, rank)
    for t in range(args.steps):
        if rank == args.kill_rank and t == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = next(draw)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    opt.close()
    st = opt.stats()
    rec = {
        "rank": rank,
        "steps": st.clock,
        "epoch": st.epoch,
        "members": st.members,
        "epochs": st.epochs,
        "accuracy": accuracy(model, data.x_test, data.y_test),
        "checksum": float(sum(p.double().sum() for p in model.parameters())),
    }
    print(json.dumps(rec), flush=True)
    if args.out:
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(rec, f)


if __name__ == "__main__":
    main()
