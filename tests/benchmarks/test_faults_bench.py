"""bench/faults.py on a tiny run: a worker SIGKILLed under elastic ASP; the record's figures are
consistent (the kill is seen before the change starts, the change before the first step of the new
epoch ends), the survivors end on equal replicas, and training still converges: the demo model
reaches the uninterrupted run's accuracy within a few points. The same kill under torchft runs where
torchft imports (the peers' venv) and is skipped, saying why, elsewhere; its summary is tested on
synthetic records everywhere."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from _dist import multiproc

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import faults


@multiproc
def test_a_kill_is_survived_and_measured(tmp_path):
    out = tmp_path / "faults.json"
    (rec,) = faults.main(
        ["--policies", "asp", "--steps", "60", "--device-ms", "5", "--timeout", "30", "--out", str(out)]
    )
    assert out.exists()
    assert rec["replicas_equal"]
    assert 0 <= rec["detection_s"] <= rec["change_started_s"] + 1e-3 <= rec["recovery_s"] + 1e-3
    assert rec["recovery_s"] < 30
    assert 0 < rec["epoch_change_s"] < rec["recovery_s"] + 1e-3
    for k in ("samples_per_s_before", "samples_per_s_after", "samples_per_s_uninterrupted"):
        assert math.isfinite(rec[k]) and rec[k] > 0, (k, rec[k])
    assert rec["accuracy_uninterrupted"] > 0.6
    assert rec["accuracy"] > rec["accuracy_uninterrupted"] - 0.05, rec
    assert any("optimizer state" in s for s in rec["reinitialized"])


_REJOIN = ["--steps", "60", "--device-ms", "5", "--timeout", "30", "--rejoin", "0.5"]


def _check_rejoin(rec: dict, donors: int) -> None:
    assert rec["rejoin_size_at_end"] == 4 and rec["rejoin_replicas_equal"], rec
    assert 0.5 < rec["rejoin_start_to_first_step_s"] < 60
    assert 0 <= rec["rejoin_pause_s"] < 30
    assert len(rec["rejoin_donor_bytes"]) == donors and min(rec["rejoin_donor_bytes"]) > 0
    assert rec["rejoin_joiner_bytes"] >= max(rec["rejoin_donor_bytes"])
    for k in ("rejoin_samples_per_s_during", "rejoin_samples_per_s_after"):
        assert math.isfinite(rec[k]) and rec[k] > 0, (k, rec[k])
    assert rec["rejoin_accuracy"] > rec["accuracy_uninterrupted"] - 0.05, rec


@multiproc
def test_a_replacement_rejoins_and_is_measured(tmp_path):
    (rec,) = faults.main(["--policies", "asp", *_REJOIN, "--out", str(tmp_path / "f.json")])
    _check_rejoin(rec, donors=3)  # every survivor sends (its shards; the re-split)
    assert 0 < rec["rejoin_change_s"] < 30 and 0 < rec["rejoin_request_to_engine_s"] < 30
    model = 4 * ((64 + 1) * 256 + (256 + 1) * 256 + (256 + 1) * 10)  # the digits MLP's fp32 bytes
    assert rec["rejoin_joiner_bytes"] >= model  # the whole replica, and its new shard's state


# ---------------------------------------------------------------------------------------------------
# torchft under the same kill: the real run needs torchft (the peers' venv); the rest runs everywhere
# ---------------------------------------------------------------------------------------------------

_TORCHFT = faults.torchft_status()


@multiproc
@pytest.mark.skipif(_TORCHFT is not None, reason=f"torchft not importable here: {_TORCHFT}")
def test_torchft_survives_the_same_kill(tmp_path):
    out = tmp_path / "faults.json"
    (rec,) = faults.main(
        ["--systems", "torchft", "--steps", "40", "--device-ms", "5", "--timeout", "30", "--out", str(out)]
    )
    assert out.exists() and json.loads(out.read_text())["runs"][0]["policy"] == "torchft"
    assert rec["replicas_equal"]
    assert rec["committed_steps"] == [40, 40, 40]  # every survivor commits all its steps
    assert 0 <= rec["detection_s"] <= rec["quorum_s"] + 1e-3 <= rec["recovery_s"] + 1e-3
    assert rec["recovery_s"] < 30
    assert rec["torchft"]["min_replica_size"] == 3
    for k in ("samples_per_s_before", "samples_per_s_after", "samples_per_s_uninterrupted"):
        assert math.isfinite(rec[k]) and rec[k] > 0, (k, rec[k])
    assert rec["accuracy"] > rec["accuracy_uninterrupted"] - 0.05, rec


@multiproc
@pytest.mark.skipif(_TORCHFT is not None, reason=f"torchft not importable here: {_TORCHFT}")
def test_torchft_heals_a_replacement(tmp_path):
    (rec,) = faults.main(["--systems", "torchft", *_REJOIN, "--out", str(tmp_path / "f.json")])
    _check_rejoin(rec, donors=1)  # one peer sends its whole state


def test_torchft_missing_is_refused_with_its_reason(monkeypatch):
    monkeypatch.setattr(faults, "torchft_status", lambda: "ImportError: no torchft (bench/peers/setup.sh)")
    with pytest.raises(SystemExit, match="torchft: ImportError: no torchft"):
        faults.main(["--systems", "asp,torchft", "--steps", "30"])


def test_torchft_status_says_why():
    why = faults.torchft_status()
    if why is None:
        import torchft  # noqa: F401  (importable: nothing to explain)
    else:
        assert "torchft" in why or "Error" in why


def _rec(rank, ends, committed, sizes, quorum_at, failed_at=(), acc=0.9, params=(1.0,)):
    return {
        "rank": rank,
        "ends": list(ends),
        "committed": list(committed),
        "sizes": list(sizes),
        "quorum_at": list(quorum_at),
        "failed_at": list(failed_at),
        "committed_steps": sum(committed),
        "accuracy": acc,
        "params": list(params),
        "killed_at": 10.0,
    }


def test_summarize_torchft_on_synthetic_records():
    cfg = {
        "batch": 8,
        "workers": 4,
        "victim": 2,
        "kill_at": 3,
        "device_ms": 5.0,
        "timeout": 30.0,
        "torchft_min_replicas": 3,
        "torchft_heartbeat_timeout_ms": 1000,
    }
    # Steps every second until the kill at t=10; rank 0's all-reduce fails at 10.2 (step not committed),
    # the quorum of three returns at 11.0 on every survivor, whose first committed step ends at 11.1.
    ends = [7.0, 8.0, 9.0, 10.2, 11.1, 12.1, 13.1]
    sizes = [4, 4, 4, 4, 3, 3, 3]
    quorum_at = [6.9, 7.9, 8.9, 9.9, 11.0, 12.0, 13.0]
    ok = [True, True, True, True, True, True, True]
    killed = [
        _rec(0, ends, [True, True, True, False, True, True, True], sizes, quorum_at, failed_at=[10.2]),
        _rec(1, [7.0, 8.0, 9.0, 9.95, 11.1, 12.1, 13.1], ok, sizes, quorum_at),
        _rec(3, [7.0, 8.0, 9.0, 9.95, 11.2, 12.1, 13.1], ok, sizes, quorum_at, acc=0.8),
    ]
    plain = [_rec(r, [1.0, 2.0, 3.0], [True] * 3, [4] * 3, [0.9, 1.9, 2.9], acc=0.95) for r in (0, 1, 2, 3)]
    rec = faults.summarize_torchft(cfg, plain, killed)
    assert rec["policy"] == "torchft"
    assert rec["detection_s"] == pytest.approx(1.0)  # median of 0.2 (all-reduce), 1.0, 1.0 (quorum)
    assert rec["detected_by"] == ["all-reduce", "quorum"]
    assert rec["quorum_s"] == pytest.approx(1.0)
    assert rec["recovery_s"] == pytest.approx(1.1) and rec["recovery_s_max"] == pytest.approx(1.2)
    assert rec["steps_not_committed"] == 1
    # before: committed steps in (7, 10]: 2 + 3 + 3 = 8 steps of 8 samples over 3 s
    assert rec["samples_per_s_before"] == pytest.approx(8 * 8 / 3.0)
    # after: (11.2, 13.1]: 2 + 2 + 2 steps over 1.9 s
    assert rec["samples_per_s_after"] == pytest.approx(6 * 8 / 1.9)
    assert rec["samples_per_s_uninterrupted"] == pytest.approx(8 * 8 / 2.0)  # 4 ranks x 2 steps in (1, 3]
    assert rec["accuracy"] == pytest.approx((0.9 + 0.9 + 0.8) / 3)
    assert rec["accuracy_cost"] == pytest.approx(0.95 - rec["accuracy"])
    assert rec["replicas_equal"]
    killed[1]["params"] = [2.0]
    assert not faults.summarize_torchft(cfg, plain, killed)["replicas_equal"]
