"""The round state machine of one shard (pyasync/engine/core/round.py), driven directly: no threads, no
processes, no tensors. Each test is an exact event -> actions table for one policy."""

import pytest

from pyasync.engine.core.round import AggregateRound, Answer, Apply, PushRound, Release, Sum, Update
from pyasync.errors import ProtocolError
from pyasync.policy import ASP, BSP, SSP, Quorum

N = 3  # workers


def compact(actions):
    """Actions as short tuples: ("apply", item, lr) ("sum", item) ("update", mask) ("release", item)
    ("answer", ((w, clock), ...)) ("final", ((w, clock), ...))."""
    out = []
    for a in actions:
        if isinstance(a, Apply):
            out.append(("apply", a.item, a.lr_factor))
        elif isinstance(a, Sum):
            out.append(("sum", a.item))
        elif isinstance(a, Update):
            out.append(("update", a.mask))
        elif isinstance(a, Release):
            out.append(("release", a.item))
        elif isinstance(a, Answer):
            out.append(("final" if a.final else "answer", a.dests))
        else:
            raise AssertionError(a)
    return out


def run(rnd, table):
    """table: [(event, args, expected compact actions)]; events: push (w, clock, version[, finite, mask]),
    close (w), pause (w, on), depart (w), join (w, clock). Push items are named "w<w>c<clock>"."""
    for i, (event, args, want) in enumerate(table):
        if event == "push":
            w, clock, version, *rest = args
            finite = rest[0] if rest else True
            mask = rest[1] if len(rest) > 1 else (True,)
            got = rnd.push(w, clock, version, finite, mask, f"w{w}c{clock}")
        else:
            got = getattr(rnd, event)(*args)
        assert compact(got) == want, f"row {i}: {event}{args}: got {compact(got)}, want {want}"


def test_each_policy_picks_its_machine():
    assert isinstance(BSP().round(N, 1), AggregateRound)
    assert isinstance(Quorum(2).round(N, 1), AggregateRound)
    assert isinstance(SSP(1).round(N, 1), PushRound)
    assert isinstance(ASP().round(N, 1), PushRound)


def test_bsp_sums_in_rank_order_and_answers_everyone_after_one_update():
    r = BSP().round(N, 1)
    run(r, [
        ("push", (2, 0, 0), []),  # held: ranks 0 and 1 come first in the sum
        ("push", (0, 0, 0), [("sum", "w0c0")]),
        ("push", (1, 0, 0), [("sum", "w1c0"), ("sum", "w2c0"), ("update", (True,)),
                             ("answer", ((0, 0), (1, 0), (2, 0)))]),
        ("push", (1, 1, 1), []),
        ("push", (0, 1, 1), [("sum", "w0c1"), ("sum", "w1c1")]),
        ("push", (2, 1, 1), [("sum", "w2c1"), ("update", (True,)), ("answer", ((0, 1), (1, 1), (2, 1)))]),
    ])
    assert r.version == 2 and r.c.applied == 6 and r.c.updates == 2 and r.c.staleness == {0: 6}


def test_bsp_nonfinite_counts_as_zeros_and_masks_union():
    r = BSP().round(N, 2)
    run(r, [
        ("push", (0, 0, 0, True, (True, False)), [("sum", "w0c0")]),
        ("push", (1, 0, 0, False, (True, True)), [("release", "w1c0")]),  # NaN: never applied
        ("push", (2, 0, 0, True, (False, False)), [("sum", "w2c0"), ("update", (True, False)),
                                                   ("answer", ((0, 0), (1, 0), (2, 0)))]),
    ])
    assert r.c.nonfinite == 1 and r.c.applied == 2
    # Every push of a round non-finite: no update at all, but everyone is answered.
    r = BSP().round(2, 1)
    run(r, [
        ("push", (0, 0, 0, False), [("release", "w0c0")]),
        ("push", (1, 0, 0, False), [("release", "w1c0"), ("answer", ((0, 0), (1, 0)))]),
    ])
    assert r.version == 0 and r.c.updates == 0


def test_bsp_close_and_pause_release_a_waiting_round():
    r = BSP().round(N, 1)
    run(r, [
        ("push", (0, 0, 0), [("sum", "w0c0")]),
        ("close", (1,), []),  # closed early: zeros in the mean; 2 still to come
        ("pause", (2, True), [("update", (True,)), ("answer", ((0, 0),))]),  # 2 waits in a barrier
        ("pause", (2, False), []),
        ("push", (2, 0, 1), []),
        ("push", (0, 1, 1), [("sum", "w0c1"), ("sum", "w2c0"), ("update", (True,)),
                             ("answer", ((0, 1), (2, 0)))]),
        ("close", (0,), []),
        ("close", (2,), [("final", ((0, 1), (1, -1), (2, 0)))]),
    ])


def test_bsp_close_twice_and_out_of_order_pushes_are_protocol_errors():
    r = BSP().round(N, 1, name=7)
    r.close(1)
    with pytest.raises(ProtocolError, match="rank 1 closed twice"):
        r.close(1)
    with pytest.raises(ProtocolError, match="after its CLOSE"):
        r.push(1, 0, 0, True, (True,), "x")
    with pytest.raises(ProtocolError, match="clock 1, expected 0"):
        r.push(0, 1, 0, True, (True,), "x")
    with pytest.raises(ProtocolError, match="version 5"):
        r.push(0, 0, 5, True, (True,), "x")
    with pytest.raises(ProtocolError, match="2 mask entries, expected 1"):
        r.push(0, 0, 0, True, (True, True), "x")


@pytest.mark.parametrize("late", ["drop", "fold"])
def test_quorum_late_pushes_drop_or_fold(late):
    r = Quorum(2, late=late).round(N, 1)
    late_actions = [("sum", "w0c0")] if late == "fold" else [("release", "w0c0")]
    run(r, [
        ("push", (1, 0, 0), []),  # held for rank order: rank 0 may still push
        ("push", (2, 0, 0), [("sum", "w1c0"), ("sum", "w2c0"), ("update", (True,)),
                             ("answer", ((1, 0), (2, 0)))]),
        ("push", (0, 0, 0), [*late_actions, ("answer", ((0, 0),))]),  # superseded: answered at once
        ("push", (1, 1, 1), []),
        ("push", (2, 1, 1), [("sum", "w1c1"), ("sum", "w2c1"), ("update", (True,)),
                             ("answer", ((1, 1), (2, 1)))]),
    ])
    if late == "fold":
        assert r.c.staleness == {0: 4, 1: 1} and r.c.dropped == 0 and r.c.applied == 5
    else:
        assert r.c.staleness == {0: 4} and r.c.dropped == 1 and r.c.applied == 4


def test_quorum_with_fewer_than_k_live_workers_never_stalls():
    r = Quorum(3).round(N, 1)
    run(r, [
        ("close", (2,), []),
        ("push", (0, 0, 0), [("sum", "w0c0")]),
        ("push", (1, 0, 0), [("sum", "w1c0"), ("update", (True,)), ("answer", ((0, 0), (1, 0)))]),
        ("push", (0, 1, 1), [("sum", "w0c1")]),
        ("close", (1,), [("update", (True,)), ("answer", ((0, 1),))]),
        ("close", (0,), [("final", ((0, 1), (1, 0), (2, -1)))]),
    ])


def test_quorum_fold_left_over_at_close_is_applied_before_the_final_answer():
    r = Quorum(1, late="fold").round(2, 1)
    run(r, [
        ("push", (0, 0, 0), [("sum", "w0c0"), ("update", (True,)), ("answer", ((0, 0),))]),
        ("push", (1, 0, 0), [("sum", "w1c0"), ("answer", ((1, 0),))]),  # late, folded into the next
        ("close", (0,), []),
        ("close", (1,), [("update", (True,)), ("final", ((0, 0), (1, 0)))]),
    ])
    assert r.c.staleness == {0: 1, 1: 1}


def test_ssp_answers_wait_for_the_slowest():
    r = SSP(1).round(N, 1)
    run(r, [
        ("push", (1, 0, 0), [("apply", "w1c0", 1.0), ("answer", ((1, 0),))]),  # needs clocks <= -1
        ("push", (1, 1, 1), [("apply", "w1c1", 1.0)]),  # clock 1 needs every worker's clock 0
        ("push", (0, 0, 0), [("apply", "w0c0", 1.0), ("answer", ((0, 0),))]),
        ("push", (2, 0, 0), [("apply", "w2c0", 1.0), ("answer", ((1, 1), (2, 0)))]),
        ("close", (0,), []),
        ("close", (1,), []),
        ("close", (2,), [("final", ((0, 0), (1, 1), (2, 0)))]),
    ])
    assert r.version == 4 and r.c.staleness == {0: 2, 2: 1, 3: 1}
    assert r.missing(5) == []  # everyone closed


def test_ssp_inverse_lr_and_a_closed_worker_never_blocks():
    r = SSP(1, lr_scale="inverse").round(2, 1)
    run(r, [
        ("push", (0, 0, 0), [("apply", "w0c0", 1.0), ("answer", ((0, 0),))]),
        ("push", (0, 1, 1), [("apply", "w0c1", 1.0)]),  # clock 1 needs worker 1's clock 0
        ("push", (1, 0, 0), [("apply", "w1c0", 0.5), ("answer", ((0, 1), (1, 0)))]),  # 2 versions old
        ("push", (0, 2, 3), [("apply", "w0c2", 1.0)]),
    ])
    assert r.missing(2) == [1]
    run(r, [("close", (1,), [("answer", ((0, 2),))])])  # closed: never waited for again
    assert r.missing(2) == []


def test_asp_answers_at_once_and_skips_nonfinite():
    r = ASP().round(N, 1)
    run(r, [
        ("push", (2, 0, 0), [("apply", "w2c0", 1.0), ("answer", ((2, 0),))]),
        ("push", (0, 0, 0, False), [("release", "w0c0"), ("answer", ((0, 0),))]),
        ("pause", (1, True), []),
        ("pause", (1, False), []),
        ("close", (0,), []),
        ("close", (1,), []),
        ("close", (2,), [("final", ((0, 0), (1, -1), (2, 0)))]),
    ])
    assert r.c.nonfinite == 1 and r.version == 1 and r.finalized


def test_departure_releases_waits_and_a_rejoin_resumes_at_its_clock():
    r = BSP().round(N, 1)
    run(r, [
        ("push", (0, 0, 0), [("sum", "w0c0")]),
        ("push", (1, 0, 0), [("sum", "w1c0")]),
        ("depart", (2,), [("update", (True,)), ("answer", ((0, 0), (1, 0)))]),
        ("depart", (2,), []),  # idempotent
        ("join", (2, 1), []),
        ("push", (2, 1, 1), []),
    ])
    with pytest.raises(ProtocolError, match="without having departed"):
        r.join(0, 3)
    s = SSP(0).round(N, 1)
    run(s, [
        ("push", (0, 0, 0), [("apply", "w0c0", 1.0)]),
        ("push", (1, 0, 0), [("apply", "w1c0", 1.0)]),
        ("depart", (2,), [("answer", ((0, 0), (1, 0)))]),
        ("close", (0,), []),
        ("close", (1,), [("final", ((0, 0), (1, 0)))]),  # the departed worker gets no final answer
    ])
    with pytest.raises(ProtocolError, match="left the membership"):
        s.push(2, 0, 0, True, (True,), "x")


def test_local_steps_run_their_outer_policys_machine():
    """Local(H) is a policy like the others: its owners run the outer policy's round machine, with the
    same event -> action tables (a push is one outer step's change)."""
    from pyasync.policy import Local

    assert isinstance(Local(4).round(N, 1), AggregateRound)
    assert isinstance(Local(4, mode="quorum", k=2).round(N, 1), AggregateRound)
    assert isinstance(Local(4, mode="async").round(N, 1), PushRound)
    r = Local(4, mode="quorum", k=2).round(N, 1)
    run(r, [
        ("push", (1, 0, 0), []),
        ("push", (2, 0, 0), [("sum", "w1c0"), ("sum", "w2c0"), ("update", (True,)),
                             ("answer", ((1, 0), (2, 0)))]),
        ("push", (0, 0, 0), [("release", "w0c0"), ("answer", ((0, 0),))]),  # late: dropped
    ])
    a = Local(4, mode="async").round(N, 1)
    run(a, [
        ("push", (2, 0, 0), [("apply", "w2c0", 1.0), ("answer", ((2, 0),))]),
        ("push", (0, 0, 1), [("apply", "w0c0", 1.0), ("answer", ((0, 0),))]),
    ])


def test_the_gap_aware_penalty_rides_on_stale_pushes_only():
    """Note [Gap-aware penalty]: an Apply carries gap=True where the push is stale (a fresh push's gap
    is the look-ahead alone); the policy without it never sets it."""
    r = ASP(gap=True).round(N, 1)
    fresh = r.push(0, 0, 0, True, (True,), "w0c0")
    stale = r.push(1, 0, 0, True, (True,), "w1c0")  # computed on version 0, applied on version 1
    assert [a.gap for a in fresh if isinstance(a, Apply)] == [False]
    assert [a.gap for a in stale if isinstance(a, Apply)] == [True]
    plain = ASP().round(N, 1)
    plain.push(0, 0, 0, True, (True,), "w0c0")
    assert [a.gap for a in plain.push(1, 0, 0, True, (True,), "w1c0") if isinstance(a, Apply)] == [False]
