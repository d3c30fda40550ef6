"""What a join costs against the number of donors: a large state, a job of m members, one joiner.

    python bench/rejoin.py --out bench/results/rejoin_cpu/rejoin_25M_run1.json  # 25M, m = 1,2,4,8
    python bench/rejoin.py --numel 100M --donors 1,2 --out bench/results/rejoin_cpu/rejoin_100M_run1.json
    python bench/rejoin.py --numel 1M --donors 2 --out /tmp/rejoin.json             # a quick look

Each process holds several copies of the state (parameters, a gradient, push frames, the copies elastic
membership keeps until answered): 100M parameters with 4 members ran out of 24 GiB here.

For each m it starts m workers of an elastic ASP job over a state of ``--numel`` fp32 parameters (several
tensors, one 25 MB bucket each, SGD with momentum 0.9: master values and momentum on the owners), the
job's store hosted by this process; each takes ``--steps`` steps, then a joiner starts (a fresh process,
PYASYNC_JOIN=1: Note [Joining a running job] in pyasync/session/joining.py) while the members keep
stepping (paced: one step per 50 ms), and every process stops ``--after`` steps after the join. Measured:

* ``joiner_request_to_engine_s``: on the joiner, from its request in the store to its engine running
  (its ``stats().epochs[0]["seconds"]``): the agreement, the group, the replica from the donors, the
  replica check, the re-shard, the barrier;
* ``joiner_start_to_first_push_s``: from the joiner process's start (before ``import torch``) to the end
  of its first ``step()``;
* ``members_pause_s``: the members' epoch change (median over members), the time they do not train;
* ``joiner_cpu_s``, ``members_cpu_s_max``: the CPU time (every thread) the joiner's process and the
  busiest member's spent in the change (``stats().epochs[i]["cpu_seconds"]``): what each process
  itself costs, which on m + 1 dedicated machines bounds the change's time with the wire time, and
  which here the m + 1 processes compete for on two cores;
* ``max_rss_mb``: the largest peak resident memory of any process (what limits m here);
* ``replica_bytes_per_donor``: what each donor sends the joiner for its replica (its own shards'
  values; computed from the layout);
* ``member_bytes_sent_max`` / ``_median``, ``joiner_bytes_received``: the state each process sent or
  received point to point in the join's change (replica and re-split: Note [Re-splitting onto the
  members] in pyasync/session/membership.py), counted by pyasync (``stats().epochs[i]["bytes_sent"]``,
  ``["bytes_received"]``);
* ``busiest_link_bytes``: the most any one process sent or received, and ``busiest_link_s_at``: that as
  wire time on full-duplex NICs of 10 and 100 Gbit/s, a lower bound of the transfer on m + 1 machines
  (computed from the counted bytes, not measured);
* ``allreduce_reshard_bytes_per_member``: what each member sent in the re-shard before it was made
  point to point (an all-reduce of the whole state, gloo's ring: 2 (m' - 1) / m' of it, m' = m + 1;
  computed), for comparison.

On this 2-core machine every process shares the same two cores and loopback, so the "parallel" donors
compete for the CPU: the measured seconds show what the protocol costs here, not what m machines would
see; the counted bytes are what m machines would move.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import queue
import resource
import socket
import statistics
import sys
import time

import _path  # noqa: F401  (the repository root on sys.path)

BUCKET = 25 * 2**20 // 4  # elements per tensor: one default bucket each
LINKS_GBPS = (10.0, 100.0)  # the busiest link's bytes as wire time on NICs of these speeds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _numel(text: str) -> int:
    t = text.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(t[-1:], 1)
    return int(float(t[:-1] if t[-1:] in "KMG" else t) * mult)


def _worker(
    slot: int, m: int, port: int, numel: int, steps: int, after: int, join: bool, t_start: float, out
):
    try:
        import torch
        import torch.distributed as dist

        import pyasync

        torch.set_num_threads(1)
        timeout = datetime.timedelta(seconds=300)
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timeout)
        if join:
            os.environ["PYASYNC_JOIN"] = "1"
            dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group("gloo", store=store, rank=slot, world_size=m, timeout=timeout)
        sizes = [BUCKET] * (numel // BUCKET) + ([numel % BUCKET] if numel % BUCKET else [])
        params = [torch.nn.Parameter(torch.zeros(s)) for s in sizes]
        opt = pyasync.DistributedOptimizer(
            torch.optim.SGD(params, lr=1e-3, momentum=0.9), policy="asp", timeout=timeout, elastic=True
        )
        gen = torch.Generator().manual_seed(slot + (1000 if join else 0))
        first_push = None
        t, joined_at = 0, None
        while True:
            for p in params:  # in place: a fresh tensor per step would be one more copy at the peak
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                p.grad.normal_(generator=gen)
            opt.step()
            t += 1
            if first_push is None:
                first_push = time.time() - t_start
            if joined_at is None and (join or len(opt.stats().members) == m + 1):
                joined_at = t
            if joined_at is not None and t - joined_at >= after and t >= steps:
                break
            if joined_at is None and t >= steps:
                time.sleep(0.05)  # the joiner is starting: pace the members' steps
        opt.close()
        st = opt.stats()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
        out.put((slot, join, {"first_push_s": first_push, "epochs": st.epochs, "max_rss_mb": rss}))
        dist.destroy_process_group()
    except BaseException as e:
        import traceback

        out.put((slot, join, {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}))


def run_one(m: int, numel: int, steps: int, after: int, timeout: float) -> dict:
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    store = dist.TCPStore(
        "127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False
    )
    procs = [
        ctx.Process(target=_worker, args=(r, m, port, numel, steps, after, False, time.time(), out))
        for r in range(m)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    # the job's record (pyasync/session/joining.py's JOB_KEY, under the workers' default-group prefix)
    store.wait(["0//pyasync/elastic/job"], datetime.timedelta(seconds=timeout))
    t0 = time.time()
    joiner = ctx.Process(target=_worker, args=(m, m, port, numel, steps, after, True, t0, out))
    joiner.start()
    got = []
    try:
        while len(got) < m + 1 and time.monotonic() < deadline:
            try:
                got.append(out.get(timeout=1.0))
            except queue.Empty:
                if not any(p.is_alive() for p in [*procs, joiner]):
                    break
    finally:
        for p in [*procs, joiner]:
            p.join(10)
            if p.is_alive():
                p.kill()
    errors = [r["error"] for _, _, r in got if "error" in r]
    if errors or len(got) < m + 1:
        raise RuntimeError(f"m={m}: {len(got)} of {m + 1} reported; " + "\n".join(errors)[:4000])
    j = next(r for _, jn, r in got if jn)
    change = [next(c for c in r["epochs"] if c["joined"]) for _, jn, r in got if not jn]
    state = 2 * numel * 4  # master values and momentum, fp32
    sent = [c["bytes_sent"] for c in change]
    received = [c["bytes_received"] for c in change] + [j["epochs"][0]["bytes_received"]]
    busiest = max(*sent, *received)  # the link that carries the most: the transfer's critical path
    return {
        "donors": m,
        "numel": numel,
        "joiner_request_to_engine_s": j["epochs"][0]["seconds"],
        "joiner_start_to_first_push_s": j["first_push_s"],
        "members_pause_s": statistics.median(c["seconds"] for c in change),
        "members_pause_max_s": max(c["seconds"] for c in change),
        "joiner_cpu_s": j["epochs"][0]["cpu_seconds"],
        "max_rss_mb": max(r["max_rss_mb"] for _, _, r in got),
        "members_cpu_s_max": max(c["cpu_seconds"] for c in change),
        "replica_bytes_per_donor": numel * 4 // m,
        "member_bytes_sent_max": max(sent),
        "member_bytes_sent_median": statistics.median(sent),
        "joiner_bytes_received": j["epochs"][0]["bytes_received"],
        "busiest_link_bytes": busiest,
        "busiest_link_s_at": {f"{g:g}Gbit": busiest * 8 / (g * 1e9) for g in LINKS_GBPS},
        "allreduce_reshard_bytes_per_member": int(2 * m / (m + 1) * state),
    }


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", default="25M", help="parameters in the state (default 25M)")
    p.add_argument("--donors", default="1,2,4,8", help="members before the join (default 1,2,4,8)")
    p.add_argument("--steps", type=int, default=2, help="steps before the joiner starts (default 2)")
    p.add_argument("--after", type=int, default=2, help="steps after the join (default 2)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run at most (default 900)")
    p.add_argument("--out", required=True, help="JSON results (rewritten after every run)")
    a = p.parse_args(argv)
    numel = _numel(a.numel)
    donors = [int(x) for x in a.donors.split(",")]
    if min(donors) < 1:
        p.error("--donors: each must be at least 1")
    command = " ".join(["python", "bench/rejoin.py", *(sys.argv[1:] if argv is None else argv)])
    rows = []
    for m in donors:
        row = run_one(m, numel, a.steps, a.after, a.timeout)
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(a.out, "w") as f:
            json.dump({"command": command, "runs": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
