"""The soak test (bench/soak.py): many asynchronous steps with random delays, no lost update (an exact
ledger of every pushed gradient), flat threads, descriptors and memory.

* ``test_soak`` (marked ``soak``, opt in with ``pytest -m soak``): 4 workers, ASP, 3000 steps each,
  with and without compression; every check of the bench, RSS growth included (<= 16 MiB per rank).
* ``test_soak_machinery`` (always runs, ~10 s with the spawn): the same code path on 2 workers for
  300 steps with top-k compression, every check but RSS growth (too noisy over so few steps).
* ``test_soak_checks_can_fail`` / ``test_rss_limit_is_judged``: the same results with one unit of
  gradient taken out of the ledger, a leaked descriptor or thread, a thread or descriptor left after
  close(), an extra applied push, a differing replica, or 17 MiB of RSS growth each make exactly the
  matching check fail, so the checks are shown to be able to fail.
* ``test_slow_owner_intake_is_bounded`` (always runs, ~5 s of training plus the spawn): 2 workers
  under ASP, rank 0's owner 20 ms slower per update: the slow owner's intake reaches its limit and
  never passes it, its push pool never allocates more buffers than the limit, the ledger is exact and
  close() succeeds on every rank; ``test_intake_check_can_fail`` shows the bound is judged.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import soak

pytestmark = pytest.mark.multiproc

ALL_CHECKS = {"replicas_equal", "ledger", "pushes", "clocks", "threads", "fds", "close_releases"}


def _failed(record: dict) -> list[str]:
    return [f"{c['name']}: {c['detail']}" for c in record["checks"] if not c["ok"]]


FAST = soak.SoakConfig(
    steps=300, workers=2, compression="topk:0.01", delay_ms=0.5, sample_every=50, rss_limit_mib=None,
    timeout_s=30, run_timeout_s=120,
)


@pytest.fixture(scope="module")
def fast_results():
    return soak.run_workers(FAST)


def test_soak_machinery(fast_results):
    rec = soak.evaluate(fast_results, FAST)
    assert {c["name"] for c in rec["checks"]} == ALL_CHECKS  # RSS reported, not judged
    assert rec["ok"], _failed(rec)
    assert rec["ledger"]["exact"] and rec["ledger"]["max_abs_error"] == 0.0
    assert rec["ledger"]["residual_abs_max"] > 0  # top-k held gradients back: the ledger accounts for them
    for p in rec["per_rank"]:
        phases = [s["phase"] for s in p["samples"]]
        assert phases[:2] == ["start", "built"] and phases[-2:] == ["end", "closed"]
        assert phases.count("warm") == 1 and phases.count("run") == 300 // 50  # step 30, then 50..300
        assert p["stats"]["pushes_sent"] == 300 * fast_results[0]["nonempty_shards"]
        assert p["warm"]["rss_bytes"] > 0 and p["warm"]["fds"] > 2 and p["warm"]["os_threads"] > 1


def _phase(result: dict, phase: str) -> dict:
    return next(s for s in result["samples"] if s["phase"] == phase)


def _mutated(results, how):
    res = copy.deepcopy(results)
    if how == "lost_push":  # worker 1 claims one more unit of gradient than the parameters show
        res[1]["sent"][0][0, 0] += 1.0
    elif how == "fd_leak":
        _phase(res[0], "end")["fds"] = _phase(res[0], "warm")["fds"] + 1
    elif how == "thread_leak":  # (a rank's count may drop at the end: its owner stops receiving once
        _phase(res[1], "end")["os_threads"] = _phase(res[1], "warm")["os_threads"] + 1  # all others closed)
    elif how == "thread_left_after_close":
        _phase(res[0], "closed")["py_threads"] = _phase(res[0], "start")["py_threads"] + 1
    elif how == "fd_left_after_close":
        _phase(res[1], "closed")["fds"] = _phase(res[1], "start")["fds"] + 1
    elif how == "extra_push":
        res[0]["stats"]["pushes_applied"] += 1
    elif how == "replica":
        res[1]["final"][2][0] += 0.5
    return res


@pytest.mark.parametrize(
    "how, check",
    [
        ("lost_push", "ledger"),
        ("fd_leak", "fds"),
        ("thread_leak", "threads"),
        ("thread_left_after_close", "close_releases"),
        ("fd_left_after_close", "close_releases"),
        ("extra_push", "pushes"),
        ("replica", "replicas_equal"),
    ],
)
def test_soak_checks_can_fail(fast_results, how, check):
    rec = soak.evaluate(_mutated(fast_results, how), FAST)
    assert not rec["ok"]
    assert [c["name"] for c in rec["checks"] if not c["ok"]] == [check]


def test_rss_limit_is_judged(fast_results):
    for growth_mib, ok in ((17, False), (15, True)):
        res = copy.deepcopy(fast_results)
        for r in res:
            extra = growth_mib * 2**20 if r["rank"] == 0 else 0
            _phase(r, "end")["rss_bytes"] = _phase(r, "warm")["rss_bytes"] + extra
        rec = soak.evaluate(res, dataclasses.replace(FAST, rss_limit_mib=16.0))
        assert [c["name"] for c in rec["checks"] if not c["ok"]] == ([] if ok else ["rss"]), growth_mib


@pytest.mark.soak
@pytest.mark.parametrize("compression", ["none", "int8", "topk:0.01"])
def test_soak(compression):
    cfg = soak.SoakConfig(steps=3000, workers=4, policy="asp", compression=compression)
    rec = soak.run(cfg)
    print(soak.summary(rec))
    assert "error" not in rec, rec.get("error")
    assert {c["name"] for c in rec["checks"]} == ALL_CHECKS | {"rss"}
    assert rec["ok"], _failed(rec)


# Rank 0's appliers take 20 ms per update: its applier of two shards needs 80 ms per step of rank 1's
# pushes plus its own, while rank 1 makes a step's pushes in a few ms. So its intake fills within the
# first steps and stays full until rank 1's pushes (held in the sockets) run out at the end: no buffer
# goes back to the pool early, so none is dropped and made again. "asp:unanswered=inf": rank 1 does not
# wait for the slow owner's answers (ASP's default would, for about a step), so its pushes pile up there.
SLOW = soak.SoakConfig(
    steps=60, workers=2, policy="asp:unanswered=inf", compression="none", delay_ms=0.5, sample_every=20,
    rss_limit_mib=None, timeout_s=30, run_timeout_s=120, slow_owner_ms=20.0, slow_owner_rank=0,
)


@pytest.fixture(scope="module")
def slow_results():
    return soak.run_workers(SLOW)


def test_slow_owner_intake_is_bounded(slow_results):
    rec = soak.evaluate(slow_results, SLOW)
    assert {c["name"] for c in rec["checks"]} == ALL_CHECKS | {"intake"}
    assert rec["ok"], _failed(rec)
    assert rec["ledger"]["exact"] and rec["ledger"]["max_abs_error"] == 0.0  # no push lost or doubled
    slow = slow_results[0]
    pool = slow["push_pool"]
    # intake_limit(n, S) = 2nS + 2n with n = 2 workers and S = 3 shards owned (3 buckets).
    assert pool["owned_shards"] == 3 and pool["limit"] == 2 * 2 * 3 + 2 * 2
    # The slow owner fell behind (its intake filled up to the limit: the bound was exercised) and held
    # no more than the limit; its pool made no more buffers than that over the whole run.
    assert slow["stats"]["intake_peak"] == pool["peak"] == pool["limit"], pool
    assert pool["allocated"] <= pool["limit"] and pool["live_max"] <= pool["limit"], pool
    # The formula's intake term (docs/reliability.md, Memory per rank) is the engine's pool at its limit.
    assert slow["buffer_bound"]["push intake"] == pool["limit"] * pool["frame_bytes"]
    for r in slow_results:
        assert r["stats"]["intake_peak"] <= r["push_pool"]["limit"], (r["rank"], r["push_pool"])
        assert [s["phase"] for s in r["samples"]][-1] == "closed"  # close() returned on every rank


def test_intake_check_can_fail(slow_results):
    res = copy.deepcopy(slow_results)
    res[0]["stats"]["intake_peak"] = res[0]["push_pool"]["limit"] + 1
    rec = soak.evaluate(res, SLOW)
    assert [c["name"] for c in rec["checks"] if not c["ok"]] == ["intake"]
    res = copy.deepcopy(slow_results)
    res[1]["push_pool"]["live_max"] = res[1]["push_pool"]["limit"] + 1
    rec = soak.evaluate(res, SLOW)
    assert [c["name"] for c in rec["checks"] if not c["ok"]] == ["intake"]
