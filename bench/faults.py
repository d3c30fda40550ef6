"""A worker killed mid-run under elastic membership: what it costs the survivors.

    python bench/faults.py --out bench/results/faults_elastic_cpu.json          # asp, ssp:2, quorum:3
    python bench/faults.py --policies asp --steps 120 --device-ms 10              # a quick look

For each policy it trains the demo's digits MLP (scikit-learn's ``load_digits``, each worker on its own
shard, SGD) on ``--workers`` local processes twice, side by side: uninterrupted, and with the victim
(rank ``--victim``) SIGKILLed at the start of its step ``--kill-at``. Every rank runs
``DistributedOptimizer(..., elastic=True)`` over gloo on loopback with the job's TCPStore hosted by this
process (so that any rank may die, as under torchrun's agent). Every step sleeps ``--device-ms`` first
(the emulated accelerator of bench/e2e.py: the four workers share two cores here, and the sleep keeps
them from competing for them). Measured, per run:

* ``detection_s``: from the kill to the survivor's transport reporting it (median over survivors);
  ``change_started_s``: to the start of the epoch change (the end of the step in flight);
* ``recovery_s``: from the kill (the victim writes ``time.time()`` into the store just before it
  SIGKILLs itself) to the first step that a survivor finished in the new membership epoch (its update
  applied by the new owners), median over the survivors; ``epoch_change_s``: the epoch change itself
  (drain, agreement, new group, re-shard), as ``stats().epochs`` reports it;
* ``samples_per_s_before`` / ``_after``: the cluster's samples per second before the kill and after the
  recovery (every survivor's steps in the window, over the window);
* ``accuracy``: test accuracy of the final model (every survivor ends with the same replica), and the
  cost against the uninterrupted run of the same policy.

Results (JSON) are rewritten after every run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pyasync
from pyasync.demo.data import accuracy, batches, load_digits_split, make_model, shard_indices

__all__ = ["main", "summarize"]


def _worker(rank: int, world: int, port: int, cfg: dict, kill: bool, out) -> None:
    os.environ["PYASYNC_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=cfg["timeout"])
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    data = load_digits_split(cfg["seed"])
    idx = shard_indices(len(data.x_train), rank, world, cfg["seed"])
    x, y = data.x_train[idx], data.y_train[idx]
    model = make_model(cfg["hidden"], cfg["seed"])
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=cfg["lr"]),
        policy=cfg["policy"],
        timeout=timeout,
        elastic=True,
    )
    draw = batches(x, y, max(1, len(x) // cfg["batch"]), cfg["batch"], cfg["seed"], rank)
    ends, epochs = [], []
    for t in range(cfg["steps"]):
        if kill and rank == cfg["victim"] and t == cfg["kill_at"]:
            store.set("killed_at", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(cfg["device_ms"] / 1000.0)  # the emulated device (see the module docstring)
        xb, yb = next(draw)
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
        ends.append(time.time())
        epochs.append(opt.stats().epoch)
    opt.close()
    st = opt.stats()
    out.put(
        {
            "rank": rank,
            "ends": ends,
            "epochs": epochs,
            "changes": st.epochs,
            "accuracy": accuracy(model, data.x_test, data.y_test),
            "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()[:64],
            "killed_at": float(store.get("killed_at")) if kill else None,
        }
    )
    dist.destroy_process_group()


def run_once(cfg: dict, kill: bool, limit_s: float) -> list[dict]:
    """Every surviving rank's record of one run (spawned processes; a store hosted here)."""
    ctx = mp.get_context("spawn")
    world = cfg["workers"]
    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=cfg["timeout"]), wait_for_workers=False
    )
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, world, store.port, cfg, kill, out), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    want = world - (1 if kill else 0)
    recs: list[dict] = []
    deadline = time.monotonic() + limit_s
    try:
        while len(recs) < want and time.monotonic() < deadline:
            try:
                recs.append(out.get(timeout=1.0))
            except Exception:
                if all(not p.is_alive() for p in procs):
                    break
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    del store
    if len(recs) < want:
        raise RuntimeError(
            f"{cfg['policy']} ({'killed' if kill else 'uninterrupted'}): {len(recs)} of {want} ranks"
        )
    return sorted(recs, key=lambda r: r["rank"])


def summarize(cfg: dict, plain: list[dict], killed: list[dict]) -> dict[str, Any]:
    """One policy's record from its two runs."""
    batch = cfg["batch"]
    killed_at = killed[0]["killed_at"]
    first_new = [next(e for e, ep in zip(r["ends"], r["epochs"]) if ep >= 1) for r in killed]
    recovered_at = max(first_new)

    def rate(recs: list[dict], lo: float, hi: float) -> float:
        steps = sum(1 for r in recs for e in r["ends"] if lo < e <= hi)
        return steps * batch / (hi - lo) if hi > lo else float("nan")

    start = min(r["ends"][0] for r in killed)
    end = max(r["ends"][-1] for r in killed)
    t0, t1 = min(r["ends"][0] for r in plain), max(r["ends"][-1] for r in plain)
    equal = all(r["params"] == killed[0]["params"] for r in killed)
    return {
        "policy": cfg["policy"],
        "workers": cfg["workers"],
        "victim": cfg["victim"],
        "kill_at_step": cfg["kill_at"],
        "device_ms": cfg["device_ms"],
        "recovery_s": statistics.median(e - killed_at for e in first_new),
        "recovery_s_max": recovered_at - killed_at,
        "detection_s": statistics.median(r["changes"][0]["seen_at"] - killed_at for r in killed),
        "change_started_s": statistics.median(r["changes"][0]["started_at"] - killed_at for r in killed),
        "epoch_change_s": statistics.median(r["changes"][0]["seconds"] for r in killed),
        "pushes_lost": sum(r["changes"][0]["pushes_lost"] for r in killed),
        "reinitialized": killed[0]["changes"][0]["reinitialized"],
        "samples_per_s_before": rate(killed + [], start, killed_at),
        "samples_per_s_after": rate(killed, recovered_at, end),
        "samples_per_s_uninterrupted": rate(plain, t0, t1),
        "accuracy": statistics.mean(r["accuracy"] for r in killed),
        "accuracy_uninterrupted": statistics.mean(r["accuracy"] for r in plain),
        "accuracy_cost": statistics.mean(r["accuracy"] for r in plain)
        - statistics.mean(r["accuracy"] for r in killed),
        "replicas_equal": equal,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="JSON file for the records")
    p.add_argument("--policies", default="asp,ssp:2,quorum:3", help="comma list (default asp,ssp:2,quorum:3)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--victim", type=int, default=2, help="the rank killed (default 2)")
    p.add_argument("--steps", type=int, default=300, help="steps per worker (default 300)")
    p.add_argument("--kill-at", type=int, default=None, help="the victim's step (default: steps / 3)")
    p.add_argument("--device-ms", type=float, default=20.0, help="emulated device time per step (default 20)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=30.0, help="the optimizer's timeout (s)")
    p.add_argument("--run-timeout", type=float, default=600.0, help="limit for one run (s)")
    return p


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = build_parser().parse_args(argv)
    if args.workers < 2 or not 0 <= args.victim < args.workers:
        raise SystemExit(
            f"need --workers >= 2 and 0 <= --victim < --workers, got {args.workers}, {args.victim}"
        )
    kill_at = args.kill_at if args.kill_at is not None else args.steps // 3
    if not 0 < kill_at < args.steps - 1:
        raise SystemExit(f"--kill-at must be in 1..{args.steps - 2}, got {kill_at}")
    records = []
    for policy in [s.strip() for s in args.policies.split(",") if s.strip()]:
        cfg = {
            "policy": policy,
            "workers": args.workers,
            "victim": args.victim,
            "steps": args.steps,
            "kill_at": kill_at,
            "device_ms": args.device_ms,
            "batch": args.batch,
            "hidden": args.hidden,
            "lr": args.lr,
            "seed": args.seed,
            "timeout": args.timeout,
        }
        plain = run_once(cfg, False, args.run_timeout)
        killed = run_once(cfg, True, args.run_timeout)
        rec = summarize(cfg, plain, killed)
        records.append(rec)
        print(
            f"{policy:10s} recovery {rec['recovery_s']:.2f} s (epoch change {rec['epoch_change_s']:.2f} s), "
            f"samples/s {rec['samples_per_s_before']:.0f} before, {rec['samples_per_s_after']:.0f} after "
            f"({rec['samples_per_s_uninterrupted']:.0f} uninterrupted), accuracy {rec['accuracy']:.4f} "
            f"vs {rec['accuracy_uninterrupted']:.4f}"
        )
        if args.out:
            with open(args.out, "w") as f:
                json.dump(
                    {
                        "machine": {"cores": os.cpu_count(), "note": "4 workers share these cores"},
                        "runs": records,
                    },
                    f,
                    indent=1,
                )
    return records


if __name__ == "__main__":
    main()
