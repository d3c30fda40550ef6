"""The GPU check's tooling, on the CPU: bench/gpu_report.py (steps, JUnit parsing, the targets of issue
15, summary.json, the README table) and the torch baselines bench/kernels.py times against (top-k index
sets, decode + torch's fused Adam)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # bench/kernels.py imports _path and common from there


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is created
    spec.loader.exec_module(mod)
    return mod


R = _load("gpu_report")
N = 25_000_000


def _record(op: str, **kw) -> dict:
    parts = op.split(":")
    rec = {"op": op, "kind": parts[0], "numel": N, "device": "cuda", "ms": 0.1, "copy_gbps": 4000.0,
           "copy_fraction": 0.9, "device_copy_fraction": 0.95, "bytes": 28 * N, "payload_bytes": N}
    if op == "encode:topk":
        rec.update(speedup_vs_torch_topk=5.0, topk_same_index_set=True, topk_same_index_set_up_to_ties=True,
                   topk_index_differences=0)
    if op.startswith("apply:adam:"):
        rec.update(speedup_vs_torch_fused_adam=1.4, torch_fused_adam_matches=True)
    rec.update(kw)
    return rec


def _all_records(**overrides) -> list[dict]:
    ops = [f"encode:{c}" for c in R.CODECS] + [f"apply:{o}:{c}" for o in R.OPTIMS for c in R.CODECS]
    return [_record(op, **overrides.get(op, {})) for op in ops]


# ------------------------------------------------------------------------------------------------
# Targets


def test_all_targets_pass_when_every_figure_is_good():
    targets = R.evaluate_targets(_all_records())
    # 5 compressors + 18 fused applies (>= 0.8 of copy), top-k vs torch.topk, 6 decode + Adam ratios
    assert len(targets) == 5 + 18 + 1 + 6
    assert all(t["pass"] for t in targets), [t for t in targets if not t["pass"]]
    assert {t["numel"] for t in targets} == {N}


def test_each_target_fails_on_its_own_figure():
    recs = _all_records(**{
        "encode:int8": {"copy_fraction": 0.79},
        "apply:sgd:sign": {"copy_fraction": None, "error": "RuntimeError: boom"},
        "apply:adam:int8": {"speedup_vs_torch_fused_adam": 1.29},
        "apply:adam:fp16": {"torch_fused_adam_matches": False},  # fast but not the same result
    })
    failed = {(t["op"], t["metric"]) for t in R.evaluate_targets(recs) if not t["pass"]}
    assert failed == {
        ("encode:int8", "copy_fraction"),
        ("apply:sgd:sign", "copy_fraction"),
        ("apply:adam:int8", "speedup_vs_torch_fused_adam"),
        ("apply:adam:fp16", "speedup_vs_torch_fused_adam"),
    }


@pytest.mark.parametrize("fields", [
    {"speedup_vs_torch_topk": 2.9},
    {"topk_same_index_set": False, "topk_same_index_set_up_to_ties": False, "speedup_vs_torch_topk": 9.0},
])
def test_topk_target_needs_speed_and_the_same_index_set(fields):
    targets = R.evaluate_targets(_all_records(**{"encode:topk": fields}))
    topk = [t for t in targets if t["metric"] == "speedup_vs_torch_topk"]
    assert len(topk) == 1 and not topk[0]["pass"]


def test_ties_alone_do_not_fail_the_topk_target():
    fields = {"topk_same_index_set": False, "topk_same_index_set_up_to_ties": True,
              "topk_index_differences": 2}
    targets = R.evaluate_targets(_all_records(**{"encode:topk": fields}))
    assert [t["pass"] for t in targets if t["metric"] == "speedup_vs_torch_topk"] == [True]


def test_only_cuda_records_of_25m_or_more_count_and_missing_ops_fail():
    recs = [_record("encode:int8", device="cpu"), _record("encode:fp16", numel=1_000_000),
            _record("encode:bf16"), _record("encode:bf16", numel=4 * N, copy_fraction=0.5)]
    targets = [t for t in R.evaluate_targets(recs) if t["op"].startswith("encode:")
               and t["metric"] == "copy_fraction"]
    got = {(t["op"], t["numel"]): (t["measured"], t["pass"]) for t in targets}
    assert got[("encode:int8", None)] == (None, False)  # the CPU record does not count
    assert got[("encode:fp16", None)] == (None, False)  # 1M is below 25M
    assert got[("encode:bf16", N)] == (0.9, True)  # every size >= 25M is judged on its own
    assert got[("encode:bf16", 4 * N)] == (0.5, False)


def test_fused_adam_bound_from_the_bytes_model():
    # ours: payload + 24n; decode (payload + 4n) then torch's fused Adam (28n): (payload + 32n) / bytes
    recs = _all_records(**{"apply:adam:int8": {"bytes": 25 * N + 4, "payload_bytes": N + 4}})
    recs.append(_record("decode:int8", copy_fraction=0.6))  # the baseline's decode, shown beside the ratio
    targets = R.evaluate_targets(recs)
    t = next(t for t in targets if t["op"] == "apply:adam:int8" and t["metric"].startswith("speed"))
    assert t["bound_from_bytes"] == pytest.approx(33 / 25, abs=1e-3)
    assert t["decode_copy_fraction"] == 0.6


# ------------------------------------------------------------------------------------------------
# Steps, JUnit, summary, table


def test_parse_step():
    assert R.parse_step("build=ok:41") == {"name": "build", "status": "ok", "seconds": 41.0, "note": None}
    assert R.parse_step("bench=skipped:0:no GPU: none") == {
        "name": "bench", "status": "skipped", "seconds": 0.0, "note": "no GPU: none"}
    for bad in ("build", "build=fine:1", "build=ok", "build=ok:soon", "=ok:1"):
        with pytest.raises(ValueError, match="bad --step"):
            R.parse_step(bad)


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="2" tests="5" time="3.5">
<testcase classname="tests.test_a" name="test_ok" time="0.1"/>
<testcase classname="tests.test_a" name="test_bad" time="0.1">
<failure message="assert 1 == 2">trace</failure></testcase>
<testcase classname="tests.test_a" name="test_err" time="0.1">
<error message="fixture exploded">trace</error></testcase>
<testcase classname="tests.test_b" name="test_s1" time="0"><skipped message="needs a CUDA GPU"/></testcase>
<testcase classname="tests.test_b" name="test_s2" time="0"><skipped message="needs a CUDA GPU"/></testcase>
</testsuite></testsuites>"""


def test_junit_summary(tmp_path):
    path = tmp_path / "t.xml"
    path.write_text(JUNIT)
    s = R.junit_summary(path)
    assert (s["tests"], s["passed"], s["failed"], s["errors"], s["skipped"]) == (5, 1, 1, 1, 2)
    assert s["seconds"] == 3.5
    assert s["failures"][0] == {"test": "tests.test_a::test_bad", "kind": "failed",
                                "message": "assert 1 == 2"}
    assert s["failures"][1]["kind"] == "errors"
    assert s["skip_reasons"] == {"needs a CUDA GPU": 2}
    assert R.junit_summary(tmp_path / "missing.xml") is None
    (tmp_path / "broken.xml").write_text("<testsuite")
    assert "unreadable" in R.junit_summary(tmp_path / "broken.xml")["error"]


def test_summary_without_a_gpu(tmp_path):
    env = {"gpu": None, "no_gpu_reason": "torch sees no CUDA GPU", "torch": "2.13.0+cpu",
           "time_utc": "2026-12-01T00:00:00+00:00"}
    (tmp_path / "env.json").write_text(json.dumps(env))
    s = R.summarize(tmp_path, [R.parse_step("build=skipped:0:no GPU")])
    assert s["status"] == "no GPU: skipped" and s["targets"] == [] and s["ok"] is None
    table = R.render_table(s)
    assert table.startswith("No GPU run has happened yet") and "torch sees no CUDA GPU" in table


def _gpu_folder(tmp_path, records, junit=JUNIT):
    gpu = {"name": "NVIDIA H200", "capability": "9.0", "arch": "90", "multiprocessors": 132,
           "memory_bytes": 141 * 2**30, "driver": "580.159.04", "count": 1}
    (tmp_path / "env.json").write_text(json.dumps({"gpu": gpu, "torch": "2.11.0+cu130", "torch_cuda": "13.0",
                                                   "git": {"commit": "abcdef1234567890", "dirty": False}}))
    (tmp_path / "kernels.json").write_text(json.dumps(records))
    for name in ("tests_cuda.xml", "tests_engine.xml"):
        (tmp_path / name).write_text(junit)
    return tmp_path


def test_summary_and_table_with_a_gpu(tmp_path):
    folder = _gpu_folder(tmp_path, _all_records(**{"encode:sign": {"copy_fraction": 0.5}}))
    steps = [R.parse_step(s) for s in ("env=ok:3", "build=ok:50", "tests_cuda=failed:60:exit status 1",
                                       "bench=ok:70", "tests_engine=failed:40:exit status 1")]
    s = R.summarize(folder, steps)
    assert s["gpu_name"] == "NVIDIA H200" and s["status"] == "complete" and s["ok"] is False
    assert s["targets_total"] == 30 and s["targets_passed"] == 29
    assert s["tests"]["cuda"]["failed"] == 1 and s["benchmark"]["copy_gbps_median"] == 4000.0
    table = R.render_table(s, json.loads((folder / "kernels.json").read_text()))
    assert "NVIDIA H200" in table and "driver 580.159.04" in table and "4000 GB/s" in table
    assert "| encode:sign | 25M | 0.100 | 0.50 | 0.95 | - | >= 0.8 of copy | no |" in table
    assert "5.00x torch.topk (same set)" in table and "Targets met: 29 of 30" in table
    report = R.render_report(s)
    assert "missed: encode:sign" in report and "failed: tests.test_a::test_bad" in report


def test_timeouts_make_a_run_incomplete(tmp_path):
    folder = _gpu_folder(tmp_path, _all_records(), junit=JUNIT.replace('errors="1" failures="1"', ""))
    s = R.summarize(folder, [R.parse_step("bench=timeout:150:stopped after 150s")])
    assert s["status"] == "incomplete: bench" and s["ok"] is False


def test_command_line(tmp_path, capsys):
    folder = _gpu_folder(tmp_path, _all_records())
    assert R.main(["summarize", str(folder), "--step", "build=ok:12"]) == 0
    written = json.loads((folder / "summary.json").read_text())
    assert written["steps"][0]["name"] == "build"
    assert (folder / "table.md").read_text().startswith("Measured on")
    capsys.readouterr()
    assert R.main(["table", str(folder / "summary.json")]) == 0
    assert "| apply:adamw:topk | 25M |" in capsys.readouterr().out
    (tmp_path / "other.json").write_text("{}")
    assert R.main(["table", str(tmp_path / "other.json")]) == 2
    with pytest.raises(SystemExit):
        R.main(["summarize", str(folder), "--step", "nonsense"])


def test_slug():
    assert R.slug("NVIDIA H200") == "nvidia_h200"
    assert R.slug("NVIDIA GeForce RTX 4090 (16GB)") == "nvidia_geforce_rtx_4090_16gb"
    assert R.slug(None) == "none"


# ------------------------------------------------------------------------------------------------
# The torch baselines of bench/kernels.py


@pytest.fixture(scope="module")
def kernels():
    return _load("kernels")


def test_topk_index_sets(kernels):
    v = torch.tensor([5.0, -3.0, 3.0, 1.0, -3.0, 0.5])
    same = kernels.topk_index_sets(torch.tensor([0, 1, 2]), torch.tensor([2, 0, 1]), v)
    assert same == {"topk_same_index_set": True, "topk_same_index_set_up_to_ties": True,
                    "topk_index_differences": 0}
    tie = kernels.topk_index_sets(torch.tensor([0, 1, 2]), torch.tensor([0, 2, 4]), v)  # |v| = 3 three times
    assert tie["topk_same_index_set"] is False and tie["topk_same_index_set_up_to_ties"] is True
    assert tie["topk_index_differences"] == 1
    wrong = kernels.topk_index_sets(torch.tensor([0, 1, 3]), torch.tensor([0, 1, 2]), v)
    assert wrong["topk_same_index_set_up_to_ties"] is False


def test_baselines_run_and_agree_on_the_cpu(kernels):
    args = kernels.parse_args(["--sizes", "3000", "--repeats", "1", "--warmup", "0", "--no-compile",
                               "--min-sample-ms", "0.1", "--threads", "1"])
    args.threads = 1
    ctx = kernels.Ctx(3000, torch.device("cpu"), 0, 256, 0.01)
    rec = kernels.run_case(kernels.case_encode(ctx, "topk"), ctx, args)
    assert rec["topk_same_index_set_up_to_ties"] is True and rec["speedup_vs_torch_topk"] > 0
    if getattr(torch, "_fused_adam_", None) is None:
        pytest.skip("this torch has no torch._fused_adam_")
    for optim in ("adam", "adamw"):
        rec = kernels.run_case(kernels.case_apply(ctx, optim, "int8"), ctx, args)
        assert rec[f"torch_fused_{optim}_matches"] is True, rec
        assert rec[f"torch_fused_{optim}_ms"] > 0 and rec[f"speedup_vs_torch_fused_{optim}"] > 0
    assert kernels.case_apply(ctx, "sgd", "int8").baseline is None
