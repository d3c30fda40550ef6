"""The one-process model of top-k under BSP (bench/topk_momentum.py): the sparsity warm-up's schedule,
and a short run whose compressors follow it (the kept fraction each step, factor masking by TopK's
"auto" rule under ``dgc-auto``, the mean fraction recorded)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import topk_momentum as T  # noqa: E402


def test_warm_ratio_falls_geometrically_to_the_ratio():
    r = [T.warm_ratio(0.01, t, 4, 0.25) for t in range(1, 7)]
    assert r[0] == 0.25
    for t in range(1, 4):  # a constant factor per step: (0.01 / 0.25) ** (1 / 4)
        assert r[t] / r[t - 1] == pytest.approx((0.01 / 0.25) ** 0.25)
    assert r[4] == r[5] == 0.01  # after the warm-up: the ratio
    assert T.warm_ratio(0.01, 1, 0, 0.25) == 0.01  # no warm-up
    assert T.warm_ratio(0.3, 1, 4, 0.25) == 0.3  # a start below the ratio: no warm-up


def test_a_warm_run_sends_what_the_schedule_says(monkeypatch):
    seen = []
    compress = T.TopK.compress

    def spy(self, tensor, key=None, out=None):
        seen.append((self.topk_ratio, self.masking))
        return compress(self, tensor, key, out)

    monkeypatch.setattr(T.TopK, "compress", spy)
    rec = T.run("dgc-auto", 0.01, seed=0, steps=4, warmup=2, warm_from=0.25)
    per_step = T.WORKERS * T.WORKERS  # every worker compresses every owner's quarter
    assert len(seen) == 4 * per_step
    ratios = [seen[i * per_step][0] for i in range(4)]
    assert ratios == [0.25, pytest.approx(0.05), 0.01, 0.01]
    masks = [seen[i * per_step][1] for i in range(4)]
    assert masks == [False, True, True, True]  # "auto": masking where the fraction < 1 - momentum (0.1)
    assert rec["mean_ratio"] == pytest.approx(sum(ratios) / 4, abs=1e-4)
    assert rec["warmup"] == 2 and math.isfinite(rec["final_acc"])


def test_command_line_records_the_warmup(tmp_path):
    out = tmp_path / "r.json"
    T.main(["--variants", "dgc", "--ratios", "0.01", "--seeds", "0", "--steps", "2", "--warmup", "1",
            "--out", str(out)])
    (rec,) = json.loads(out.read_text())
    assert rec["warmup"] == 1 and rec["warm_from"] == 0.25 and "--warmup 1" in rec["command"]
