"""Train an MLP on scikit-learn's digits, data-parallel, under a pyasync policy or DDP, with torchrun.

    torchrun --nproc-per-node 4 examples/train_digits.py --policy ssp:2
    torchrun --nproc-per-node 4 examples/train_digits.py --policy asp+int8 --straggler 3:3
    torchrun --nproc-per-node 4 examples/train_digits.py --policy ddp --json ddp.json

Each rank reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the environment (torchrun sets them),
joins ``init_process_group("gloo")`` and trains on its own shard of the training set. The training loop
is the one ``python -m pyasync.demo`` runs (``pyasync.experiments.train_worker``): for pyasync it is the
plain PyTorch loop with the optimizer wrapped,

    opt = pyasync.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=..., momentum=...),
                                       policy="ssp:2", compression=None)
    for x, y in batches:
        opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()
    opt.close()

Rank 0 shows a progress bar and prints the same table as the demo; ``--json`` writes its record.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import torch.distributed as dist

from pyasync import experiments as h


def main(argv: Sequence[str] | None = None) -> None:
    """Parse options, join the torchrun job, train, and report on rank 0."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--policy",
        default="ssp:2",
        help="ddp, bsp, asp, ssp:S or quorum:K, optionally +int8/+fp16/+bf16/+sign/+topk:RATIO "
        "(default ssp:2)",
    )
    p.add_argument(
        "--straggler", default="none", help="RANK:FACTOR slows that rank's steps FACTOR times, or none"
    )
    p.add_argument(
        "--straggler-delay-ms",
        type=float,
        default=None,
        help="fixed delay per straggler step (ms) instead of FACTOR x its measured compute time",
    )
    p.add_argument("--epochs", type=int, default=20, help="total work in passes over the training set")
    p.add_argument(
        "--batch-size", type=int, default=h.TrainConfig.batch_size, help="samples per step per rank"
    )
    p.add_argument("--hidden", type=int, default=h.TrainConfig.hidden, help="width of the hidden layers")
    p.add_argument("--lr", type=float, default=h.TrainConfig.lr, help="SGD learning rate")
    p.add_argument("--momentum", type=float, default=h.TrainConfig.momentum, help="SGD momentum")
    p.add_argument("--seed", type=int, default=0, help="data split, model init and batch order")
    p.add_argument("--timeout", type=float, default=60.0, help="timeout of every wait (s)")
    p.add_argument("--json", default=None, help="rank 0 writes its result record to this path")
    args = p.parse_args(argv)

    store, rank, world = h.store_from_env(args.timeout)
    cfg = h.TrainConfig(
        system=h.parse_system(args.policy, world),
        workers=world,
        epochs=args.epochs,
        batch_size=args.batch_size,
        hidden=args.hidden,
        lr=args.lr,
        momentum=args.momentum,
        seed=args.seed,
        straggler=h.parse_straggler(args.straggler, world),
        straggler_delay_s=None if args.straggler_delay_ms is None else args.straggler_delay_ms / 1e3,
        timeout_s=args.timeout,
    )
    run_store = h.join_run(store, "train_digits/", rank, world, args.timeout)
    bar = None
    if rank == 0:
        from tqdm.auto import tqdm

        data_n = len(h.load_digits_split(cfg.seed).x_train)
        total = cfg.epochs * h.steps_per_epoch(data_n, world, cfg.batch_size) * world * cfg.batch_size
        bar = tqdm(total=total, desc=cfg.system.name, unit="sample", unit_scale=True, file=sys.stderr)

    def progress(samples: int) -> None:
        bar.update(max(0, samples - bar.n))

    record = h.train_worker(cfg, rank, run_store, progress if bar is not None else None)
    dist.destroy_process_group()
    if rank != 0:
        return
    bar.close()
    print(h.format_table([record]))
    print(f"steps per rank: {record['steps_per_rank']}")
    print(f"replicas equal after training: {record['replicas_equal']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
