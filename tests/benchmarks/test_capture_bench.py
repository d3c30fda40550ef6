"""Smoke test of bench/capture.py: its measurement function on a tiny MLP, 2 workers, BSP and ASP, every
mode, 3 buckets (and the point-to-point BSP).

Checks the record schema, that the ratios are the ratios of the record's own figures, and that the
buckets were encoded again in step() exactly where the gradients were edited (or scaled, or clipped by
the engine per push); never a speed ratio (that is what the benchmark reports, and it depends on the
machine).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # before the import; spawned workers inherit sys.path and import it too
import capture  # noqa: E402

pytestmark = pytest.mark.multiproc

FIELDS = {
    "bench",
    "model",
    "policy",
    "mode",
    "grad_edits",
    "edits_grad",
    "about",
    "ms_per_step",
    "ms_min",
    "ms_iqr",
    "ratio_vs_forbid",
    "paired_ratio_vs_forbid",
    "ratio_vs_detect",
    "paired_ratio_vs_detect",
    "baseline",
    "ratio_vs_baseline",
    "paired_ratio_vs_baseline",
    "cpu_ms_per_rank_step",
    "buckets",
    "buckets_reencoded_per_step",
    "samples_ms",
    "bucket_mb",
    "params",
    "workers",
    "batch",
    "lr",
    "max_norm",
    "rounds",
    "steps_per_round",
    "warmup",
    "threads",
    "run_s",
    "loadavg_1m",
    "config",
    "machine",
    "command",
}


def test_capture_measure_tiny(tmp_path):
    # The digits MLP 64-32-32-10 (3466 parameters). A 0.001 MiB cap (1048 bytes) closes a bucket after
    # each layer's weight: [last layer], [middle layer], [first layer]. max_norm 1e-3 is below the norm
    # of every gradient, so the engine clips every ASP push.
    cfg = capture.Config(
        models=("mlp",),
        policies=("bsp", "bsp:p2p", "asp"),
        bucket_mb=(("mlp", 0.001),),
        workers=2,
        batch_size=16,
        hidden=32,
        rounds=2,
        steps=3,
        warmup=1,
        max_norm=1e-3,
        timeout_s=30,
        run_timeout_s=180,
    )
    records = capture.measure(cfg)
    assert [(r["policy"], r["mode"]) for r in records] == [
        (p, m) for p in ("bsp", "bsp:p2p", "asp") for m in capture.MODES
    ]
    for r in records:
        assert set(r) == FIELDS, set(r) ^ FIELDS
        assert r["bench"] == "capture" and r["model"] == "mlp" and r["workers"] == 2
        assert r["params"] == 64 * 32 + 32 + 32 * 32 + 32 + 32 * 10 + 10
        assert r["buckets"] == 3 and r["rounds"] == 2 and r["steps_per_round"] == 3
        assert r["grad_edits"] == ("forbid" if r["mode"] == "forbid" else "detect")
        assert r["edits_grad"] == (r["mode"] in ("mul", "clip", "amp"))
        assert len(r["samples_ms"]) == 2 and all(math.isfinite(t) and t > 0 for t in r["samples_ms"])
        assert r["ms_per_step"] > 0 and r["ms_min"] <= r["ms_per_step"] and r["ms_iqr"] >= 0
        assert r["cpu_ms_per_rank_step"] >= 0
        assert r["machine"]["torch"] and r["command"]
    for policy in ("bsp", "bsp:p2p", "asp"):
        by_mode = {r["mode"]: r for r in records if r["policy"] == policy}
        forbid, detect = by_mode["forbid"]["ms_per_step"], by_mode["detect"]["ms_per_step"]
        assert by_mode["forbid"]["ratio_vs_forbid"] == by_mode["forbid"]["paired_ratio_vs_forbid"] == 1.0
        assert by_mode["forbid"]["baseline"] is None and by_mode["forbid"]["ratio_vs_baseline"] is None
        assert by_mode["detect"]["ratio_vs_forbid"] == pytest.approx(detect / forbid)
        for mode, r in by_mode.items():
            base = capture.BASELINE.get(mode)
            assert r["baseline"] == base
            if base is not None:
                want = r["ms_per_step"] / by_mode[base]["ms_per_step"]
                assert r["ratio_vs_baseline"] == pytest.approx(want)
        # Encoded again in step(): every bucket of every step where .grad was edited (mul_, clip_grad_norm_)
        # or scaled (GradScaler), and where the engine clipped a push (ASP's max_grad_norm); never without
        # an edit, and never for BSP's max_grad_norm, which clips the mean at the owners. BSP on
        # collectives reads .grad in step() only: nothing is encoded early, so nothing again.
        reencoded = {mode: r["buckets_reencoded_per_step"] for mode, r in by_mode.items()}
        edited = 0.0 if policy == "bsp" else 3.0
        expected = {"forbid": 0.0, "detect": 0.0, "mul": edited, "clip": edited, "autocast": 0.0,
                    "amp": edited, "maxnorm": 3.0 if policy == "asp" else 0.0}
        assert reencoded == expected, (policy, reencoded)
    # The records are what --out writes: strict JSON.
    out = tmp_path / "capture.json"
    capture.common.write_results(str(out), records)
    assert len(json.loads(out.read_text())) == len(records)


def test_capture_config_is_checked():
    with pytest.raises(ValueError, match="unknown model"):
        capture.Config(models=("resnet",)).validate()
    with pytest.raises(ValueError, match="modes"):
        capture.Config(modes=("forbid", "nope")).validate()
    with pytest.raises(ValueError, match="pyasync policies"):
        capture.Config(policies=("ddp",)).validate()
    with pytest.raises(ValueError, match="bucket cap"):
        capture.Config(bucket_mb=(("mlp", 0.0), ("wide", 1.0))).validate()
    assert capture.Config().run_config("mlp", "asp").modes == capture.MODES
    assert "amp" not in capture.Config().run_config("wide", "asp").modes  # bf16 is slow on CPUs
    assert capture.Config(modes=("detect", "amp")).run_config("wide", "bsp").modes == ("detect", "amp")
    assert capture._caps("mlp=1,wide=0.5") == (("mlp", 1.0), ("wide", 0.5))
    assert capture._caps("2") == (("mlp", 2.0), ("wide", 2.0))
