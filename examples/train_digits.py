"""Train an MLP on scikit-learn's digits, data-parallel, under a pyasync policy or DDP, with torchrun.

    torchrun --nproc-per-node 4 examples/train_digits.py --policy ssp:2
    torchrun --nproc-per-node 4 examples/train_digits.py --policy asp+int8 --straggler 3:3
    torchrun --nproc-per-node 4 examples/train_digits.py --policy ddp --json ddp.json

Each rank reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the environment (torchrun sets them),
joins ``init_process_group("gloo")`` and trains on its own shard of the training set. The training loop
is the one ``python -m pyasync.demo`` runs (``pyasync.demo.train_worker``): for pyasync it is the
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
from collections.abc import Sequence

import torch.distributed as dist

from pyasync import demo as h
from pyasync.demo.cli import add_device_option, check_device_ms, train_config


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
    add_device_option(p)
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

    check_device_ms(args)
    store, rank, world = h.store_from_env(args.timeout)
    delay_s = None if args.straggler_delay_ms is None else args.straggler_delay_ms / 1e3
    system, straggler = h.parse_system(args.policy, world), h.parse_straggler(args.straggler, world)
    cfg = train_config(args, system, world, straggler, delay_s)
    run_store = h.join_run(store, "train_digits/", rank, world, args.timeout)
    bar = progress = None
    if rank == 0:
        total = cfg.budget(len(cfg.load_data().x_train)) * cfg.batch_size
        bar, progress = h.progress_bar(total, cfg.system.name)

    record = h.train_worker(cfg, rank, run_store, progress)
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
