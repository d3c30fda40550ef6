"""Coded replies on the point-to-point path (Note [Compressed replies on the point-to-point path] in
pyasync/engine/core/replies.py): an owner sends each worker the change from what that worker holds, encoded
with the job's codec, and tracks what the worker decoded, bit for bit.

Oracles: the owner's and the worker's held values agree exactly after any sequence of replies (a unit
test over a loopback transport); BSP on this path sends the same changes as BSP on collectives, so the
two are bit-identical at every step; under SSP, ASP and Quorum every push is applied once (one-hot
ledger), close() ends every rank on the exact masters, and a load mid-run (the next reply is exact)
keeps replicas and masters together; int8 replies put under 0.3x of the fp32 replies' bytes on the sockets."""

from __future__ import annotations

import datetime

import pytest
import torch
from _dist import multiproc, run_workers

import pyasync
from pyasync.compression import from_spec
from pyasync.engine import wire
from pyasync.engine.core.replies import HeldValues, ReplyFrames
from pyasync.engine.core.shards import build_layout
from pyasync.transport.tcp import TcpTransport

TIMEOUT = datetime.timedelta(seconds=60)


# -- unit: owner and worker agree on what the worker holds ---------------------------------------------
class _Frame:
    def __init__(self, nbytes: int) -> None:
        self.buf = torch.zeros(nbytes, dtype=torch.uint8)
        self.views = None


class _Ring:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def take(self, timeout):
        return _Frame(self.nbytes)

    def drain(self, timeout) -> None:
        pass


class _Loopback:
    """Captures sent frames (a fresh frame per send, so earlier ones stay readable)."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, torch.Tensor]] = []

    def frame_ring(self, nbytes, device):
        return _Ring(nbytes)

    def send_frame(self, fr, dst, flow, nbytes=None) -> None:
        assert flow == "reply"
        self.sent.append((dst, fr.buf[:nbytes].clone()))


def _setup(codec: str, numel: int = 1000, world: int = 3):
    layout = build_layout([[0]], [numel], [0], world)[0]
    spec = wire.WireSpec.for_compressor(
        from_spec(codec),
        0,
        world,
        [[s.numel for s in layout.shards]],
        [[len(s.segments) for s in layout.shards]],
    )
    return layout, spec


@pytest.mark.parametrize("codec", ["int8", "topk:0.05", "sign", "fp16", "bf16"])
def test_owner_and_worker_hold_the_same_values(codec):
    torch.manual_seed(0)
    world, numel = 3, 1000
    layout, _ = _setup(codec, numel, world)
    owner_rank, worker = 1, 0
    sh = layout.shards[owner_rank]
    param = torch.randn(numel)
    spec = wire.WireSpec.for_compressor(
        from_spec(codec),
        worker,
        world,
        [[s.numel for s in layout.shards]],
        [[len(s.segments) for s in layout.shards]],
    )
    master = param[sh.begin : sh.end].clone()
    tp = _Loopback()
    frames = ReplyFrames(
        rank=owner_rank,
        world_size=world,
        transport=tp,
        compressor=from_spec(codec),
        timeout=TIMEOUT,
        masters={0: master.clone()},
    )
    held = HeldValues([param], [layout], [(0, owner_rank)])
    clocks = torch.zeros(world, dtype=torch.int64)
    coded = exact = 0
    for t in range(40):
        master += 0.01 * torch.randn(sh.numel)
        if t == 20:
            master.copy_(torch.randn(sh.numel))  # a load: the owner forgets, the next reply is exact
            frames.forget(0)
        final = t == 39
        frames.send(0, worker, t, t + 1, master, clocks, final)
        dst, buf = tp.sent[-1]
        assert dst == worker
        h = wire.frame_header(buf, owner_rank)
        spec.check_reply(h)
        assert h.final == final
        values, got_clocks = held.take(h, wire.frame_body(buf, h))
        assert got_clocks == [0] * world
        if h.codec == 0:
            exact += 1
            assert torch.equal(values, master)
        else:
            coded += 1
            # what the owner thinks the worker holds is what the worker holds, bit for bit
            assert torch.equal(frames.held[(0, worker)], values), f"step {t}"
            assert h.nbytes < 4 * sh.numel
    assert exact == 2 and coded == 38  # after the load, and the FINAL reply
    assert torch.equal(held.values[(0, owner_rank)], master)  # the run ends on the master


def test_error_feedback_keeps_the_held_values_close():
    """A fixed master, replies again and again: int8's error shrinks by its ratio each reply; top-k's
    sends the largest remaining differences, so the held values converge to the master."""
    world, numel = 2, 4096
    layout, _ = _setup("topk:0.1", numel, world)
    sh = layout.shards[1]
    for codec, replies in (("int8", 3), ("topk:0.1", 12)):
        param = torch.zeros(numel)
        master = torch.randn(sh.numel)
        frames = ReplyFrames(
            rank=1,
            world_size=world,
            transport=_Loopback(),
            compressor=from_spec(codec),
            timeout=TIMEOUT,
            masters={0: torch.zeros(sh.numel)},
        )
        held = HeldValues([param], [layout], [(0, 1)])
        clocks = torch.zeros(world, dtype=torch.int64)
        for t in range(replies):
            frames.send(0, 0, t, t + 1, master, clocks, False)
            buf = frames.transport.sent[-1][1]
            h = wire.frame_header(buf, 1)
            held.take(h, wire.frame_body(buf, h))
        err = (held.values[(0, 1)] - master).abs().max().item()
        assert err < 1e-3 * master.abs().max().item(), f"{codec}: {err}"


def test_a_coded_reply_with_the_wrong_parameters_is_refused():
    layout, spec = _setup("int8")
    sh = layout.shards[1]
    h = wire.Header(
        kind=wire.REPLY,
        sender=1,
        clock=0,
        version=1,
        bucket=0,
        shard=1,
        codec=wire.CODEC_IDS["int8"],
        numel=sh.numel,
        nbytes=spec.coded_reply_bytes(sh.numel),
        k=0,
        block=spec.block,
        flags=wire.FLAG_FINITE,
        count=3,
    )
    spec.check_reply(h)
    with pytest.raises(wire.WireError, match="block/k"):
        spec.check_reply(_edit(h, block=64))
    with pytest.raises(wire.WireError, match="agreed codec int8"):
        spec.check_reply(_edit(h, codec=wire.CODEC_IDS["fp16"]))
    with pytest.raises(wire.WireError, match="payload bytes"):
        spec.check_reply(_edit(h, nbytes=h.nbytes + 8))


def _edit(h, **kw):
    import dataclasses

    return dataclasses.replace(h, **kw)


# -- multi-process ----------------------------------------------------------------------------------------
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 32))


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _bsp(rank, world, policy, codec):
    model = _model()
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        policy=policy,
        compression=codec,
        bucket_cap_mb=0.01,
        timeout=TIMEOUT,
    )
    g = torch.Generator().manual_seed(10 + rank)
    per_step = []
    for _ in range(8):
        x, y = torch.randn(32, 64, generator=g), torch.randn(32, 32, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        per_step.append(_flat(model))
    masters = opt.engine.shards.masters()
    gap = max(_own_gap(opt, model, b, m, rank) for b, m in masters.items())
    st = opt.stats()
    opt.close()
    return {"per_step": per_step, "final": _flat(model), "bytes": st.bytes_sent, "gap": gap}


def _own_gap(opt, model, b, master, rank) -> float:
    """Largest |parameter - master| over this rank's shard of bucket b."""
    params, lay = list(model.parameters()), opt.bucket_layouts[b]
    vals = torch.cat([params[i].detach().reshape(-1) for i in lay.params])
    sh = lay.shards[rank]
    return (vals[sh.begin : sh.end] - master.reshape(-1)).abs().max().item()


@multiproc
@pytest.mark.parametrize("codec", ["int8", "topk:0.1"])
def test_bsp_p2p_with_coded_replies_equals_bsp_on_collectives(codec):
    world = 3
    p2p = run_workers(_bsp, world, args=("bsp:p2p", codec), timeout=240)
    coll = run_workers(_bsp, world, args=("bsp", codec), timeout=240)
    for r in range(world):
        for t in range(8):
            assert torch.equal(p2p[r]["per_step"][t], coll[r]["per_step"][t]), f"rank {r} step {t}"
        assert torch.equal(p2p[r]["final"], coll[0]["final"])
    assert max(r["gap"] for r in p2p) > 0, "the replies were not coded (the workers held the masters)"


def _async(rank, world, policy, codec, load_at):
    """Pushes of one-hot gradients: the master moves by exactly -lr per push, so the sum of every
    push applied is known; a load mid-run checks the exact reply after it."""
    torch.manual_seed(0)
    n = 600
    p = torch.nn.Parameter(torch.zeros(n))
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD([p], lr=1.0), policy=policy, compression=codec, timeout=TIMEOUT
    )
    steps, saved = 12, {}
    for t in range(steps):
        if t == load_at:
            opt.load_state_dict(saved["state"])
        opt.zero_grad()
        g = torch.zeros(n)
        g[(rank * steps + t) % n] = 1.0
        p.grad = g
        opt.step()
        if t == 2:
            saved["state"] = opt.state_dict()
    st = opt.stats()
    opt.close()
    return {
        "p": p.detach().clone(),
        "applied": st.pushes_applied,
        "bytes": st.bytes_sent,
        "divisor": opt.policy.divisor(world),
    }


@multiproc
@pytest.mark.parametrize("policy", ["ssp:1", "asp", "quorum:2"])
def test_coded_replies_end_on_the_masters_and_lose_no_push(policy):
    world = 3
    res = run_workers(_async, world, args=(policy, "int8", -1), timeout=240)
    final = res[0]["p"]
    for r in range(1, world):
        assert torch.equal(res[r]["p"], final), f"rank {r} did not end on the masters"
    if policy != "quorum:2":  # Quorum may drop a late push (counted in stats)
        want = torch.zeros_like(final)
        for r in range(world):
            for t in range(12):
                want[(r * 12 + t) % want.numel()] -= 1.0 / res[0]["divisor"]  # each push: lr x g / n
        # int8 pushes of a one-hot gradient are exact (the block's scale is 1/127 of the 1)
        torch.testing.assert_close(final, want, rtol=0, atol=1e-5)


@multiproc
def test_a_load_mid_run_makes_the_next_reply_exact():
    world = 3
    res = run_workers(_async, world, args=("asp", "int8", 6), timeout=240)
    for r in range(1, world):
        assert torch.equal(res[r]["p"], res[0]["p"])


class _CountingTcp(TcpTransport):
    """The TCP transport, counting the bytes each send really puts on its socket (the length prefix
    aside), per flow."""

    def __init__(self, group, timeout) -> None:
        super().__init__(group, timeout)
        self.wire_bytes = {"push": 0, "reply": 0}

    def send(self, buf, dst, flow):
        self.wire_bytes[flow] = self.wire_bytes.get(flow, 0) + buf.numel() * buf.element_size()
        return super().send(buf, dst, flow)


def _on_the_wire(rank, world, codec):
    model = _model()
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        policy="asp",
        compression=codec,
        bucket_cap_mb=0.01,
        timeout=TIMEOUT,
        transport=_CountingTcp,
    )
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(6):
        x, y = torch.randn(32, 64, generator=g), torch.randn(32, 32, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    opt.barrier()  # every reply of the steps has gone out
    steps = dict(opt.engine.transport.wire_bytes)
    opt.close()  # its CLOSE frames and FINAL (exact) replies are counted too
    return {"counted": opt.stats().bytes_sent, "wire": dict(opt.engine.transport.wire_bytes), "steps": steps}


@multiproc
def test_the_socket_carries_what_the_stats_count():
    """A coded reply goes out as its header and payload, not as the (exact-sized) frame it was written
    into; the stats count exactly what the sockets carry."""
    world = 3
    plain = run_workers(_on_the_wire, world, args=("none",), timeout=240)
    int8 = run_workers(_on_the_wire, world, args=("int8",), timeout=240)
    for r in range(world):
        for res in (plain[r], int8[r]):
            assert sum(res["wire"].values()) == res["counted"], res
        ratio = int8[r]["steps"]["reply"] / plain[r]["steps"]["reply"]  # the steps' replies, not close()'s
        assert ratio < 0.3, f"rank {r}: int8 replies put {ratio:.3f}x the fp32 replies' bytes on the socket"


@multiproc
@pytest.mark.parametrize("policy", ["bsp", "bsp:p2p"])
def test_replies_0_compresses_only_the_pushes(policy):
    """``int8(replies=0)``: the pushes are int8, the replies exact fp32 values (the parameters are the
    masters after every step), and the bytes are between the coded and the uncompressed runs'."""
    world = 3
    exact = run_workers(_bsp, world, args=(policy, "int8(replies=0)"), timeout=240)
    coded = run_workers(_bsp, world, args=(policy, "int8"), timeout=240)
    for r in range(world):
        assert exact[r]["gap"] == 0.0, f"rank {r}: the replies were not exact"
        assert torch.equal(exact[r]["final"], exact[0]["final"])
        assert exact[r]["bytes"] > 2 * coded[r]["bytes"]
    assert max(r["gap"] for r in coded) > 0
