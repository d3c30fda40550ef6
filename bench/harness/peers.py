"""The peers of the end-to-end benchmark: hivemind and torchft (DDP-style, and its local-steps algorithms
DiLoCo and LocalSGD), each set up on one rank as its maintainers document it, counted and (torchft) put
behind the emulated link like DDP. They need the peers' venv (``bash bench/peers/setup.sh``); nothing
here is imported by pyasync itself.

Note [hivemind in the benchmark]
    ``hivemind`` trains with ``hivemind.Optimizer(use_local_updates=True)``, hivemind's asynchronous mode:
    every peer applies its own gradients with its own optimizer (``--optimizer``'s SGD or AdamW) at every step
    (as pyasync's ASP applies every push), and once per hivemind epoch (``target_batch_size`` samples of the
    whole swarm) the peers average their parameters in a background all-reduce. ``hivemind:R`` makes an epoch
    ``R`` steps of every peer (default :data:`HIVEMIND_ROUND_STEPS`), so that a round is seconds of compute,
    as hivemind is built for, not one step. The averager is configured as hivemind's docs advise for a small
    local run: ``matchmaking_time`` 3 s ("3-5 s for small local runs"), ``request_timeout`` 1 s (below the
    matchmaking time), ``target_group_size`` = the number of peers (a group that is full starts its all-reduce
    at once, without waiting out the matchmaking time), ``averaging_timeout`` 30 s. hivemind runs its DHT and
    averagers as ``multiprocessing.Process`` subclasses that pickle locks, which only works when they are
    forked: the worker (itself spawned, like every worker of the benchmark) sets its own start method to
    ``fork`` before hivemind starts them, as in any plain hivemind script on Linux. Timing starts when every
    peer's progress record is visible in the DHT (``tracker.global_progress.num_peers``), so matchmaking does
    not pay for peers still starting.

Note [Peer bytes]
    DDP's bytes are counted under the ring model (Note [DDP bytes and link time]). torchft all-reduces
    DDP's gradient buckets on its own gloo process group: counted the same way (``2 (n - 1) / n`` of
    each bucket), so its row and DDP's are like for like; its quorum RPCs to the lighthouse are not
    counted. hivemind's traffic all goes through one libp2p daemon (``p2pd``) per peer: its bytes are the
    kernel's count of what the daemon's TCP sockets sent (``tcpi_bytes_sent`` via ``ss -ti``), from
    when timing starts to when it ends: DHT, matchmaking and all-reduce with their framing and
    encryption, i.e. more than the tensors. Sockets the daemon closes during the run are not counted.

Note [Peers and the link]
    torchft's hook charges each all-reduce the wire time of its bytes on the rank's emulated link, exactly
    as DDP's does. hivemind's bytes leave through its daemon, which the emulation cannot throttle: with
    ``--bandwidth`` its record says ``"link": "not emulated"`` and the tables mark its rows.

Note [torchft's local steps]
    ``torchft-diloco:H`` and ``torchft-localsgd:H`` run ``torchft.local_sgd.DiLoCo`` and ``LocalSGD`` as
    torchft's examples (``train_diloco.py``, ``train_localsgd.py``) and tests do: a context manager
    entered around the ordinary loop (zero_grad, forward, backward, ``inner.step()``) that hooks the
    inner optimizer's ``step``; every ``H``-th step its post-hook syncs. DiLoCo: ``start_quorum`` (a
    synchronous quorum: DiLoCo refuses ``use_async_quorum=True``), an all-reduce (average) of each
    parameter's pseudo-gradient ``anchor - params``, the parameters put back to the anchor, and, if the
    manager commits, ``outer.step()`` on the averaged pseudo-gradients, the result the next anchor. The
    outer optimizer is ``torch.optim.SGD(nesterov=True)`` at lr 0.5 and momentum 0.8 unless the spec
    says otherwise (``torchft-diloco:16:lr=0.7:momentum=0.9``): pyasync's ``local:H`` defaults
    (``LOCAL_OUTER_DEFAULTS["sync"]``), so the two compare at the same outer hyperparameters. LocalSGD
    all-reduces (averages) the parameters themselves and installs them if the manager commits. Both
    issue one ``manager.allreduce`` per parameter and wait on each Work: :class:`CountedAllreduce`,
    installed as the manager's ``allreduce`` after the warm-up, counts each under the ring model (as
    Note [Peer bytes]) and, with ``--bandwidth``, returns a :class:`LinkHeldWork` whose ``wait()`` also
    waits until the link says its bytes have left (reserved when the all-reduce is issued, as DDP's hook
    does, Note [DDP bytes and link time]). The replica groups, lighthouse and warm-up are the DDP-style
    torchft's (:func:`torchft_replica`). A run's steps are per rank and equal on every rank (as DDP's),
    so every rank takes the same syncs; inner steps after the last sync (``steps % H``) stay local, and
    rank 0's accuracy is that of its own replica.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist
from linkemu import Link, complete_after
from torch import nn

from pyasync.demo.systems import ByteCount, Trainer

from .workload import PEER_KINDS, BenchConfig, make_optimizer

#: Steps of every peer in one hivemind epoch (one parameter-averaging round), see Note [hivemind in the
#: benchmark]: 16 steps of the 100 ms emulated device is 1.6 s of compute per round.
HIVEMIND_ROUND_STEPS = 16
#: hivemind's averager settings for a small local run (its docs: matchmaking 3-5 s, request timeout below it).
HIVEMIND_MATCHMAKING_S = 3.0
HIVEMIND_REQUEST_TIMEOUT_S = 1.0
HIVEMIND_AVERAGING_TIMEOUT_S = 30.0


def peer_status(kind: str) -> str | None:
    """None when the library of the peer ``kind`` (hivemind; torchft for "torchft", "torchft-diloco" and
    "torchft-localsgd") imports here, else why not (one line)."""
    if kind not in PEER_KINDS:
        raise ValueError(f"unknown peer kind {kind!r}")
    if kind != "hivemind":
        # torchft's Rust side logs every quorum at info, reading RUST_LOG when torchft is imported: set
        # here, in the parent, before any (spawned) worker imports it.
        os.environ.setdefault("RUST_LOG", "warn")
    try:
        if kind == "hivemind":
            import hivemind  # noqa: F401
        else:
            import torchft  # noqa: F401
    except ImportError as e:
        return f"{type(e).__name__}: {e} (make the peers' venv: bash bench/peers/setup.sh)"
    except Exception as e:  # a broken install: say what broke
        return f"{type(e).__name__}: {e}"
    return None


def torchft_manager(
    model: nn.Module,
    sgd: torch.optim.Optimizer,
    timeout: datetime.timedelta,
    min_replicas: int,
    store_port: int,
    lighthouse_addr: str,
    replica_id: str,
    heartbeat_interval: datetime.timedelta | None = None,
    use_async_quorum: bool = True,
):
    """A torchft Manager for a replica group of one rank (gloo, every wait bounded by ``timeout``) whose
    state is ``model`` and ``sgd``; the group's store serves on ``store_port`` of this host.
    ``use_async_quorum=False`` makes ``start_quorum`` wait for the quorum (what DiLoCo requires)."""
    import torchft

    kw = {} if heartbeat_interval is None else {"heartbeat_interval": heartbeat_interval}
    return torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timeout),
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), sgd.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": sgd.state_dict()},
        min_replica_size=min_replicas,
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store_port,
        lighthouse_addr=lighthouse_addr,
        replica_id=replica_id,
        hostname="127.0.0.1",
        init_sync=False,  # every replica starts from the same seeded model (torchft's advice)
        use_async_quorum=use_async_quorum,
        **kw,
    )


# ---------------------------------------------------------------------------------------------------
# Socket bytes of a process's TCP connections (hivemind's p2pd)
# ---------------------------------------------------------------------------------------------------


def descendants(pid: int) -> dict[int, str]:
    """``{pid: comm}`` of every live descendant of ``pid``, read from /proc (Linux; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    comm: dict[int, str] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return {}
    for e in entries:
        try:
            with open(f"/proc/{e}/stat", encoding="utf-8", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) < 2 or fields[0] == "Z":
            continue
        comm[int(e)] = stat[stat.find("(") + 1 : stat.rfind(")")]
        children.setdefault(int(fields[1]), []).append(int(e))
    out: dict[int, str] = {}
    todo = list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out[p] = comm[p]
        todo.extend(children.get(p, []))
    return out


_SS_USERS = re.compile(r"pid=(\d+)")
_SS_SENT = re.compile(r"\bbytes_sent:(\d+)")


def parse_ss_bytes_sent(text: str, pids: set[int]) -> dict[str, int]:
    """``{socket: bytes_sent}`` of the TCP sockets owned by ``pids`` in the output of ``ss -tinpH``
    (one line per socket, its ``-i`` details on the following indented line). A socket is named by its
    local and peer addresses."""
    out: dict[str, int] = {}
    owner: str | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():  # a socket line: state recv-q send-q local peer users:(...)
            cols = line.split()
            owned = {int(p) for p in _SS_USERS.findall(line)}
            owner = f"{cols[3]}>{cols[4]}" if len(cols) >= 5 and owned & pids else None
            m = _SS_SENT.search(line)  # some ss versions print the details on the same line
            if owner is not None and m:
                out[owner] = int(m.group(1))
                owner = None
        elif owner is not None:
            m = _SS_SENT.search(line)
            out[owner] = int(m.group(1)) if m else 0
            owner = None
    return out


def socket_bytes_sent(pids: set[int]) -> dict[str, int] | None:
    """``{socket: bytes_sent}`` of the TCP sockets of ``pids`` now; None where ``ss`` is missing."""
    ss = shutil.which("ss")
    if ss is None or not pids:
        return None
    res = subprocess.run([ss, "-tinpH"], capture_output=True, text=True, timeout=30, check=True)
    return parse_ss_bytes_sent(res.stdout, pids)


class SocketBytes(ByteCount):
    """The bytes the TCP sockets of this process's ``p2pd`` descendants sent between :meth:`start` and
    :meth:`stop` (Note [Peer bytes]); ``bytes_sent`` is None-free: 0 until stopped."""

    def __init__(self, world: int, comm: str = "p2pd") -> None:
        super().__init__(world)
        self.comm = comm
        self.pids: set[int] = set()
        self.at_start: dict[str, int] = {}
        self.available = True

    def _read(self) -> dict[str, int] | None:
        self.pids = {p for p, c in descendants(os.getpid()).items() if c == self.comm}
        return socket_bytes_sent(self.pids)

    def start(self) -> None:
        now = self._read()
        self.available = now is not None
        self.at_start = now or {}

    def stop(self) -> None:
        now = self._read() if self.available else None
        if now is None:
            self.available = False
            return
        self.bytes_sent = float(sum(v - self.at_start.get(k, 0) for k, v in now.items()))
        self.buckets = len(now)


# ---------------------------------------------------------------------------------------------------
# hivemind
# ---------------------------------------------------------------------------------------------------


def _wait_for_swarm(dht: Any, run_id: str, rank: int, workers: int, timeout_s: float) -> None:
    """Announce this peer in the DHT and wait (bounded) until every peer's announcement is visible here,
    i.e. until this peer's DHT reaches all the others. (hivemind's progress records would do, but a peer
    publishes one only once it has accumulated samples.)"""
    from hivemind.utils import get_dht_time

    key = f"{run_id}_ready"
    deadline = time.monotonic() + timeout_s
    seen: set[Any] = set()
    while True:
        dht.store(key, subkey=rank, value=True, expiration_time=get_dht_time() + timeout_s)
        found = dht.get(key, latest=True)
        seen = set(found.value) if found is not None and isinstance(found.value, dict) else set()
        if len(seen) >= workers:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"hivemind: rank {rank} saw peers {sorted(seen)} of {workers} after {timeout_s:.0f} s"
            )
        time.sleep(0.1)  # the others announce themselves in their own time; nothing to wait on here


def hivemind_trainer(cfg: BenchConfig, model: nn.Module, rank: int, store: dist.Store) -> Trainer:
    """``hivemind.Optimizer`` in its asynchronous mode for ``model``; rank 0 starts the DHT on loopback and
    the others join it. See Note [hivemind in the benchmark]. Returns when every peer sees the others."""
    # hivemind's DHT and averagers must be forked (they pickle locks when spawned); this process is a
    # fresh spawned worker, so forking it is what a plain hivemind script does.
    multiprocessing.set_start_method("fork", force=True)
    import hivemind

    round_steps = cfg.system.peer_round or HIVEMIND_ROUND_STEPS
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    host = ["/ip4/127.0.0.1/tcp/0"]
    if rank == 0:
        dht = hivemind.DHT(host_maddrs=host, start=True)
        peers = [str(a) for a in dht.get_visible_maddrs()]
        run_id = f"pyasync-{uuid.uuid4().hex[:12]}"
        store.set("hivemind", json.dumps({"peers": peers, "run_id": run_id}))
    else:
        store.wait(["hivemind"], timeout)
        info = json.loads(store.get("hivemind"))
        run_id = info["run_id"]
        dht = hivemind.DHT(host_maddrs=host, initial_peers=info["peers"], start=True)
    opt = hivemind.Optimizer(
        dht=dht,
        run_id=run_id,
        batch_size_per_step=cfg.batch_size,
        target_batch_size=cfg.batch_size * cfg.workers * round_steps,
        params=model.parameters(),
        optimizer=lambda params: make_optimizer(cfg, params),
        use_local_updates=True,
        matchmaking_time=HIVEMIND_MATCHMAKING_S,
        averaging_timeout=HIVEMIND_AVERAGING_TIMEOUT_S,
        averager_opts={
            "target_group_size": cfg.workers,
            "min_group_size": 2,
            "request_timeout": HIVEMIND_REQUEST_TIMEOUT_S,
        },
        verbose=False,
    )
    _wait_for_swarm(dht, run_id, rank, cfg.workers, cfg.timeout_s)
    # How long hivemind.Optimizer.step takes on this rank (its local SGD step, progress reports, epoch
    # checks and averaging hand-offs): the per-step cost the tables' throughput includes.
    in_step = {"s": 0.0, "calls": 0}
    inner_step = opt.step

    def timed_step(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner_step(*args, **kwargs)
        finally:
            in_step["s"] += time.perf_counter() - t0
            in_step["calls"] += 1

    opt.step = timed_step
    counter = SocketBytes(cfg.workers)
    counter.start()

    def shutdown() -> None:
        counter.stop()  # after the end barrier: the bytes of the timed window
        opt.shutdown()
        dht.shutdown()

    trainer = Trainer(net=model, opt=opt, ddp_bytes=counter, shutdown=shutdown)
    trainer.peer_info = lambda: {  # type: ignore[attr-defined]
        "mode": "use_local_updates (parameter averaging every round)",
        "round_steps_per_peer": round_steps,
        "target_batch_size": cfg.batch_size * cfg.workers * round_steps,
        "matchmaking_time_s": HIVEMIND_MATCHMAKING_S,
        "request_timeout_s": HIVEMIND_REQUEST_TIMEOUT_S,
        "averaging_timeout_s": HIVEMIND_AVERAGING_TIMEOUT_S,
        "target_group_size": cfg.workers,
        "local_epoch": int(opt.local_epoch),
        "rank0_step_ms_mean": 1e3 * in_step["s"] / max(1, in_step["calls"]),
        "bytes": "p2pd TCP bytes_sent" if counter.available else None,
        "p2pd_sockets": counter.buckets,
    }
    return trainer


# ---------------------------------------------------------------------------------------------------
# torchft
# ---------------------------------------------------------------------------------------------------


def torchft_hook(state, bucket):  # no annotations: DDP checks them against its own types
    """torchft's DDP communication hook (``torchft.ddp.DistributedDataParallel._comm_hook``: the
    manager's fault-tolerant all-reduce of the bucket), counted like DDP's and held for its wire time on
    the emulated link (Note [Peer bytes], Note [Peers and the link])."""
    buf = bucket.buffer()
    sent = state.count(buf.numel() * buf.element_size())
    work = state.manager.allreduce(buf)
    work.wait()
    fut = work.get_future()._fut
    if state.link is not None:
        fut = complete_after(fut, state.link.reserve(round(sent)))
    return fut


class TorchftComm(ByteCount):
    """State of :func:`torchft_hook`: the manager, the bytes this rank sent, the link."""

    def __init__(self, manager: Any, world: int, link: Link | None) -> None:
        super().__init__(world)
        self.manager = manager
        self.link = link


@dataclasses.dataclass
class TorchftReplica:
    """One rank's torchft set-up, a replica group of one (:func:`torchft_replica`): its ``manager``, the
    group's own TCP store (kept here so that it lives as long as the manager) and, on rank 0, the
    ``lighthouse``."""

    manager: Any
    group_store: dist.TCPStore
    lighthouse: Any = None

    def shutdown(self) -> None:
        """Stop the manager and (rank 0) the lighthouse: after the run's end barrier, so no replica still
        asks for a quorum."""
        self.manager.shutdown(wait=False)
        if self.lighthouse is not None:
            self.lighthouse.shutdown()


def torchft_replica(
    cfg: BenchConfig,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    rank: int,
    store: dist.Store,
    use_async_quorum: bool = True,
) -> TorchftReplica:
    """This rank as a torchft replica group of one: rank 0 starts the lighthouse (in process,
    ``min_replicas`` = every rank) and publishes its address in ``store``; every rank hosts its group's
    TCP store and builds a :func:`torchft_manager` whose state is ``model`` and ``opt``. Returns after a
    warm-up quorum and all-reduce (the gloo rendezvous of the first quorum, not timed) has committed.
    Every wait is bounded by ``cfg.timeout_s``."""
    from torchft.coordination import LighthouseServer

    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    lighthouse = None
    if rank == 0:
        # The lighthouse forms a quorum as soon as every replica that heartbeats has joined (all of them
        # here: min_replicas = workers); join_timeout only matters when one is missing.
        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=cfg.workers, join_timeout_ms=60_000)
        store.set("torchft", lighthouse.address())
    store.wait(["torchft"], timeout)
    lighthouse_addr = store.get("torchft").decode()
    # The replica group's own store (a group of one rank: this process hosts it).
    group_store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timeout, wait_for_workers=False)
    manager = torchft_manager(
        model,
        opt,
        timeout,
        cfg.workers,
        group_store.port,
        lighthouse_addr,
        f"pyasync_rank{rank}",
        use_async_quorum=use_async_quorum,
    )
    replica = TorchftReplica(manager=manager, group_store=group_store, lighthouse=lighthouse)
    # Warm-up: the first quorum configures the process group (a gloo rendezvous of all replicas).
    manager.start_quorum()
    manager.allreduce(torch.zeros(1)).wait()
    if not manager.should_commit():
        replica.shutdown()
        raise RuntimeError(f"torchft: rank {rank}'s warm-up step did not commit")
    return replica


def torchft_trainer(
    cfg: BenchConfig, model: nn.Module, rank: int, store: dist.Store, link: Link | None
) -> Trainer:
    """torchft for ``model``, DDP-style as its ``train_ddp.py`` example: every rank is a replica group of
    one, with a ``Manager`` (gloo ``ProcessGroupGloo`` on CPU) that joins a quorum of all
    ``cfg.workers`` replicas at the lighthouse (started by rank 0, in process) at every step;
    ``torchft.DistributedDataParallel``'s hook all-reduces the gradients and ``torchft.Optimizer``
    steps only when the manager commits. One warm-up quorum and all-reduce run before timing starts
    (:func:`torchft_replica`)."""
    import torchft
    from torchft.process_group import ProcessGroupDummy

    sgd = make_optimizer(cfg, model.parameters())  # SGD or AdamW (--optimizer), as every system
    replica = torchft_replica(cfg, model, sgd, rank, store)
    manager = replica.manager
    comm = TorchftComm(manager, cfg.workers, link)
    # torchft.DistributedDataParallel's construction with its hook swapped for the counted one above.
    net = nn.parallel.DistributedDataParallel(
        model, process_group=ProcessGroupDummy(0, 1), find_unused_parameters=True
    )
    net.register_comm_hook(comm, torchft_hook)
    opt = torchft.Optimizer(manager, sgd)

    trainer = Trainer(net=net, opt=opt, ddp_bytes=comm, shutdown=replica.shutdown)
    trainer.peer_info = lambda: {  # type: ignore[attr-defined]
        "min_replica_size": cfg.workers,
        "process_group": "torchft.ProcessGroupGloo",
        "bytes": "ring model of the all-reduced buckets, as DDP",
        "committed_steps": int(manager.current_step()),
        "batches_committed": int(manager.batches_committed()),
    }
    return trainer


# ---------------------------------------------------------------------------------------------------
# torchft's local steps: DiLoCo and LocalSGD (torchft.local_sgd)
# ---------------------------------------------------------------------------------------------------


class LinkHeldWork:
    """A torchft all-reduce's Work whose ``wait()`` also returns no earlier than monotonic time ``at``,
    when the emulated link says this rank's bytes of it have left (Note [torchft's local steps]).
    ``get_future()`` is the all-reduce's own: torchft's local steps wait on the Work."""

    def __init__(self, work: Any, at: float) -> None:
        self.work = work
        self.at = at

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        done = self.work.wait() if timeout is None else self.work.wait(timeout)
        left = self.at - time.monotonic()
        if left > 0:
            time.sleep(left)  # the wire time of bytes already reserved: finite, set by the link
        return done

    def get_future(self) -> Any:
        return self.work.get_future()


class CountedAllreduce(ByteCount):
    """``manager.allreduce`` counted under the ring model, as DDP's buckets are (Note [Peer bytes]), and
    with a link held for its wire time: installed as the manager's ``allreduce``, which torchft's
    DiLoCo and LocalSGD call once per parameter at every sync (Note [torchft's local steps])."""

    def __init__(self, manager: Any, world: int, link: Link | None) -> None:
        super().__init__(world)
        self.allreduce = manager.allreduce  # the manager's own (bound) method
        self.link = link

    def __call__(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sent = self.count(tensor.numel() * tensor.element_size())
        work = self.allreduce(tensor, *args, **kwargs)
        if self.link is None:
            return work
        return LinkHeldWork(work, self.link.reserve(round(sent)))


def torchft_local_trainer(
    cfg: BenchConfig, model: nn.Module, rank: int, store: dist.Store, link: Link | None
) -> Trainer:
    """torchft's local steps for ``model`` (Note [torchft's local steps]): ``torchft.local_sgd.DiLoCo``
    (``cfg.system.kind`` "torchft-diloco": ``peer_round`` inner steps of ``cfg``'s optimizer, then an
    outer Nesterov SGD step on the averaged pseudo-gradients) or ``LocalSGD`` ("torchft-localsgd":
    parameters averaged every ``peer_round`` steps), entered around the training loop as torchft's
    examples do (``with DiLoCo(...)``: here entered now and exited by the trainer's ``shutdown``).
    Every rank is a replica group of one (:func:`torchft_replica`)."""
    from torchft.local_sgd import DiLoCo, LocalSGD

    system = cfg.system
    diloco = system.kind == "torchft-diloco"
    inner = make_optimizer(cfg, model.parameters())  # SGD or AdamW (--optimizer), as every system
    # DiLoCo requires a synchronous quorum (it raises otherwise); LocalSGD runs with torchft's default.
    replica = torchft_replica(cfg, model, inner, rank, store, use_async_quorum=not diloco)
    manager = replica.manager
    comm = CountedAllreduce(manager, cfg.workers, link)  # after the warm-up: only the syncs are counted
    manager.allreduce = comm
    inner_steps = [0]

    def count_inner_step(*_: Any) -> None:
        inner_steps[0] += 1

    stack = contextlib.ExitStack()
    stack.callback(replica.shutdown)  # last: after the algorithm's hooks are gone
    stack.callback(inner.register_step_post_hook(count_inner_step).remove)
    try:
        if diloco:
            mu = system.outer_momentum
            outer = torch.optim.SGD(model.parameters(), lr=system.outer_lr, momentum=mu, nesterov=mu > 0)
            algo = DiLoCo(manager, [model], inner, outer, sync_every=system.peer_round)
        else:
            algo = LocalSGD(manager, model, inner, sync_every=system.peer_round)
        stack.enter_context(algo)
    except BaseException:
        stack.close()
        raise

    trainer = Trainer(net=model, opt=inner, ddp_bytes=comm, shutdown=stack.close)
    trainer.peer_info = lambda: {  # type: ignore[attr-defined]
        "algorithm": f"torchft.local_sgd.{type(algo).__name__}",
        "sync_every": system.peer_round,
        "inner_optimizer": type(inner).__name__,
        **(
            {
                "outer_optimizer": f"SGD(nesterov={system.outer_momentum > 0})",
                "outer_lr": system.outer_lr,
                "outer_momentum": system.outer_momentum,
            }
            if diloco
            else {}
        ),
        "use_async_quorum": not diloco,
        "min_replica_size": cfg.workers,
        "process_group": "torchft.ProcessGroupGloo",
        "bytes": "ring model of the all-reduced " + ("pseudo-gradients" if diloco else "parameters"),
        "allreduces": comm.buckets,
        "inner_steps": inner_steps[0],
        "inner_steps_since_last_sync": inner_steps[0] % system.peer_round,
        "committed_steps": int(manager.current_step()),  # the warm-up's, then one per committed sync
        "syncs_committed": int(manager.current_step()) - 1,
    }
    return trainer
