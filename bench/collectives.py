"""Collective benchmark: what each way of running BSP's reduce and gather costs on gloo, side by side.

BSP on collectives (pyasync/engine/collective/engine.py) reduces each bucket to its owners and gathers the new
shard values back; DDP all-reduces. This times, on ``--ranks`` processes of one machine (gloo,
``torch.set_num_threads(1)``), for a bucket of each ``--sizes`` fp32 elements:

* ``all_reduce``: DDP's one collective;
* ``reduce_scatter``: gloo's reduce-scatter (``reduce_scatter_tensor``);
* ``a2a_reduce``: pyasync's reduce, an all-to-all of the n chunks, then their sum in rank order
  (Note [Reduce by all-to-all] in pyasync/engine/collective/reduce.py);
* ``all_gather``: gloo's all-gather of one shard per rank (``all_gather_into_tensor``);
* ``a2a_gather``: an all-to-all of n copies of the shard;
* ``p2p_reduce`` / ``p2p_gather``: the same exchanges as point-to-point ``isend``/``irecv`` of the
  chunks (no copies on the sending side); ``p2p_gather`` is pyasync's gather.

Every op runs ``--warmup`` times, then ``--iters`` times between two barriers: the figure is rank 0's
wall time per call and its process CPU time per call (all threads: gloo's included). Ops are
interleaved over ``--rounds`` rounds and the medians reported, so background load on a shared machine
hits them evenly.

    python bench/collectives.py --out collectives.json
    python bench/collectives.py --sizes 300K,1.2M,4.7M --rounds 5

Output: a table on stdout and, with ``--out``, a JSON list with one record per (size, op): the medians,
every round's figures, the machine and the command line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from typing import Any

import _path  # noqa: F401  (first: sys.path, see bench/_path.py)
import common
import torch
import torch.distributed as dist
from harness.launch import run_ranks

OPS = ("all_reduce", "reduce_scatter", "a2a_reduce", "p2p_reduce", "all_gather", "a2a_gather", "p2p_gather")
# torch 2.13 renamed these; older releases only have the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _exchange(out: torch.Tensor, send: list[torch.Tensor]) -> None:
    """Row r of ``out`` from rank r, ``send[r]`` to rank r, as point-to-point ops (own row copied)."""
    me, n = dist.get_rank(), dist.get_world_size()
    rows = out.view(n, -1)
    ops = []
    for i in range(1, n):
        dst, src = (me + i) % n, (me - i) % n
        ops.append(dist.P2POp(dist.irecv, rows[src], src))
        ops.append(dist.P2POp(dist.isend, send[dst], dst))
    rows[me].copy_(send[me])
    for w in dist.batch_isend_irecv(ops):
        w.wait()


def _ops(numel: int, n: int) -> dict[str, Any]:
    """The ops on buffers made once, as the engine keeps its buffers across steps
    (engine/collective/reduce.py)."""
    x = torch.randn(numel)
    out = torch.empty(numel)
    shard = torch.randn(numel // n)
    total = torch.empty(numel // n)
    copies = torch.empty(n, numel // n)
    return {
        "all_reduce": lambda: dist.all_reduce(x),
        "reduce_scatter": lambda: _reduce_scatter(shard, x),
        "a2a_reduce": lambda: (dist.all_to_all_single(out, x), torch.sum(out.view(n, -1), 0, out=total)),
        "p2p_reduce": lambda: (
            _exchange(out, list(x.view(n, -1).unbind(0))),
            torch.sum(out.view(n, -1), 0, out=total),
        ),
        "all_gather": lambda: _all_gather(out, shard),
        "p2p_gather": lambda: _exchange(out, [shard] * n),
        "a2a_gather": lambda: (
            copies.copy_(shard.expand(n, -1)),
            dist.all_to_all_single(out, copies.view(-1)),
        ),
    }


def _rank_main(rank: int, world: int, args: argparse.Namespace) -> dict[tuple[int, str], list] | None:
    """One rank (started by harness.launch.run_ranks, in its gloo group); rank 0 returns
    {(numel, op): [(wall ms, CPU ms) per round]}, the others None."""
    warnings.filterwarnings("ignore", category=FutureWarning)  # the old names, on older torch
    res: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for numel in args.sizes:
            ops = _ops(numel - numel % world, world)
            for name in args.ops:
                fn = ops[name]
                for _ in range(args.warmup):
                    fn()
                dist.barrier()
                c0, t0 = time.process_time(), time.perf_counter()
                for _ in range(args.iters):
                    fn()
                dist.barrier()
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                res.setdefault((numel, name), []).append((1e3 * wall / args.iters, 1e3 * cpu / args.iters))
    return res if rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--sizes", default="300K,1.2M,4.7M", help="bucket sizes in fp32 elements (K, M)")
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma list of {', '.join(OPS)}")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per op and round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="rounds, ops interleaved; medians reported")
    ap.add_argument("--out", default=None, help="JSON output path")
    args = ap.parse_args(argv)
    for name in ("ranks", "iters", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in args.ops if o not in OPS]
    if bad or not args.ops:
        ap.error(f"--ops: unknown {bad}; choose from {', '.join(OPS)}")
    try:
        args.sizes = [common.parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError as e:
        ap.error(f"--sizes: {e}")
    if not args.sizes or min(args.sizes) < args.ranks:
        ap.error(f"--sizes must be >= --ranks ({args.ranks}) elements each")
    res = run_ranks(
        _rank_main, args.ranks, (args,), name="collectives", timeout_s=120.0, run_timeout_s=1800.0
    )[0]
    machine, cmd = common.machine_info(), common.command_line()
    records = []
    for (numel, name), rounds in res.items():
        records.append(
            {
                "bench": "collectives",
                "op": name,
                "numel": numel,
                "ranks": args.ranks,
                "ms": statistics.median(w for w, _ in rounds),
                "cpu_ms": statistics.median(c for _, c in rounds),
                "rounds": [{"ms": w, "cpu_ms": c} for w, c in rounds],
                "loadavg": common.loadavg(),
                "machine": machine,
                "command": cmd,
            }
        )
    print(
        common.format_table(
            records,
            [("numel", "elements"), ("op", "op"), ("ms", "ms (rank 0)"), ("cpu_ms", "CPU ms (rank 0)")],
        )
    )
    common.write_results(args.out, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
