"""Pure unit tests of the policy decisions (no processes)."""

import pytest

import pyasync
from pyasync.policy import ASP, BSP, SSP, Quorum, parse_policy


@pytest.mark.parametrize(
    "text, expected",
    [
        ("bsp", BSP()),
        ("BSP", BSP()),
        ("asp", ASP()),
        ("asp:inverse", ASP(lr_scale="inverse")),
        ("ssp:0", SSP(0)),
        ("ssp:2", SSP(2)),
        ("ssp:3:inverse", SSP(3, lr_scale="inverse")),
        ("quorum:3", Quorum(3)),
        ("quorum:2:fold", Quorum(2, late="fold")),
        (None, BSP()),
    ],
)
def test_parse_and_spec_round_trip(text, expected):
    p = parse_policy(text)
    assert p == expected
    assert parse_policy(p.spec()) == p
    assert parse_policy(p) is p


@pytest.mark.parametrize(
    "bad", ["", "ssp", "ssp:-1", "ssp:x", "quorum:0", "quorum:2:keep", "bsp:1", "asp:linear", "fast"]
)
def test_parse_rejects_bad_strings(bad):
    with pytest.raises(ValueError, match="policy|staleness|Quorum|lr_scale"):
        parse_policy(bad)


def test_parse_rejects_other_types():
    with pytest.raises(TypeError, match="policy must be"):
        parse_policy(3)


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: SSP(-1), ValueError, "staleness"),
        (lambda: SSP(1.5), TypeError, "staleness must be an int"),
        (lambda: SSP(True), TypeError, "staleness must be an int"),
        (lambda: Quorum(0), ValueError, "k must"),
        (lambda: Quorum(2, late="x"), ValueError, "late"),
        (lambda: ASP(lr_scale="sqrt"), ValueError, "lr_scale"),
    ],
)
def test_constructor_validation(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_quorum_larger_than_world_is_rejected():
    Quorum(3).validate(3)
    with pytest.raises(ValueError, match="exceeds the number of workers"):
        Quorum(4).validate(3)


@pytest.mark.parametrize("s", [0, 1, 3])
def test_ssp_may_start_is_the_contract(s):
    p = SSP(s)
    # Worker may start clock t iff every worker's pushes up to clock t - s - 1 are included.
    for t in range(8):
        need = t - s - 1
        assert p.may_start(t, [need, need + 5, need + 1])
        assert not p.may_start(t, [need - 1, need + 5, need + 1])


@pytest.mark.parametrize("s", [0, 1, 3])
def test_ssp_owner_answer_matches_may_start(s):
    """The owner answers a push of clock t exactly when the worker may start clock t + 1."""
    p = SSP(s)
    for t in range(6):
        for lag in range(-1, 6):
            included = [t, t - lag, t + 2]
            closed = [False] * 3
            assert p.answer_now(t, included, closed) == p.may_start(t + 1, included)


def test_ssp_closed_workers_never_block():
    p = SSP(0)
    assert not p.answer_now(5, [5, 1], [False, False])
    assert p.answer_now(5, [5, 1], [False, True])


def test_asp_never_waits():
    p = ASP()
    assert not p.worker_waits
    assert p.answer_now(100, [-1, -1], [False, False])
    assert p.may_start(100, [-1])


def test_bsp_update_ready_needs_every_live_worker():
    p = BSP()
    assert p.divisor(4) == 4 and not p.folds_late and not p.is_late(0, 5)
    assert not p.update_ready({0, 1, 2}, set(), 4)
    assert p.update_ready({0, 1, 2, 3}, set(), 4)
    assert p.update_ready({0, 1, 2}, {3}, 4)  # 3 closed: counts as zeros
    assert not p.update_ready(set(), {3}, 4)
    # A pusher that closed afterwards still counts once; the others must still push.
    assert not p.update_ready({0}, {0}, 3)


def test_quorum_update_ready_and_lateness():
    q = Quorum(2)
    assert q.divisor(3) == 2
    assert not q.update_ready({1}, set(), 3)
    assert q.update_ready({1, 2}, set(), 3)
    assert q.update_ready({1}, {0, 2}, 3)  # nobody else can push: never stall
    assert q.is_late(3, 4) and not q.is_late(4, 4)
    assert Quorum(3).update_ready({0, 1, 2}, set(), 3) == BSP().update_ready({0, 1, 2}, set(), 3)


def test_lr_scale_inverse():
    assert SSP(2, lr_scale="inverse").lr_factor(0) == 1.0
    assert SSP(2, lr_scale="inverse").lr_factor(1) == 1.0
    assert SSP(2, lr_scale="inverse").lr_factor(4) == 0.25
    assert ASP(lr_scale="inverse").lr_factor(3) == pytest.approx(1 / 3)
    assert SSP(2).lr_factor(4) == 1.0


def test_exports():
    assert pyasync.SSP is SSP and pyasync.parse_policy is parse_policy
    assert {"DistributedOptimizer", "BSP", "SSP", "ASP", "Quorum", "Stats", "compression"} <= set(
        pyasync.__all__
    )
    st = pyasync.Stats()
    for f in (
        "clock",
        "min_included_clock",
        "staleness",
        "pushes_applied",
        "pushes_dropped",
        "nonfinite_skipped",
        "bytes_sent",
        "bytes_received",
        "wait_seconds",
        "compression_ratio",
    ):
        assert hasattr(st, f)


@pytest.mark.parametrize(
    "text, expected, outer",
    [
        ("local:16", pyasync.Local(16), "bsp"),
        ("local:8:quorum:3", pyasync.Local(8, mode="quorum", k=3), "quorum:3"),
        ("local:4:async", pyasync.Local(4, mode="async"), "asp:lookahead=off:clip=off:patience=inf"),
        ("local:4:async:lr=0.5:momentum=0", pyasync.Local(4, mode="async", outer_lr=0.5, outer_momentum=0.0),
         "asp:lookahead=off:clip=off:patience=inf"),
        ("local:4:async:adaptive", pyasync.Local(4, mode="async", adaptive=True),
         "asp:lookahead=off:clip=off:patience=inf"),
        ("local:8:quorum:3:adaptive", pyasync.Local(8, mode="quorum", k=3, adaptive=True), "quorum:3"),
    ],
)
def test_local_steps_parse_and_pick_their_outer_policy(text, expected, outer):
    p = parse_policy(text)
    assert p == expected and parse_policy(p.spec()) == p
    assert p.outer().spec() == outer
    assert p.divisor(4) == p.outer().divisor(4)
    if p.mode == "sync":
        assert p.outer(elastic=True).spec() == "bsp:p2p"


@pytest.mark.parametrize(
    "bad, match",
    [
        ("local", "local takes"),
        ("local:0", "steps"),
        ("local:4:quorum", "local takes"),
        ("local:4:sync", "local takes"),
        ("local:4:quorum:0", "quorum k"),
        ("local:4:lr=-1", "outer_lr"),
        ("local:4:momentum=1", "outer_momentum"),
        ("local:4:beta=1", "unknown option"),
        ("local:4:adaptive", "needs mode='async' or 'quorum'"),
        ("local:4:adaptive:async", "local takes"),
    ],
)
def test_local_steps_reject_bad_strings(bad, match):
    with pytest.raises(ValueError, match=match):
        parse_policy(bad)


def test_local_quorum_larger_than_world_is_rejected():
    with pytest.raises(ValueError, match="exceeds"):
        pyasync.Local(4, mode="quorum", k=5).validate(4)
    with pytest.raises(ValueError, match="only for mode='quorum'"):
        pyasync.Local(4, k=2)
