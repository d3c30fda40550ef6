"""Smoke test of bench/overlap.py: its measurement function on a tiny model, 2 workers, 2 bucket sizes.

Checks the record schema and that the times are positive and consistent; never a speed ratio (that is
what the benchmark reports, and it depends on the machine).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # before the import; spawned workers inherit sys.path and import it too
import overlap  # noqa: E402

pytestmark = pytest.mark.multiproc

FIELDS = {
    "bench",
    "system",
    "bucket_mb",
    "buckets",
    "t_compute_ms",
    "t_serial_ms",
    "t_overlap_ms",
    "comm_ms",
    "exposed_ms",
    "hidden_fraction",
    "cpu_compute_ms",
    "cpu_serial_ms",
    "cpu_overlap_ms",
    "minflt",
    "iqr_ms",
    "samples_ms",
    "finite",
    "workers",
    "batch",
    "model",
    "params",
    "grad_mb",
    "rounds",
    "warmup",
    "threads",
    "run_s",
    "loadavg_1m",
    "config",
    "machine",
    "command",
}


def test_overlap_measure_tiny(tmp_path):
    # 8 layers of Linear(64, 64): 4160 fp32 values (16.25 KiB) each, 130 KiB in all. A 0.04 MiB cap
    # closes a bucket every 3 layers (3 buckets: 3 + 3 + 2 layers); 1 MiB holds the whole model.
    cfg = overlap.Config(
        workers=2,
        bucket_mb=(0.04, 1.0),
        systems=("ddp", "pyasync"),
        width=64,
        depth=8,
        batch=4,
        rounds=4,
        warmup=1,
        timeout_s=30,
        run_timeout_s=120,
    )
    records = overlap.measure(cfg)
    assert [(r["system"], r["bucket_mb"]) for r in records] == [
        ("ddp", 0.04),
        ("pyasync", 0.04),
        ("ddp", 1.0),
        ("pyasync", 1.0),
    ]
    for r in records:
        assert set(r) == FIELDS, set(r) ^ FIELDS
        assert r["bench"] == "overlap" and r["workers"] == 2 and r["rounds"] == 4
        assert r["params"] == 8 * (64 * 64 + 64)
        assert r["buckets"] == (3 if r["bucket_mb"] == 0.04 else 1)
        for k in ("t_compute_ms", "t_serial_ms", "t_overlap_ms"):
            assert math.isfinite(r[k]) and r[k] > 0, (k, r[k])
        # Communication adds time; medians of 4 rounds on a shared machine, so only roughly.
        assert r["t_serial_ms"] >= 0.8 * r["t_compute_ms"], r
        assert r["comm_ms"] == pytest.approx(r["t_serial_ms"] - r["t_compute_ms"])
        assert r["exposed_ms"] == pytest.approx(r["t_overlap_ms"] - r["t_compute_ms"])
        if r["comm_ms"] != 0:
            assert r["hidden_fraction"] == pytest.approx(1 - r["exposed_ms"] / r["comm_ms"])
        for mode in ("compute", "serial", "overlap"):
            assert len(r["samples_ms"][mode]) == 4 and all(t > 0 for t in r["samples_ms"][mode])
            assert r["iqr_ms"][mode] >= 0 and r["minflt"][mode] >= 0
        for k in ("cpu_compute_ms", "cpu_serial_ms", "cpu_overlap_ms"):
            assert r[k] >= 0
        assert r["finite"] is True
        assert r["machine"]["torch"] and r["command"]
    # Both systems of one bucket size share the compute baseline, measured in the same rounds.
    assert records[0]["t_compute_ms"] == records[1]["t_compute_ms"]
    # The records are what --out writes: strict JSON.
    out = tmp_path / "overlap.json"
    overlap.common.write_results(str(out), records)
    assert len(json.loads(out.read_text())) == 4
