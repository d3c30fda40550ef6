"""A worker killed mid-run under elastic membership: what it costs the survivors.

    python bench/faults.py --out bench/results/faults_elastic_cpu.json          # asp, ssp:2, quorum:3
    python bench/faults.py --systems asp --steps 120 --device-ms 10              # a quick look

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

``--systems`` takes pyasync policies and ``torchft`` (in the peers' venv, ``bash bench/peers/setup.sh``):

    .venv-peers/bin/python bench/faults.py --systems asp,ssp:2,quorum:3,torchft --out ...

Results (JSON) are rewritten after every run.

Note [Rejoining]
    With ``--rejoin S`` the killed run goes on: S seconds after the victim's process ended, this bench
    starts its replacement (same rank's data shard, same seed), which joins the running job, and the
    job ends at full size. For pyasync the replacement is a fresh process with ``PYASYNC_JOIN=1`` on
    the job's store (its own one-rank default group; Note [Joining a running job] in
    pyasync/session/joining.py); it trains until the first survivor has finished its steps (a store
    key), then closes. For torchft it is a fresh process with the victim's ``replica_id``: its Manager
    joins the lighthouse's next quorum, finds itself behind and heals, receiving the model's and the
    optimizer's state from one peer over torchft's HTTP checkpoint transport, then trains in lock
    step with the survivors until they have all committed ``--steps`` steps. A survivor that has
    taken its ``--steps`` before the replacement has taken ``REJOINED_STEPS`` goes on until it has
    (torchft: all stop ``REJOINED_STEPS`` after the replacement's first committed step), at most
    ``--timeout`` seconds after its loop started; only short runs need this, and the job ends at
    full size. Measured alike for both (``summarize_rejoin``):

    * ``rejoin_start_to_first_step_s``: from the replacement's start (before its interpreter) to the
      end of its first step that counted (torchft: committed);
    * ``rejoin_pause_s``: the survivors' longest step while it joined (between its start and its first
      step), less their median step before the kill (median over survivors); for pyasync also
      ``rejoin_change_s``, the membership change itself (``stats().epochs``);
    * ``rejoin_donor_bytes``: the state each donor sent (pyasync: counted by the change, replica and
      re-split; torchft: its state's tensors, which one peer sends, computed), and
      ``rejoin_joiner_bytes``, what the replacement received;
    * ``rejoin_samples_per_s_during`` (from the kill to the replacement's first step) and ``_after``
      (from then to the end), every worker's counted steps; ``samples_per_s_before`` as above;
    * ``rejoin_size_at_end``, ``rejoin_accuracy`` (the replacement's model) and
      ``rejoin_replicas_equal``; ``accuracy_uninterrupted`` is the uninterrupted run's.

Note [torchft under a kill]
    torchft 0.2.0 runs the same model, data, shards, seed, SGD, device sleep and kill (same victim, at
    the start of its step ``--kill-at``), DDP-style as its ``train_ddp.py``: every rank is a replica
    group of one with a ``torchft.Manager`` on ``ProcessGroupGloo`` and a TCP store of its own; each step
    ``torchft.Optimizer.zero_grad`` starts the quorum (asynchronously, torchft's default), the flattened
    gradients go through ``Manager.allreduce`` (averaged over the participants) and
    ``torchft.Optimizer.step`` steps SGD only when ``should_commit``. Each rank loops until it has
    committed ``--steps`` steps (torchft's idiom: an uncommitted step is redone). The lighthouse
    (``LighthouseServer``) runs in this bench's parent process, so it outlives the victim.
    ``min_replicas`` (lighthouse) and ``min_replica_size`` (managers) are ``workers - 1``: the
    survivors form a quorum without the dead replica. Timeouts for a fast local job: the manager's
    heartbeat every 100 ms (its default), the lighthouse's ``quorum_tick_ms`` 100 (its default and its
    examples'), ``join_timeout_ms`` 10000 (its examples'; it only matters when a live replica is late),
    ``heartbeat_timeout_ms`` ``--torchft-heartbeat-timeout-ms`` (default 1000, ten missed heartbeats;
    torchft's own default is 5000), the manager's, quorum and connect timeouts ``--timeout``. Every
    manager heartbeats before any asks for the first quorum, so the first quorum has all of them.

    A replica that dies between two steps is in no all-reduce: the survivors learn of it when the
    lighthouse leaves it out, i.e. when its heartbeats have been missing for ``heartbeat_timeout_ms``
    (until then it counts as healthy and the quorum waits for it to join). Measured, per survivor:
    ``detection_s`` (kill to a failed all-reduce of the step in flight or, if earlier, the quorum
    without the victim; ``detected_by`` says which), ``quorum_s`` (kill to ``wait_quorum`` returning the
    quorum without the victim, its process group reconfigured; taken just before the all-reduce, so
    it includes the step's forward and backward), ``recovery_s`` (kill to the first committed step in
    that quorum), ``steps_not_committed``; samples/s count committed steps only. ``epoch_change_s``,
    ``change_started_s``, ``pushes_resent`` (the survivors' pushes to the dead owner replayed on the
    freshest replica) and ``pushes_lost`` (those that could not be) are pyasync's and are None for
    torchft.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import time
from collections.abc import Sequence
from typing import Any

import _path  # noqa: F401  (first: sys.path, see bench/_path.py)
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from harness.cli import add_systems_option, parse_system_specs
from harness.launch import spawn_ranks, start_store
from harness.peers import peer_status, torchft_manager

import pyasync
from pyasync.demo.data import accuracy, batches, load_digits_split, make_model, shard_indices

__all__ = ["main", "summarize"]


def _torchft_goes_on(cfg: dict, store, step: int, it: int, t0: float) -> bool:
    """torchft's loop: until this replica has committed its steps (an uncommitted step is redone, at
    most 3x as many iterations); with ``--rejoin``, until the step the replacement set once it committed
    one, or while waiting for it (at most ``--timeout`` seconds after the loop started at ``t0``)."""
    if cfg.get("rejoin") is None:
        return step < cfg["steps"] and it < 3 * cfg["steps"]
    if store.check(["rejoined"]):
        return step < max(cfg["steps"], int(store.get("rejoined")))
    return step < cfg["steps"] or time.monotonic() - t0 < cfg["timeout"]


def _awaits_replacement(cfg: dict, store, t0: float) -> bool:
    """A survivor of a run with ``--rejoin`` that has taken its steps goes on until the replacement has
    finished a step (at most ``--timeout`` seconds after its loop started at ``t0``, monotonic), so that
    the job ends at full size (Note [Rejoining])."""
    return (
        cfg.get("rejoin") is not None
        and not cfg.get("join")
        and time.monotonic() - t0 < cfg["timeout"]
        and not store.check(["rejoined"])
    )


def _worker(rank: int, world: int, port: int, cfg: dict, kill: bool, out) -> None:
    """One rank of the job; with ``cfg["join"]``, the victim's replacement (Note [Rejoining])."""
    os.environ["PYASYNC_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=cfg["timeout"])
    join = cfg.get("join", False)
    store = dist.TCPStore("127.0.0.1", port, None if join else world, False, timeout=timeout)
    if join:  # its own one-rank group on the job's store (Note [Joining a running job])
        os.environ["PYASYNC_JOIN"] = "1"
        dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timeout)
    else:
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
    t, t0 = 0, time.monotonic()
    while t < cfg["steps"] or _awaits_replacement(cfg, store, t0):
        if kill and rank == cfg["victim"] and t == cfg["kill_at"]:
            store.set("killed_at", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        if join and store.check(["finished"]):  # a survivor is done: so is its replacement
            break
        time.sleep(cfg["device_ms"] / 1000.0)  # the emulated device (see the module docstring)
        xb, yb = next(draw)
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
        ends.append(time.time())
        epochs.append(opt.stats().epoch)
        t += 1
        if join and t == REJOINED_STEPS:
            store.set("rejoined", "1")
    if cfg.get("rejoin") is not None and not join:
        store.add("finished", 1)
    opt.close()
    st = opt.stats()
    out.put(
        {
            "rank": rank,
            "joiner": join,
            "started_at": cfg.get("started_at"),
            "ends": ends,
            "epochs": epochs,
            "changes": st.epochs,
            "members": st.members,
            "accuracy": accuracy(model, data.x_test, data.y_test),
            "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()[:64],
            "killed_at": float(store.get("killed_at")) if kill else None,
        }
    )
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------
# torchft under the same kill (Note [torchft under a kill])
# ---------------------------------------------------------------------------------------------------

#: Steps the job takes at full size once the replacement has taken one (Note [Rejoining]).
REJOINED_STEPS = 3

#: torchft's lighthouse and manager settings for this fast local job (Note [torchft under a kill]).
TORCHFT_HEARTBEAT_INTERVAL_MS = 100  # the manager's default
TORCHFT_QUORUM_TICK_MS = 100  # the lighthouse's default, and its examples'
TORCHFT_JOIN_TIMEOUT_MS = 10_000  # its examples' (--join_timeout_ms 10000); unused when every replica joins


def torchft_status() -> str | None:
    """None when torchft imports here, else why not (one line)."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at info
    return peer_status("torchft")


def _torchft_worker(rank: int, world: int, port: int, cfg: dict, kill: bool, out) -> None:
    """One replica group of one rank: a torchft Manager (gloo) against the lighthouse this bench hosts;
    every step starts a quorum, all-reduces the flattened gradients and steps only when it commits."""
    import torchft

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=cfg["timeout"])
    store = dist.TCPStore("127.0.0.1", port, None if cfg.get("join") else world, False, timeout=timeout)
    data = load_digits_split(cfg["seed"])
    idx = shard_indices(len(data.x_train), rank, world, cfg["seed"])
    x, y = data.x_train[idx], data.y_train[idx]
    model = make_model(cfg["hidden"], cfg["seed"])
    params = list(model.parameters())
    sgd = torch.optim.SGD(params, lr=cfg["lr"])
    # The replica group's own store (a group of one rank: this process hosts it, and dies with it).
    group_store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timeout, wait_for_workers=False)
    manager = torchft_manager(
        model,
        sgd,
        timeout,
        cfg["torchft_min_replicas"],
        group_store.port,
        cfg["lighthouse"],
        f"faults_rank{rank}",
        heartbeat_interval=datetime.timedelta(milliseconds=TORCHFT_HEARTBEAT_INTERVAL_MS),
    )
    opt = torchft.Optimizer(manager, sgd)
    join = cfg.get("join", False)
    # Every manager heartbeats before any asks for a quorum: the first quorum has all of them (a
    # replacement comes later: it heals from a peer, Note [Rejoining]).
    store.add("torchft_up", 1)
    while not join and int(store.add("torchft_up", 0)) < world:
        time.sleep(0.01)
    draw = batches(x, y, max(1, len(x) // cfg["batch"]), cfg["batch"], cfg["seed"], rank)
    ends, committed, sizes, quorum_at, failed_at = [], [], [], [], []
    it = 0
    # torchft's loop: until this replica has committed its steps (an uncommitted step is redone).
    t0 = time.monotonic()
    while _torchft_goes_on(cfg, store, manager.current_step(), it, t0):
        if kill and rank == cfg["victim"] and it == cfg["kill_at"]:
            store.set("killed_at", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        if join and store.check(["finished"]):
            break
        it += 1
        time.sleep(cfg["device_ms"] / 1000.0)  # the emulated device
        xb, yb = next(draw)
        opt.zero_grad()  # starts the quorum (asynchronously, as torchft does by default)
        F.cross_entropy(model(xb), yb).backward()
        manager.wait_quorum()  # what allreduce does first; timed here
        quorum_at.append(time.time())
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        work = manager.allreduce(flat)
        work.wait()
        if manager.errored() is not None:
            failed_at.append(time.time())
        else:
            off = 0
            for p in params:
                p.grad.copy_(flat[off : off + p.numel()].view_as(p))
                off += p.numel()
        size = manager.num_participants()
        before = manager.current_step()
        opt.step()  # steps SGD only when the manager commits
        ends.append(time.time())
        committed.append(manager.current_step() > before)
        if join and committed[-1] and not store.check(["rejoined"]):  # all stop together, at full size
            store.set("rejoined", str(manager.current_step() + REJOINED_STEPS))
        sizes.append(size)
    if cfg.get("rejoin") is not None and not join:
        store.add("finished", 1)
    state = [*model.state_dict().values(), *(v for st in sgd.state.values() for v in st.values())]
    out.put(
        {
            "rank": rank,
            "joiner": join,
            "started_at": cfg.get("started_at"),
            # what a healing replica receives from its one donor (computed: its state's tensors)
            "state_bytes": sum(t.numel() * t.element_size() for t in state if torch.is_tensor(t)),
            "ends": ends,
            "committed": committed,
            "sizes": sizes,
            "quorum_at": quorum_at,
            "failed_at": failed_at,
            "iterations": it,
            "committed_steps": int(manager.current_step()),
            "accuracy": accuracy(model, data.x_test, data.y_test),
            "params": torch.cat([p.detach().reshape(-1) for p in params]).tolist()[:64],
            "killed_at": float(store.get("killed_at")) if kill else None,
        }
    )
    manager.shutdown(wait=False)


def summarize_torchft(cfg: dict, plain: list[dict], killed: list[dict]) -> dict[str, Any]:
    """torchft's record from its two runs, the figures named as pyasync's where they mean the same."""
    batch = cfg["batch"]
    world = cfg["workers"]
    killed_at = killed[0]["killed_at"]

    def after(r: dict, key: str) -> list[float]:
        return [t for t in r[key] if t > killed_at]

    # the quorum without the victim: the first quorum of fewer than world replicas after the kill
    quorum = [
        next((q for q, n in zip(r["quorum_at"], r["sizes"]) if q > killed_at and n < world), float("nan"))
        for r in killed
    ]
    # detection: the survivor learns of the death, from a failed all-reduce of the step in flight or
    # (the victim died between steps) from the lighthouse's quorum without it, whichever comes first
    detected = [min(after(r, "failed_at") + [q]) for r, q in zip(killed, quorum)]
    first_new = [
        next(e for e, c, n in zip(r["ends"], r["committed"], r["sizes"]) if e > killed_at and c and n < world)
        for r in killed
    ]
    recovered_at = max(first_new)

    def rate(recs: list[dict], lo: float, hi: float) -> float:
        steps = sum(1 for r in recs for e, c in zip(r["ends"], r["committed"]) if c and lo < e <= hi)
        return steps * batch / (hi - lo) if hi > lo else float("nan")

    start = min(r["ends"][0] for r in killed)
    end = max(r["ends"][-1] for r in killed)
    t0, t1 = min(r["ends"][0] for r in plain), max(r["ends"][-1] for r in plain)
    acc = statistics.mean(r["accuracy"] for r in killed)
    acc_plain = statistics.mean(r["accuracy"] for r in plain)
    return {
        "policy": "torchft",
        "workers": world,
        "victim": cfg["victim"],
        "kill_at_step": cfg["kill_at"],
        "device_ms": cfg["device_ms"],
        "recovery_s": statistics.median(e - killed_at for e in first_new),
        "recovery_s_max": recovered_at - killed_at,
        "detection_s": statistics.median(d - killed_at for d in detected),
        "change_started_s": None,
        "quorum_s": statistics.median(q - killed_at for q in quorum),
        "epoch_change_s": None,
        "detected_by": sorted({"all-reduce" if after(r, "failed_at") else "quorum" for r in killed}),
        "steps_not_committed": sum(1 for r in killed for e, c in zip(r["ends"], r["committed"]) if not c),
        "pushes_lost": None,
        "pushes_resent": None,
        "reinitialized": [],
        "samples_per_s_before": rate(killed, start, killed_at),
        "samples_per_s_after": rate(killed, recovered_at, end),
        "samples_per_s_uninterrupted": rate(plain, t0, t1),
        "accuracy": acc,
        "accuracy_uninterrupted": acc_plain,
        "accuracy_cost": acc_plain - acc,
        "replicas_equal": all(r["params"] == killed[0]["params"] for r in killed),
        "committed_steps": [r["committed_steps"] for r in killed],
        "torchft": {
            "min_replica_size": cfg["torchft_min_replicas"],
            "lighthouse": "in the bench's parent process (outlives every rank)",
            "heartbeat_interval_ms": TORCHFT_HEARTBEAT_INTERVAL_MS,
            "heartbeat_timeout_ms": cfg["torchft_heartbeat_timeout_ms"],
            "quorum_tick_ms": TORCHFT_QUORUM_TICK_MS,
            "join_timeout_ms": TORCHFT_JOIN_TIMEOUT_MS,
            "timeout_s": cfg["timeout"],
            "process_group": "torchft.ProcessGroupGloo",
            "quorum": "async (torchft's default)",
        },
    }


def run_once(cfg: dict, kill: bool, limit_s: float) -> list[dict]:
    """Every surviving rank's record of one run (spawned processes; a store, and torchft's lighthouse,
    hosted here)."""
    ctx = mp.get_context("spawn")
    world = cfg["workers"]
    cfg = cfg if kill else {**cfg, "rejoin": None}  # no replacement in the uninterrupted run
    store = start_store(cfg["timeout"])
    lighthouse = None
    target = _worker
    if cfg["policy"] == "torchft":
        from torchft.coordination import LighthouseServer

        lighthouse = LighthouseServer(
            bind="[::]:0",
            min_replicas=cfg["torchft_min_replicas"],
            join_timeout_ms=TORCHFT_JOIN_TIMEOUT_MS,
            quorum_tick_ms=TORCHFT_QUORUM_TICK_MS,
            heartbeat_timeout_ms=cfg["torchft_heartbeat_timeout_ms"],
        )
        cfg = {**cfg, "lighthouse": lighthouse.address()}
        target = _torchft_worker
    out = ctx.Queue()
    procs = spawn_ranks(
        target, world, (world, store.port, cfg, kill, out), name="faults", daemon=True, ctx=ctx
    )
    want = world - (1 if kill else 0)
    recs: list[dict] = []
    deadline = time.monotonic() + limit_s
    rejoin_at = None  # when the replacement starts (Note [Rejoining])
    try:
        while len(recs) < want and time.monotonic() < deadline:
            if (
                kill
                and cfg.get("rejoin") is not None
                and rejoin_at is None
                and not procs[cfg["victim"]].is_alive()
            ):
                rejoin_at = time.monotonic() + cfg["rejoin"]
            if rejoin_at is not None and time.monotonic() >= rejoin_at and want == world - 1:
                args = (world, store.port, {**cfg, "join": True, "started_at": time.time()}, False, out)
                procs.append(ctx.Process(target=target, args=(cfg["victim"], *args), daemon=True))
                procs[-1].start()
                want += 1
            try:
                recs.append(out.get(timeout=0.05))
            except Exception:
                if all(not p.is_alive() for p in procs):
                    break
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        if lighthouse is not None:
            lighthouse.shutdown()
    del store
    if len(recs) < want:
        raise RuntimeError(
            f"{cfg['policy']} ({'killed' if kill else 'uninterrupted'}): {len(recs)} of {want} ranks"
        )
    return sorted(recs, key=lambda r: (r.get("joiner", False), r["rank"]))


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
        "pushes_resent": sum(r["changes"][0]["pushes_resent"] for r in killed),
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


def _counted(r: dict) -> list[float]:
    """The ends of a record's steps that counted (torchft's: the committed ones)."""
    return [e for e, c in zip(r["ends"], r.get("committed") or [True] * len(r["ends"])) if c]


def summarize_rejoin(cfg: dict, killed: list[dict]) -> dict[str, Any]:
    """The replacement's figures (Note [Rejoining]), measured alike for pyasync and torchft."""
    batch = cfg["batch"]
    surv = [r for r in killed if not r["joiner"]]
    joiners = [r for r in killed if r["joiner"]]
    if len(joiners) != 1 or not _counted(joiners[0]):
        raise RuntimeError(f"{cfg['policy']}: the replacement did not finish a step")
    j = joiners[0]
    killed_at, started, first = surv[0]["killed_at"], j["started_at"], _counted(j)[0]

    def rate(lo: float, hi: float) -> float:
        n = sum(1 for r in killed for e in _counted(r) if lo < e <= hi)
        return n * batch / (hi - lo) if hi > lo else float("nan")

    def pause(r: dict) -> float:  # its longest step while the replacement joined, less a usual step
        e = _counted(r)
        usual = statistics.median(b - a for a, b in zip(e, e[1:]) if b < killed_at)
        return max((b - a for a, b in zip(e, e[1:]) if b > started and a < first), default=usual) - usual

    end = max(_counted(r)[-1] for r in killed)
    joins = [next((c for c in r.get("changes") or [] if c["joined"]), None) for r in surv]
    pyasync_run = cfg["policy"] != "torchft"
    return {
        "rejoin_delay_s": cfg["rejoin"],
        "rejoin_start_to_first_step_s": first - started,
        "rejoin_pause_s": statistics.median(pause(r) for r in surv),
        "rejoin_change_s": statistics.median(c["seconds"] for c in joins) if pyasync_run else None,
        # pyasync's replacement: its start to its request (interpreter, torch, data, model, optimizer),
        # and its request to its engine running (waiting for a poll, the change)
        "rejoin_start_to_request_s": j["changes"][0]["started_at"] - started if pyasync_run else None,
        "rejoin_request_to_engine_s": j["changes"][0]["seconds"] if pyasync_run else None,
        "rejoin_donor_bytes": [c["bytes_sent"] for c in joins] if pyasync_run else [j["state_bytes"]],
        "rejoin_joiner_bytes": j["changes"][0]["bytes_received"] if pyasync_run else j["state_bytes"],
        "rejoin_samples_per_s_during": rate(killed_at, first),
        "rejoin_samples_per_s_after": rate(first, end),
        "rejoin_size_at_end": len(j["members"]) if pyasync_run else j["sizes"][-1],
        "rejoin_accuracy": j["accuracy"],
        "rejoin_replicas_equal": all(r["params"] == j["params"] for r in surv),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="JSON file for the records")
    add_systems_option(
        p,
        "--policies",
        default="asp,ssp:2,quorum:3",
        help="comma list of pyasync policies and/or torchft (default asp,ssp:2,quorum:3)",
    )
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
    p.add_argument(
        "--rejoin",
        type=float,
        default=None,
        metavar="S",
        help="start the victim's replacement S seconds after it died; it joins the running job "
        "(Note [Rejoining])",
    )
    p.add_argument(
        "--torchft-heartbeat-timeout-ms",
        type=int,
        default=1000,
        help="torchft's lighthouse: a replica silent this long is left out of the next quorum "
        "(default 1000: ten of the manager's 100 ms heartbeats; torchft's own default is 5000)",
    )
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
    try:
        kinds = ("pyasync", "torchft")
        systems = [s.name for s in parse_system_specs(args.systems, args.workers, kinds=kinds)]
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if "torchft" in systems and (why := torchft_status()) is not None:
        raise SystemExit(f"torchft: {why}")
    for policy in systems:
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
            "torchft_min_replicas": args.workers - 1,
            "torchft_heartbeat_timeout_ms": args.torchft_heartbeat_timeout_ms,
            "rejoin": args.rejoin,
        }
        plain = run_once(cfg, False, args.run_timeout)
        every = run_once(cfg, True, args.run_timeout)
        killed = [r for r in every if not r["joiner"]]
        rec = (summarize_torchft if policy == "torchft" else summarize)(cfg, plain, killed)
        if args.rejoin is not None:
            rec.update(summarize_rejoin(cfg, every))
            print(
                f"{policy:10s} rejoin: start to first step {rec['rejoin_start_to_first_step_s']:.2f} s, "
                f"others' pause {rec['rejoin_pause_s']:.2f} s, donors sent {rec['rejoin_donor_bytes']} B, "
                f"{rec['rejoin_size_at_end']} workers at the end"
            )
        records.append(rec)
        change = "" if rec["epoch_change_s"] is None else f" (epoch change {rec['epoch_change_s']:.2f} s)"
        print(
            f"{policy:10s} detection {rec['detection_s']:.2f} s, recovery {rec['recovery_s']:.2f} s{change}, "
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
