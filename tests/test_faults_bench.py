"""bench/faults.py on a tiny run: a worker SIGKILLed under elastic ASP; the record's figures are
consistent (the kill is seen before the change starts, the change before the first step of the new
epoch ends), the survivors end on equal replicas, and training still converges: the demo model
reaches the uninterrupted run's accuracy within a few points."""

from __future__ import annotations

import math
import os
import sys

from _dist import multiproc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

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
