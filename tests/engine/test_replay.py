"""Replaying a dead owner's pushes (engine/p2p/replay.py) and the clocks answers reflect (Note [Reflected
clocks] in engine/core/round.py): in-process, no network. The multi-process ledger with real kills is in
tests/faults/test_membership.py."""

import pytest
import torch

from pyasync.engine import wire
from pyasync.engine.core.rule import UpdateRule
from pyasync.engine.core.shards import build_layout
from pyasync.engine.p2p.replay import Retention, replay
from pyasync.errors import ProtocolError
from pyasync.ops._common import CODEC_IDS, Payload
from pyasync.policy import ASP, BSP, Quorum

N, WORLD, OWNER = 3, 3, 1  # shard 1 (3 elements) of a 9-element bucket, 3 workers


def _layout():
    return build_layout([[0]], [N * WORLD], [0], WORLD)[0].shards[OWNER]


def _spec():
    return wire.WireSpec(
        rank=OWNER,
        world_size=WORLD,
        shard_numels=[[N] * WORLD],
        mask_lens=[[1] * WORLD],
        codec="none",
        block=0,
    )


def _frame(sender: int, clock: int, version: int, g, *, bucket: int = 0, finite: bool = True):
    payload = Payload("none", N, torch.tensor(g, dtype=torch.float32))
    h = wire.Header(
        kind=wire.PUSH,
        sender=sender,
        clock=clock,
        version=version,
        bucket=bucket,
        shard=OWNER,
        codec=CODEC_IDS["none"],
        numel=N,
        nbytes=0,
        k=0,
        block=0,
        flags=wire.FLAG_FINITE if finite else 0,
        count=1,
    )
    return sender, wire.pack_push(payload, torch.ones(1, dtype=torch.uint8), header=h)


def _replay(policy, frames, *, version, reflected, departed, momentum=0.0):
    rule = UpdateRule(torch.optim.SGD([torch.zeros(1)], lr=1.0, momentum=momentum))
    state = rule.new_state(_layout(), torch.zeros(N))
    n = replay(
        rule=rule,
        policy=policy,
        world_size=WORLD,
        state=state,
        version=version,
        reflected=reflected,
        departed=departed,
        frames=frames,
        spec=_spec(),
    )
    return state, n


def test_asp_replays_each_push_as_its_own_update_in_clock_order():
    frames = [_frame(0, 2, 3, [0, 1, 0]), _frame(1, 1, 2, [0, 0, 1]), _frame(0, 1, 2, [1, 0, 0])]
    state, n = _replay(ASP(), frames, version=3, reflected=[0, 0, 5], departed=[2])
    assert n == 3
    torch.testing.assert_close(state.master, -torch.ones(N) / WORLD, rtol=0, atol=0)
    assert state.steps == [3]


def test_a_gap_in_the_replayed_clocks_is_refused():
    with pytest.raises(ProtocolError, match="expected 1"):
        _replay(ASP(), [_frame(0, 2, 0, [1, 0, 0])], version=0, reflected=[0, 0, 0], departed=[2])


def test_bsp_replays_the_round_in_flight_as_one_update_of_the_mean():
    frames = [_frame(1, 5, 5, [0, 3, 0]), _frame(0, 5, 5, [3, 0, 0])]
    state, _ = _replay(BSP(), frames, version=5, reflected=[4, 4, 4], departed=[2])
    torch.testing.assert_close(state.master, torch.tensor([-1.0, -1.0, 0.0]), rtol=0, atol=0)
    assert state.steps == [1]  # one update, not two


def test_quorum_replays_drop_late_pushes_as_the_owner_would():
    late = _frame(0, 3, 1, [3, 0, 0])  # computed on version 1, the replica is at 2: dropped
    fresh = _frame(1, 4, 2, [0, 3, 0])
    state, _ = _replay(Quorum(2), [late, fresh], version=2, reflected=[2, 3, 2], departed=[2])
    torch.testing.assert_close(state.master, torch.tensor([0.0, -1.5, 0.0]), rtol=0, atol=0)


def test_replayed_frames_are_validated():
    sender, bad = _frame(0, 1, 0, [1, 0, 0])
    bad = bad.clone()
    bad[wire.HEADER_BYTES - 1] ^= 0xFF  # the checksum no longer matches
    with pytest.raises(wire.WireError):
        _replay(ASP(), [(sender, bad)], version=0, reflected=[0, 0, 0], departed=[])
    with pytest.raises(wire.WireError, match="claims sender"):
        _replay(ASP(), [(1, _frame(0, 1, 0, [1, 0, 0])[1])], version=0, reflected=[0, 0, 0], departed=[])


def test_aggregate_answers_reflect_only_what_is_in_the_values():
    r = BSP().round(WORLD, 1, 0)
    r.push(1, 0, 0, True, [True], "p1")
    assert r.included[1] == 0 and r.reflected[1] == -1  # held, not yet summed into the values
    r.push(0, 0, 0, True, [True], "p0")
    r.push(2, 0, 0, True, [True], "p2")
    assert r.reflected == [0, 0, 0]
    q = Quorum(2, late="fold").round(WORLD, 1, 0)
    q.push(0, 0, 0, True, [True], "a")
    q.push(1, 0, 0, True, [True], "b")  # update: version 1
    q.push(2, 0, 0, True, [True], "late")  # folded into the next update
    assert q.included[2] == 0 and q.reflected[2] == -1
    q.push(0, 1, 1, True, [True], "c")
    q.push(1, 1, 1, True, [True], "d")  # the next update takes the folded push in
    assert q.reflected == [1, 1, 0]
    d = Quorum(2).round(WORLD, 1, 0)
    d.push(0, 0, 0, True, [True], "a")
    d.push(1, 0, 0, True, [True], "b")
    d.push(2, 0, 0, True, [True], "late")  # dropped: nothing will ever apply it
    assert d.reflected == [0, 0, 0]


def test_retention_keeps_what_no_installed_answer_reflects():
    reflected = {(0, 1): -1}
    keep = Retention(lambda key: reflected[key])
    for c in range(4):
        keep.keep((0, 1), c, torch.full((16,), c, dtype=torch.uint8))
    assert [c for c, _ in keep.after((0, 1), -1)] == [0, 1, 2, 3]
    reflected[(0, 1)] = 2
    keep.keep((0, 1), 4, torch.zeros(16, dtype=torch.uint8))  # forgets 0..2
    assert [c for c, _ in keep.kept[(0, 1)]] == [3, 4]
    assert keep.bytes == 32 and keep.peak_bytes == 64
    assert [c for c, _ in keep.after((0, 1), 3)] == [4]
    assert keep.after((5, 1), -1) == []
