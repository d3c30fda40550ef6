"""The end-to-end benchmark (bench/e2e.py): system names, scenarios, seeded transient slowdowns, time to
target, ratios, and one tiny in-process run (2 workers, 1 epoch, DDP, DDP+fp16 and a pyasync policy behind
an emulated link) whose JSON is checked field by field."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # before the imports; spawned workers inherit sys.path
from _bench import load_e2e  # noqa: E402
from harness import scenarios as S  # noqa: E402
from harness import summary as E  # noqa: E402
from harness import workload as W  # noqa: E402
from harness.slowdowns import transient_slow  # noqa: E402

from pyasync import demo as h  # noqa: E402

# ---------------------------------------------------------------------------------------------------
# System names
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "token, compression, hook, rank",
    [
        ("ddp", None, "allreduce", None),
        ("ddp+fp16", "fp16", "fp16", None),
        ("DDP+PowerSGD", "powersgd:2", "powersgd", 2),
        ("ddp+powersgd:4", "powersgd:4", "powersgd", 4),
    ],
)
def test_parse_ddp_systems(token, compression, hook, rank):
    spec = W.parse_system(token, workers=4)
    assert (spec.name, spec.policy, spec.compression, spec.kind) == (token, None, compression, "ddp")
    assert spec.is_ddp and not spec.is_pyasync and spec.synchronous
    assert spec.ddp_hook == hook and spec.powersgd_rank == rank


def test_parse_hivemind_and_pyasync_kinds():
    hm = W.parse_system("hivemind", 4)
    assert hm.kind == "hivemind" and not hm.is_ddp and not hm.is_pyasync and not hm.synchronous
    q = W.parse_system("quorum:3+topk:0.01", 4)
    assert q.kind == "pyasync" and q.is_pyasync and q.ddp_hook is None and q.powersgd_rank is None


def test_parse_a_scaled_lr():
    s = W.parse_system("local:16:quorum:3+int8@lr=0.5", 4)
    want = ("local:16:quorum:3+int8@lr=0.5", "local:16:quorum:3", "int8", 0.5)
    assert (s.name, s.policy, s.compression, s.lr_scale) == want
    assert W.parse_system("ddp", 4).lr_scale == 1.0 and W.parse_system("ddp@LR=2", 4).lr_scale == 2.0
    # the same system at two lrs side by side: distinct names
    assert [x.lr_scale for x in W.parse_systems("asp,asp@lr=0.7", 4)] == [1.0, 0.7]


@pytest.mark.parametrize(
    "token, message",
    [
        ("asp@lr=0", "lr=X with X > 0"),
        ("asp@lr=x", "lr=X with X > 0"),
        ("asp@momentum=0.5", "lr=X with X > 0"),
        ("asp@lr=inf", "lr=X with X > 0"),
        ("ddp+int8", "not to ddp"),
        ("ddp+topk:0.01", "not to ddp"),
        ("ddp+fp16:2", "not to ddp"),
        ("ddp+powersgd:0", "PowerSGD rank must be an int >= 1"),
        ("ddp+powersgd:x", "PowerSGD rank must be an int >= 1"),
        ("hivemind+int8", "without compression"),
        ("ddpx", "unknown policy string"),
    ],
)
def test_parse_bad_systems(token, message):
    with pytest.raises(ValueError, match=message) as e:
        W.parse_system(token, workers=4)
    assert str(e.value).startswith(f"system {token!r}: ")


def test_default_systems_cover_every_kind():
    for quick in (False, True):
        specs = W.parse_systems(S.default_systems(4, quick=quick), 4)
        names = [s.name for s in specs]
        assert {"ddp", "ddp+fp16", "ddp+powersgd", "hivemind"} <= set(names)
        policies = {s.policy.split(":")[0] for s in specs if s.is_pyasync}
        assert policies == {"bsp", "ssp", "asp", "quorum"}
        codecs = {(s.compression or "none").split(":")[0] for s in specs if s.is_pyasync}
        assert codecs == {"none", "int8", "topk"}
        assert "quorum:3" in {s.policy for s in specs if s.is_pyasync}
    assert len(W.parse_systems(S.default_systems(4), 4)) == 16  # 3 DDP + 4 policies x 3 + hivemind


# ---------------------------------------------------------------------------------------------------
# Scenarios and seeded transient slowdowns
# ---------------------------------------------------------------------------------------------------


def test_scenarios():
    eq, slow, tr = S.parse_scenarios("equal, slow2x,TRANSIENT", 4)
    assert (eq.straggler, eq.transient) == (None, None)
    assert slow.straggler == (3, 2.0) and slow.transient is None
    assert tr.straggler is None and tr.transient == (0.1, 5.0)
    with pytest.raises(ValueError, match="unknown scenario 'slow3x'"):
        S.parse_scenarios("slow3x", 4)
    with pytest.raises(ValueError, match="unique"):
        S.parse_scenarios("equal,equal", 4)
    with pytest.raises(ValueError, match="at least one"):
        S.parse_scenarios(" ,", 4)


@pytest.mark.parametrize(
    "workers, speeds",
    [
        (2, (1, 2)),
        (3, (1, 1, 2)),
        (4, (1, 1, 1.5, 2)),
        (5, (1, 1, 1, 1.5, 2)),
        (6, (1, 1, 1, 1.5, 1.75, 2)),
        (8, (1, 1, 1, 1, 1.5, 1.5 + 0.5 / 3, 1.5 + 1 / 3, 2)),
    ],
)
def test_hetero_speeds(workers, speeds):
    assert S.hetero_speeds(workers) == pytest.approx(speeds, abs=1e-12)
    (het,) = S.parse_scenarios("hetero", workers)
    assert het.speeds == S.hetero_speeds(workers) and het.straggler is None and het.transient is None
    assert "2x as long" in het.about


def test_hetero_needs_two_workers_and_defaults_depend_on_the_device():
    with pytest.raises(ValueError, match="at least 2 workers"):
        S.hetero_speeds(1)
    bench = load_e2e()
    plan = bench._plan(bench.build_parser().parse_args(["--out", "x"]), ["mlp"])
    assert [sc.name for _, sc in plan] == ["equal", "slow2x", "transient"]  # as before --device-ms
    plan = bench._plan(bench.build_parser().parse_args(["--out", "x", "--device-ms", "20"]), ["mlp"])
    assert [sc.name for _, sc in plan] == ["equal", "slow2x", "hetero", "transient"]


def test_transient_draws_are_a_function_of_seed_rank_step():
    draws = [[transient_slow(0, r, k, 0.1) for k in range(2000)] for r in range(4)]
    again = [[transient_slow(0, r, k, 0.1) for k in range(2000)] for r in range(4)]
    assert draws == again  # what every system of a run sees
    for r in range(4):
        assert 0.07 < sum(draws[r]) / 2000 < 0.13  # probability 0.1
    assert len({tuple(d) for d in draws}) == 4  # ranks draw independently
    other_seed = [transient_slow(1, 0, k, 0.1) for k in range(2000)]
    assert other_seed != draws[0]
    assert not any(transient_slow(0, 0, k, 0.0) for k in range(100))
    assert all(transient_slow(0, 0, k, 1.0) for k in range(100))


def test_train_config_checks_new_fields():
    spec = W.parse_system("ddp", 2)
    for kw, name in [
        ({"model": "cnn"}, "model must be one of"),
        ({"transient": (1.5, 5.0)}, "transient"),
        ({"transient": (0.1, 0.5)}, "transient"),
        ({"compute_s": -1.0}, "compute_s"),
        ({"powersgd_warmup": 1}, "powersgd_warmup"),
        ({"bandwidth_gbps": 0.0}, "bandwidth_gbps"),
        ({"speeds": (1.0,)}, "speeds must give a finite factor >= 1 for each of the 2 workers"),
        ({"speeds": (1.0, 0.5)}, "speeds must give"),
        ({"speeds": (1.0, float("inf"))}, "speeds must give"),
        ({"device_ms": 10.0, "compute_s": 0.01}, "compute_s is C of the CPU-only mode"),
        ({"device_ms": 0.0}, "device_ms must be a finite number > 0"),
    ]:
        with pytest.raises(ValueError, match=name):
            W.BenchConfig(**{"system": spec, "workers": 2, **kw})


def test_teacher_split_is_fixed_and_learnable_in_shape():
    a, b = W.load_teacher_split(0), W.load_teacher_split(0)
    assert a.x_train.shape == (8192, 256) and a.x_test.shape == (2048, 256)
    assert a.x_train.equal(b.x_train) and a.y_test.equal(b.y_test)
    assert set(a.y_train.tolist()) == set(range(10))
    assert not W.load_teacher_split(1).y_train.equal(a.y_train)
    n = sum(p.numel() for p in h.make_model(2048, 0, 256).parameters())
    assert 4_000_000 < n < 5_000_000  # the "wide" model: a few million parameters


# ---------------------------------------------------------------------------------------------------
# Time to target, ratios, targets
# ---------------------------------------------------------------------------------------------------


def test_time_to_target():
    curve = [
        {"t": 0.0, "acc": 0.1},
        {"t": 0.5, "acc": 0.6},
        {"t": 1.0, "acc": 0.95},
        {"t": 1.5, "acc": 0.9},
        {"t": 2.0, "acc": 0.97},
    ]
    assert E.time_to_target(curve, 0.95) == 1.0  # first crossing, even if it dips later; >= counts
    assert E.time_to_target(curve, 0.96) == 2.0
    assert E.time_to_target(curve, 0.05) == 0.0
    assert E.time_to_target(curve, 0.98) is None
    assert E.time_to_target([], 0.5) is None


def test_add_ratios_compares_within_model_scenario_and_link():
    def rec(system, model, scenario, sps, ttt):
        return {"system": system, "model": model, "scenario": scenario, "samples_per_s": sps,
                "time_to_target_s": ttt}  # fmt: skip

    recs = [
        rec("ddp", "mlp", "equal", 100.0, 2.0),
        rec("asp", "mlp", "equal", 150.0, 1.0),
        rec("bsp", "mlp", "equal", 80.0, None),
        rec("ddp", "mlp", "slow2x", 50.0, 4.0),
        rec("asp", "mlp", "slow2x", 100.0, 3.0),
        rec("asp", "wide", "equal", 10.0, 1.0),
        {"system": "hivemind", "model": "mlp", "scenario": "equal", "skipped": True},
    ]
    E.add_ratios(recs)
    got = [(r["samples_per_s_vs_ddp"], r["time_to_target_vs_ddp"]) for r in recs]
    assert got == [(1.0, 1.0), (1.5, 0.5), (0.8, None), (1.0, 1.0), (2.0, 0.75), (None, None), (None, None)]
    table = E.format_summary(recs).splitlines()
    assert table[0].split()[:3] == ["model", "scenario", "system"]
    assert "skipped" in table[-1] and "1.50" in table[3]
    assert "device" not in table[0]
    table = E.format_summary([{**r, "device_ms": 20.0} for r in recs]).splitlines()
    assert table[0].split()[-2:] == ["device", "ms"] and all(row.endswith(" 20") for row in table[2:])


def test_add_ratios_keeps_device_modes_apart():
    recs = [
        {"system": "ddp", "model": "mlp", "scenario": "equal", "samples_per_s": 100.0, "device_ms": None},
        {"system": "ddp", "model": "mlp", "scenario": "equal", "samples_per_s": 50.0, "device_ms": 20.0},
        {"system": "asp", "model": "mlp", "scenario": "equal", "samples_per_s": 75.0, "device_ms": 20.0},
    ]
    E.add_ratios(recs)
    assert [r["samples_per_s_vs_ddp"] for r in recs] == [1.0, 1.0, 1.5]


def test_parse_targets():
    d = {"mlp": 0.95, "wide": 0.9}
    assert E.parse_targets(None, d) == d
    assert E.parse_targets("0.8", d) == {"mlp": 0.8, "wide": 0.8}
    assert E.parse_targets("wide=0.85", d) == {"mlp": 0.95, "wide": 0.85}
    for bad in ("x", "cnn=0.9", "mlp:0.9", "1.5", "mlp=0"):
        with pytest.raises(ValueError, match="--target"):
            E.parse_targets(bad, d)


def test_bench_rejects_bad_options(tmp_path):
    bench = load_e2e()
    for argv, message in [
        (["--systems", "ddp+int8"], "not to ddp"),
        (["--models", "cnn"], "unknown model 'cnn'"),
        (["--scenarios", "slow3x"], "unknown scenario"),
        (["--bandwidth", "0"], "--bandwidth"),
        (["--workers", "1"], "--workers"),
        (["--device-ms", "0"], "--device-ms must be a finite number > 0"),
        (["--device-ms", "inf"], "--device-ms must be a finite number > 0"),
        (["--device-ms", "20", "--compute-ms", "5"], "--compute-ms sets C of the CPU-only mode"),
    ]:
        with pytest.raises(ValueError, match=message):
            bench.main(["--out", str(tmp_path), *argv])


# ---------------------------------------------------------------------------------------------------
# A tiny real run
# ---------------------------------------------------------------------------------------------------


REQUIRED = (
    "system",
    "policy",
    "compression",
    "scenario",
    "model",
    "samples_per_s",
    "time_to_target_s",
    "final_acc",
    "bytes_per_step",
    "bandwidth_gbps",
    "device_ms",
)


@pytest.mark.multiproc
def test_e2e_tiny_run(tmp_path):
    bench = load_e2e()
    out = tmp_path / "out"
    workers = 2
    records = bench.main(
        [
            "--out",
            str(out),
            "--workers",
            str(workers),
            "--epochs",
            "1",
            "--batch-size",
            "32",
            "--systems",
            "ddp,ddp+fp16,ssp:1+int8,hivemind",
            "--scenarios",
            "transient",
            "--models",
            "mlp",
            "--compute-ms",
            "1",
            "--bandwidth",
            "4",
            "--eval-points",
            "10",
            "--target",
            "0.5",
            "--no-progress",
        ]
    )
    saved = json.loads((out / "e2e.json").read_text())
    assert [r["system"] for r in saved] == ["ddp", "ddp+fp16", "ssp:1+int8", "hivemind"]
    assert (out / "accuracy_vs_time_mlp.png").stat().st_size > 0
    assert (out / "throughput_mlp.png").stat().st_size > 0
    assert len(records) == len(saved)

    n_train = len(h.load_digits_split(0).x_train)
    steps = h.steps_per_epoch(n_train, workers, 32)  # per rank, synchronous systems
    n_params = sum(p.numel() for p in h.make_model(512, 0).parameters())
    ran = [r for r in saved if not r.get("skipped") and r["kind"] != "hivemind"]  # hivemind: below
    for r in ran:
        assert list(r)[: len(REQUIRED)] == list(REQUIRED) or set(REQUIRED) <= set(r)
        assert r["scenario"] == "transient" and r["model"] == "mlp" and r["bandwidth_gbps"] == 4.0
        assert r["samples_per_s"] > 0 and r["wall_s"] > 0 and not r.get("error")
        assert 0.5 < r["final_acc"] <= 1.0 and r["final_acc"] == r["curve"][-1]["acc"]
        assert r["time_to_target_s"] == E.time_to_target(r["curve"], 0.5)
        assert r["time_to_target_s"] is not None and 0 <= r["time_to_target_s"] <= r["wall_s"] + 1e-3
        assert r["replicas_equal"] is True
        assert r["transient"]["delay_s"] == pytest.approx(4 * 1e-3)
        assert r["machine"]["torch"] and r["command"]
        # Every rank's k-th step is slow in every system alike (drawn from (seed, rank, k)).
        expect = [
            sum(transient_slow(0, rank, k, 0.1) for k in range(n))
            for rank, n in enumerate(r["steps_per_rank"])
        ]
        assert r["transient"]["slow_steps_per_rank"] == expect
        # CPU-only mode, as before --device-ms: only the slow steps sleep, (5 - 1) x C each.
        assert r["device_ms"] is None and r["speeds"] is None
        assert r["sleep_s_per_rank"] == pytest.approx([4e-3 * n for n in expect], rel=1e-9)
    ddp, fp16, ssp, hm = saved
    assert ddp["samples_per_s_vs_ddp"] == 1.0 and ddp["time_to_target_vs_ddp"] == 1.0
    assert fp16["samples_per_s_vs_ddp"] == pytest.approx(fp16["samples_per_s"] / ddp["samples_per_s"])
    # Ring all-reduce with n=2: each rank sends 2(n-1)/n = 1x the bucket bytes; fp16 sends half.
    assert ddp["steps_per_rank"] == fp16["steps_per_rank"] == [steps] * workers
    assert ddp["bytes_per_step"] == pytest.approx(n_params * 4)
    assert fp16["bytes_per_step"] == pytest.approx(n_params * 2)
    assert ddp["staleness_hist"] is None and ddp["policy"] is None and fp16["compression"] == "fp16"
    assert ssp["policy"] == "ssp:1" and ssp["compression"] == "int8"
    # pyasync compresses pushes (reduce-scatter share) and replies (all-gather share, coded changes; the
    # FINAL replies of close() are exact): int8 is 1 + 4/256 bytes per fp32 value, a little over 1/4.
    assert 0.25 * ddp["bytes_per_step"] < ssp["bytes_per_step"] < 0.35 * ddp["bytes_per_step"]
    assert sum(ssp["staleness_hist"].values()) == ssp["pushes_applied"] > 0
    assert sum(ssp["steps_per_rank"]) == steps * workers
    if bench.hivemind_status() is not None:
        assert hm["skipped"] is True and "hivemind is not importable" in hm["note"]
        assert hm["samples_per_s"] is None and hm["bandwidth_gbps"] == 4.0
    else:  # the peers' venv: hivemind ran, outside the emulated link (Note [Peers and the link])
        assert not hm.get("error") and hm["samples_per_s"] > 0
        assert hm["bandwidth_gbps"] == 4.0 and hm["link_emulated"] is False
        assert hm["peer"]["link"] == "not emulated"
        assert hm["samples_per_s_vs_ddp"] == pytest.approx(hm["samples_per_s"] / ddp["samples_per_s"])
    assert all(math.isfinite(r["samples_per_s"]) for r in ran)


@pytest.mark.multiproc
def test_e2e_emulated_device(tmp_path):
    # --device-ms D: every step sleeps D times its rank's factor (2x straggler: 2D; hetero: 1D and 2D
    # with 2 workers), a transient slow step 5D; C is neither calibrated nor used. ASP lets ranks take
    # different numbers of steps, so the sleep totals show the sleep is applied per step taken.
    bench = load_e2e()
    workers, device_ms = 2, 2.0
    d = device_ms / 1e3
    records = bench.main(
        [
            *("--out", str(tmp_path / "out"), "--workers", str(workers), "--epochs", "1"),
            *("--batch-size", "32", "--systems", "asp", "--scenarios", "slow2x,hetero,transient"),
            *("--models", "mlp", "--device-ms", str(device_ms), "--eval-points", "5", "--no-progress"),
        ]
    )
    saved = json.loads((tmp_path / "out" / "e2e.json").read_text())
    assert [r["scenario"] for r in saved] == ["slow2x", "hetero", "transient"]
    assert len(records) == len(saved)
    for r in saved:
        assert list(r)[: len(REQUIRED)] == list(REQUIRED)
        assert r["device_ms"] == device_ms and not r.get("error") and r["replicas_equal"] is True
        assert r["compute_s"] is None and r["compute_s_per_rank"] is None
        assert sum(r["steps_per_rank"]) == r["config"]["budget_steps"]
    slow, het, tr = saved
    steps = slow["steps_per_rank"]
    assert slow["straggler"] == {"rank": 1, "factor": 2.0, "delay_s": pytest.approx(d)}
    assert slow["sleep_s_per_rank"] == pytest.approx([steps[0] * d, steps[1] * 2 * d], rel=1e-9)
    steps = het["steps_per_rank"]
    assert het["speeds"] == [1.0, 2.0] and het["straggler"] is None
    assert het["sleep_s_per_rank"] == pytest.approx([steps[0] * d, steps[1] * 2 * d], rel=1e-9)
    slow_steps = [
        sum(transient_slow(0, rank, k, 0.1) for k in range(n)) for rank, n in enumerate(tr["steps_per_rank"])
    ]
    assert tr["transient"]["slow_steps_per_rank"] == slow_steps and sum(slow_steps) > 0
    assert tr["transient"]["delay_s"] == pytest.approx(4 * d)  # a slow step sleeps 5D instead of D
    expect = [(n + 4 * k) * d for n, k in zip(tr["steps_per_rank"], slow_steps, strict=True)]
    assert tr["sleep_s_per_rank"] == pytest.approx(expect, rel=1e-9)
