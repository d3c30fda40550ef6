"""An owner's appliers carrying out their rounds' actions, driven directly (no processes, no threads):
the values the updates produce, who is answered, what is dropped, folded or skipped. The decisions
themselves are tested action by action in test_round.py."""

import pytest
import torch

from pyasync.engine import wire
from pyasync.engine.core.rule import UpdateRule
from pyasync.engine.core.shards import build_layout
from pyasync.engine.p2p.applier import Applier
from pyasync.engine.p2p.messages import Push
from pyasync.engine.p2p.owner import Owner
from pyasync.errors import ProtocolError
from pyasync.ops._common import Payload
from pyasync.policy import ASP, BSP, SSP, Quorum
from pyasync.transport.base import Handle, Transport

N = 3  # workers; this is rank 0, owning shard 0 (2 elements) of one bucket of 6


class Done(Handle):
    def done(self):
        return True

    def wait(self, timeout):
        pass


class FakeTransport(Transport):
    rank, world_size = 0, N

    def __init__(self):
        self.sent = []  # (dst, flow, header or None)

    def send(self, buf, dst, flow, sub=0):
        h = wire.frame_header(buf, 0) if flow == "reply" else None
        self.sent.append((dst, flow, h))
        return Done()

    def recv(self, buf, src, flow, sub=0, timeout=None):
        raise AssertionError("not used")

    def recv_any(self, buf, flow):
        raise AssertionError("not used")

    def close(self):
        pass


def make_owner(policy):
    layouts = build_layout([[0]], [6], [0], N)
    p = torch.nn.Parameter(torch.zeros(6))
    rule = UpdateRule(torch.optim.SGD([p], lr=1.0))
    spec = wire.WireSpec(0, N, [[2, 2, 2]], [[1, 1, 1]], "none", 0)
    local, tp = [], FakeTransport()
    errors = []
    owner = Owner(
        rank=0,
        world_size=N,
        layouts=layouts,
        masters={0: torch.zeros(2)},
        policy=policy,
        rule=rule,
        transport=tp,
        spec=spec,
        deliver_local=local.append,
        fail=lambda w, e: errors.append(e),
    )
    ap = owner.appliers[0]
    assert isinstance(ap, Applier)
    return owner, ap, ap.shards[0], local, tp


def push(owner, ap, sh, w, clock, version, grad=1.0, finite=True, mask=True):
    pl = Payload("none", 2, torch.full((2,), -grad), finite=finite)  # gradient -grad: SGD adds +grad*scale
    msg = Push(0, w, clock, version, pl, (mask,))
    ap._do(sh, sh.round.push(w, clock, version, finite, (mask,), msg))


def close(ap, sh, w):
    ap._do(sh, sh.round.close(w))


def answered(tp, local):
    return sorted([(d, h.clock) for d, f, h in tp.sent if f == "reply"] + [(0, r.clock) for r in local])


def test_bsp_one_update_per_clock_then_everyone_is_answered():
    owner, ap, s, local, tp = make_owner(BSP())
    push(owner, ap, s, 1, 0, 0, grad=3.0)
    push(owner, ap, s, 2, 0, 0, grad=6.0)
    assert s.round.version == 0 and answered(tp, local) == []
    push(owner, ap, s, 0, 0, 0, grad=9.0)
    assert s.round.version == 1 and torch.equal(s.state.master, torch.full((2,), 6.0))  # mean of 3, 6, 9
    assert answered(tp, local) == [(0, 0), (1, 0), (2, 0)]
    assert s.round.c.applied == 3 and s.round.c.staleness == {0: 3} and s.round.c.updates == 1


def test_bsp_unused_parameter_and_nan_push():
    owner, ap, s, local, tp = make_owner(BSP())
    # A worker without a gradient for a parameter sends zeros for it and a has-grad mask of 0.
    push(owner, ap, s, 0, 0, 0, grad=0.0, mask=False)
    push(owner, ap, s, 1, 0, 0, grad=float("nan"), finite=False)
    push(owner, ap, s, 2, 0, 0, grad=0.0, mask=False)
    # Nobody had a gradient for the parameter (masks), the NaN push was skipped: no change at all.
    assert torch.equal(s.state.master, torch.zeros(2)) and s.round.c.nonfinite == 1
    assert answered(tp, local) == [(0, 0), (1, 0), (2, 0)]
    push(owner, ap, s, 0, 1, 0, grad=3.0)
    push(owner, ap, s, 1, 1, 0, grad=0.0, mask=False)
    push(owner, ap, s, 2, 1, 0, grad=float("inf"), finite=False)
    assert torch.equal(s.state.master, torch.full((2,), 1.0))  # (3 + 0 + 0) / 3: the others count as zeros


def test_quorum_drop_and_fold():
    for late, want_dropped in (("drop", 1), ("fold", 0)):
        owner, ap, s, local, tp = make_owner(Quorum(2, late=late))
        push(owner, ap, s, 1, 0, 0, grad=2.0)
        push(owner, ap, s, 2, 0, 0, grad=4.0)
        assert s.round.version == 1 and torch.equal(s.state.master, torch.full((2,), 3.0))
        assert answered(tp, local) == [(1, 0), (2, 0)]
        push(owner, ap, s, 0, 0, 0, grad=8.0)  # computed on version 0, which is superseded
        assert (0, 0) in answered(tp, local)  # answered at once with the newest version
        assert s.round.c.dropped == want_dropped
        push(owner, ap, s, 1, 1, 1, grad=2.0)
        push(owner, ap, s, 2, 1, 1, grad=2.0)
        want = 3.0 + 2.0 + (4.0 if late == "fold" else 0.0)  # folded: 8 / k added to the next update
        assert torch.equal(s.state.master, torch.full((2,), want)), s.state.master
        if late == "fold":
            assert s.round.c.staleness == {0: 4, 1: 1}


def test_ssp_answers_wait_for_the_slowest():
    owner, ap, s, local, tp = make_owner(SSP(1))
    push(owner, ap, s, 1, 0, 0)
    assert answered(tp, local) == [(1, 0)]  # needs everyone's clock <= -1: nothing
    push(owner, ap, s, 1, 1, 1)
    assert answered(tp, local) == [(1, 0)]  # clock 1 needs every worker's clock 0
    push(owner, ap, s, 0, 0, 0)
    assert answered(tp, local) == [(0, 0), (1, 0)]
    push(owner, ap, s, 2, 0, 0)
    assert answered(tp, local) == [(0, 0), (1, 0), (1, 1), (2, 0)]
    assert s.round.version == 4 and s.round.c.staleness == {0: 2, 2: 1, 3: 1}
    assert torch.allclose(s.state.master, torch.full((2,), 4 / 3))  # each push moves 1/n


def test_asp_and_close_finalize():
    owner, ap, s, local, tp = make_owner(ASP())
    push(owner, ap, s, 2, 0, 0)
    assert answered(tp, local) == [(2, 0)]
    for w in range(N):
        close(ap, s, w)
    finals = [(d, h.final) for d, f, h in tp.sent if f == "reply" and h.final] + [
        (0, r.final) for r in local
    ]
    assert sorted(finals) == [(0, True), (1, True), (2, True)] and s.round.finalized


@pytest.mark.parametrize("clock, version, match", [(1, 0, "clock 1, expected 0"), (0, 5, "version 5")])
def test_out_of_order_pushes_are_rejected(clock, version, match):
    owner, ap, s, _local, _tp = make_owner(SSP(0))
    with pytest.raises(ProtocolError, match=match):
        push(owner, ap, s, 1, clock, version)
