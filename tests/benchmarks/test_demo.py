"""The demo machinery: option parsing, data split, metrics, and small end-to-end runs.

The end-to-end tests spawn 2 local gloo workers for 1 epoch (DDP and one pyasync policy), run the torchrun
example, and check that a failing worker becomes a clear error in the parent instead of a hang.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pyasync import demo as h
from pyasync.demo import cli, report

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------------
# Pure pieces
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "token, policy, compression, synchronous",
    [
        ("ddp", None, None, True),
        ("bsp", "bsp", None, True),
        ("asp", "asp", None, False),
        ("SSP:2", "ssp:2", None, False),
        ("ssp:0", "ssp:0", None, False),
        ("quorum:3", "quorum:3", None, False),
        ("quorum:4:fold", "quorum:4:fold", None, False),
        ("asp:inverse+int8", "asp:inverse", "int8", False),
        ("ssp:1+topk:0.05", "ssp:1", "topk:0.05", False),
        ("bsp+none", "bsp", "none", True),
    ],
)
def test_parse_system(token, policy, compression, synchronous):
    spec = h.parse_system(token, workers=4)
    assert (spec.name, spec.policy, spec.compression, spec.synchronous) == (
        token,
        policy,
        compression,
        synchronous,
    )
    assert spec.is_ddp == (policy is None)


@pytest.mark.parametrize(
    "token, message",
    [
        ("sgd", "unknown policy string"),
        ("ssp", "ssp needs its staleness bound"),
        ("ssp:x", "bad policy string"),
        ("quorum:5", "quorum size must be in 1..workers=4"),
        ("quorum:0", "Quorum k must be"),
        ("asp:1", "lr_scale"),
        ("ddp+int8", "not to ddp"),
        ("asp+zip", "unknown compression"),
        ("asp+topk:abc", "bad value 'abc'"),
    ],
)
def test_parse_system_rejects(token, message):
    with pytest.raises(ValueError, match=message) as e:
        h.parse_system(token, workers=4)
    assert str(e.value).startswith(f"system {token!r}: ")


def test_parse_systems_rejects_empty_and_duplicates():
    assert [s.name for s in h.parse_systems("ddp, asp,ssp:2", 4)] == ["ddp", "asp", "ssp:2"]
    with pytest.raises(ValueError, match="at least one"):
        h.parse_systems(" , ", 4)
    with pytest.raises(ValueError, match="unique"):
        h.parse_systems("asp,asp", 4)


def test_parse_straggler():
    assert h.parse_straggler("none", 4) is None
    assert h.parse_straggler("3:3", 4) == (3, 3.0)
    assert h.parse_straggler("0:1.5", 2) == (0, 1.5)
    for bad in ("4:3", "-1:2", "1:0.5", "1", "a:b", "1:inf", "1:nan"):
        with pytest.raises(ValueError, match="RANK:FACTOR"):
            h.parse_straggler(bad, 4)


def test_train_config_rejects_bad_values():
    spec = h.parse_system("ddp", 2)
    for kw, name in [
        ({"workers": 0}, "workers"),
        ({"epochs": 0}, "epochs"),
        ({"batch_size": 0}, "batch_size"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"lr": 0.0}, "lr must be > 0"),
        ({"momentum": -0.1}, "momentum >= 0"),
        ({"fault": (0, 0, "boom")}, "fault kind"),
        ({"straggler_delay_s": -1.0}, "straggler_delay_s"),
        ({"device_ms": 0.0}, "device_ms must be a finite number > 0"),
        ({"device_ms": -1.0}, "device_ms must be a finite number > 0"),
        ({"device_ms": float("inf")}, "device_ms must be a finite number > 0"),
        ({"device_ms": float("nan")}, "device_ms must be a finite number > 0"),
        ({"device_ms": 5.0, "straggler_delay_s": 0.01}, "with device_ms the straggler sleeps"),
    ]:
        with pytest.raises(ValueError, match=name):
            h.TrainConfig(**{"system": spec, "workers": 2, **kw})


def test_digits_split_is_standardised_and_fixed():
    a, b = h.load_digits_split(0), h.load_digits_split(0)
    assert a.x_train.shape == (1437, 64) and a.x_test.shape == (360, 64)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    mean, std = a.x_train.mean(0), a.x_train.std(0)
    varying = std > 0
    assert torch.allclose(mean, torch.zeros(64), atol=1e-5)
    assert torch.allclose(std[varying], torch.ones(int(varying.sum())), atol=1e-4)
    assert set(a.y_train.tolist()) == set(range(10))


@pytest.mark.parametrize("n, world", [(1437, 4), (10, 3), (5, 5), (7, 1)])
def test_shards_are_disjoint_and_cover(n, world):
    shards = [h.shard_indices(n, r, world, seed=0) for r in range(world)]
    together = torch.cat(shards)
    assert sorted(together.tolist()) == list(range(n))
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="rank"):
        h.shard_indices(n, world, world, seed=0)


def test_steps_per_epoch():
    assert h.steps_per_epoch(1437, 4, 64) == 5  # 359 samples in the smallest shard
    assert h.steps_per_epoch(1437, 2, 32) == 22
    with pytest.raises(ValueError, match="batch_size=400"):
        h.steps_per_epoch(1437, 4, 400)


def test_batches_cover_the_shard_each_pass():
    x = torch.arange(10.0).reshape(10, 1)
    y = torch.arange(10)
    it = h.batches(x, y, steps=3, batch_size=3, seed=1, rank=0)
    first = [next(it) for _ in range(3)]
    second = [next(it) for _ in range(3)]
    for one_pass in (first, second):
        seen = torch.cat([yb for _, yb in one_pass]).tolist()
        assert len(set(seen)) == 9  # 3 full batches of distinct samples
        assert all(torch.equal(xb[:, 0].long(), yb) for xb, yb in one_pass)
    assert [b[1].tolist() for b in first] != [b[1].tolist() for b in second]  # reshuffled per pass


def test_histogram_percentile():
    assert h.histogram_percentile({}, 0.5) is None
    assert h.histogram_percentile({0: 10}, 0.99) == 0
    hist = {0: 50, 1: 30, 2: 19, 9: 1}
    assert h.histogram_percentile(hist, 0.5) == 0
    assert h.histogram_percentile(hist, 0.51) == 1
    assert h.histogram_percentile(hist, 0.99) == 2
    assert h.histogram_percentile(hist, 1.0) == 9


def test_format_table():
    recs = [
        {
            "name": "ddp",
            "wall_s": 1.234,
            "samples_per_s": 1000.4,
            "test_acc": 0.96,
            "mb_sent": 12.34,
            "staleness_p50": None,
            "staleness_p99": None,
            "pushes_dropped": 0,
        },
        {
            "name": "quorum:3",
            "wall_s": 0.5,
            "samples_per_s": 2000,
            "test_acc": 0.9,
            "mb_sent": 10,
            "staleness_p50": 0,
            "staleness_p99": 3,
            "pushes_dropped": 7,
        },
    ]
    lines = h.format_table(recs).splitlines()
    assert lines[0].split() == [
        "system",
        "wall",
        "s",
        "samples/s",
        "test",
        "acc",
        "MB",
        "sent",
        "stale",
        "p50",
        "stale",
        "p99",
        "dropped",
    ]
    assert lines[2].split() == ["ddp", "1.23", "1000", "0.9600", "12.3", "-", "-", "0"]
    assert lines[3].split() == ["quorum:3", "0.50", "2000", "0.9000", "10.0", "0", "3", "7"]
    # With an emulated device the table gains its column; without one it stays as above.
    assert "device" not in h.format_table([{**r, "device_ms": None} for r in recs])
    lines = h.format_table([{**r, "device_ms": 20.0} for r in recs]).splitlines()
    assert lines[0].split()[-2:] == ["device", "ms"]
    assert lines[2].split()[-1] == "20" and lines[3].split()[-1] == "20"


def _curve(*points):
    return [{"t": t, "samples": i, "acc": a} for i, (t, a) in enumerate(points)]


def test_time_to_target_and_ratio_to_ddp():
    recs = [
        {"name": "ddp", "test_acc": 0.97, "curve": _curve((0.0, 0.1), (4.0, 0.94), (8.0, 0.95), (9.0, 0.97))},
        {"name": "asp", "test_acc": 0.96, "curve": _curve((0.0, 0.1), (2.0, 0.96), (3.0, 0.93), (5.0, 0.96))},
        {"name": "ssp:2", "test_acc": 0.9, "curve": _curve((0.0, 0.1), (9.0, 0.9))},
    ]
    report.add_time_to_target(recs, 0.95)
    assert [r["target_acc"] for r in recs] == [0.95] * 3
    # The first point at or above the target, even when a later one dips below it.
    assert [r["time_to_target_s"] for r in recs] == [8.0, 2.0, None]
    assert [r["time_to_target_vs_ddp"] for r in recs] == [1.0, 0.25, None]
    lines = h.format_table(recs).splitlines()
    assert lines[0].split()[-5:] == ["to", "target", "s", "x", "ddp"]
    assert lines[2].split()[-2:] == ["8.00", "1.00"] and lines[3].split()[-2:] == ["2.00", "0.25"]
    assert lines[4].split()[-2:] == ["-", "-"]
    summary = cli.time_to_target_summary(recs).strip().splitlines()
    assert summary[0].startswith("time to test accuracy 0.95")
    assert summary[1].split() == ["ddp", "8.00", "s", "1.00x", "ddp"]
    assert summary[2].split() == ["asp", "2.00", "s", "0.25x", "ddp"]
    assert summary[3].split()[:3] == ["ssp:2", "not", "reached"]
    assert report.time_to_target_label(recs[1]) == "asp: 2.0 s (0.25x ddp)"
    # Without a ddp run there is no ratio; a bad target is refused.
    solo = [{"name": "asp", "curve": _curve((0.0, 0.1), (1.0, 0.99))}]
    report.add_time_to_target(solo, 0.95)
    assert solo[0]["time_to_target_s"] == 1.0 and solo[0]["time_to_target_vs_ddp"] is None
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="target accuracy must be in"):
            report.add_time_to_target(solo, bad)


def test_plot_marks_target_and_time_to_target(tmp_path, monkeypatch):
    import matplotlib.axes

    recs = [
        {"name": "ddp", "curve": _curve((0.0, 0.1), (4.0, 0.96))},
        {"name": "asp", "curve": _curve((0.0, 0.1), (2.0, 0.97))},
    ]
    report.add_time_to_target(recs, 0.95)
    drawn = {"axhline": [], "axvline": []}

    def recording(name):
        real = getattr(matplotlib.axes.Axes, name)

        def draw(ax, at, *args, **kwargs):
            drawn[name].append(at)
            return real(ax, at, *args, **kwargs)

        return draw

    for name in drawn:
        monkeypatch.setattr(matplotlib.axes.Axes, name, recording(name))
    path = tmp_path / "p.png"
    h.plot_curves(recs, str(path), title="t")
    assert drawn["axhline"] == [0.95, 0.95]  # the target on both panels
    assert drawn["axvline"] == [4.0, 2.0]  # each system's time to target
    assert path.read_bytes().startswith(b"\x89PNG")


def test_device_time_is_on_by_default():
    args = cli.build_parser().parse_args([])
    assert args.device_ms == cli.DEFAULT_DEVICE_MS > 0 and args.target == report.DEFAULT_TARGET
    cli.check_device_ms(args)
    assert args.device_ms == cli.DEFAULT_DEVICE_MS
    off = cli.build_parser().parse_args(["--device-ms", "0", "--straggler-delay-ms", "3"])
    cli.check_device_ms(off)  # 0 turns the emulated device off: the CPU-only mode, where a fixed delay fits
    assert off.device_ms is None
    # examples/train_digits.py and bench/e2e.py keep the CPU-only default of the shared option.
    import argparse

    p = argparse.ArgumentParser()
    cli.add_device_option(p)
    assert p.parse_args([]).device_ms is None


# ---------------------------------------------------------------------------------------------------
# End to end (spawned gloo workers)
# ---------------------------------------------------------------------------------------------------


def _check_record(r, workers, epochs, batch):
    n_train = len(h.load_digits_split(0).x_train)
    budget = epochs * h.steps_per_epoch(n_train, workers, batch) * workers
    assert r["samples"] == budget * batch
    assert sum(r["steps_per_rank"]) == budget
    assert r["wall_s"] > 0 and r["samples_per_s"] == pytest.approx(r["samples"] / r["wall_s"])
    assert r["replicas_equal"] is True
    assert 0.5 < r["test_acc"] <= 1.0  # chance is 0.1; one epoch of this MLP reaches ~0.9
    curve = r["curve"]
    assert curve[0]["t"] == 0.0 and curve[0]["samples"] == 0
    assert curve[-1]["t"] == pytest.approx(r["wall_s"], abs=1e-3) and curve[-1]["acc"] == r["test_acc"]
    assert all(a["t"] <= b["t"] and a["samples"] <= b["samples"] for a, b in itertools.pairwise(curve))
    assert r["mb_sent"] > 0


@pytest.mark.multiproc
def test_demo_ddp_and_pyasync(tmp_path):
    out = tmp_path / "out"
    table = tmp_path / "table.json"
    workers, epochs, batch = 2, 1, 32
    records = h.main(
        [
            "--workers",
            str(workers),
            "--epochs",
            str(epochs),
            "--batch-size",
            str(batch),
            "--hidden",
            "64",
            "--policies",
            "ddp,ssp:1",
            "--straggler",
            "1:2",
            "--device-ms",
            "0",
            "--out",
            str(out),
            "--json",
            str(table),
            "--no-progress",
        ]
    )
    saved = json.loads(table.read_text())
    assert saved == json.loads((out / "results.json").read_text())
    assert [r["name"] for r in saved] == ["ddp", "ssp:1"]
    for r in saved:
        _check_record(r, workers, epochs, batch)
        assert r["straggler"]["rank"] == 1 and r["straggler"]["factor"] == 2.0
    # The delay measured in the first run is reused verbatim by the later runs.
    assert saved[0]["straggler"]["delay_s"] > 0
    assert saved[1]["straggler"]["delay_s"] == saved[0]["straggler"]["delay_s"]
    assert saved[0]["compute_s_per_rank"] is not None and saved[1]["compute_s_per_rank"] is None
    for r in saved:  # CPU-only mode: only the straggler sleeps, its delay before each of its steps
        delay = r["straggler"]["delay_s"]
        assert r["device_ms"] is None
        assert r["sleep_s_per_rank"][0] == 0.0
        assert r["sleep_s_per_rank"][1] == pytest.approx(delay * r["steps_per_rank"][1], rel=1e-9)
    ddp, ssp = saved
    # DDP's bytes: every step all-reduces every parameter once; a ring sends 2(n-1)/n of it per rank.
    n_params = sum(p.numel() for p in h.make_model(64, 0).parameters())
    steps = ddp["steps_per_rank"][0]
    assert ddp["mb_sent"] * 1e6 == pytest.approx(n_params * 4 * 2 * (workers - 1) / workers * steps * workers)
    assert ddp["staleness_p50"] is None and ddp["pushes_dropped"] == 0
    assert ssp["pushes_applied"] > 0 and ssp["nonfinite_skipped"] == 0
    assert ssp["staleness_p50"] is not None and 0 <= ssp["staleness_p50"] <= ssp["staleness_p99"]
    assert sum(int(c) for c in ssp["staleness_hist"].values()) == ssp["pushes_applied"]
    png = (out / "accuracy_vs_time.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert records == saved


def test_demo_rejects_bad_device_options(tmp_path):
    for argv, message in [
        (["--device-ms", "-1"], "--device-ms must be a finite number >= 0"),
        (["--device-ms", "nan"], "--device-ms must be a finite number >= 0"),
        (["--device-ms", "inf"], "--device-ms must be a finite number >= 0"),
        (["--device-ms", "5", "--straggler-delay-ms", "3"], "--straggler-delay-ms fixes"),
        (["--straggler-delay-ms", "3"], "add --device-ms 0 for the CPU-only mode"),  # device on by default
        (["--target", "0"], "--target must be a test accuracy in"),
        (["--target", "1.5"], "--target must be a test accuracy in"),
    ]:
        with pytest.raises(ValueError, match=message):
            # A tiny run, should a check regress and let it start (it fails on the missing error then).
            tiny = ["--workers", "2", "--epochs", "1", "--hidden", "16", "--policies", "asp"]
            h.main(["--out", str(tmp_path), "--no-progress", *tiny, *argv])


@pytest.mark.multiproc
def test_demo_emulated_device(tmp_path, capsys):
    # The default: every step of every rank sleeps D = DEFAULT_DEVICE_MS, the straggler's FACTOR x D;
    # nothing is measured. The summary gives each system's time to target and its ratio to DDP's.
    workers, epochs, batch, device_ms, factor = 2, 1, 32, cli.DEFAULT_DEVICE_MS, 3.0
    out = tmp_path / "out"
    records = h.main(
        [
            *("--workers", str(workers), "--epochs", str(epochs), "--batch-size", str(batch)),
            *("--hidden", "64", "--policies", "ddp,asp", "--straggler", f"1:{factor:g}"),
            *("--target", "0.5", "--out", str(out), "--no-progress"),
        ]
    )
    assert [r["name"] for r in records] == ["ddp", "asp"]
    printed = capsys.readouterr().out
    assert f"emulated device: every step sleeps {device_ms:g} ms" in printed and "--device-ms 0" in printed
    assert "time to test accuracy 0.5" in printed
    for r in records:  # every run reaches 0.5 (chance is 0.1): see _check_record
        assert r["target_acc"] == 0.5 and r["time_to_target_s"] is not None
        assert r["time_to_target_s"] == next(p["t"] for p in r["curve"] if p["acc"] >= 0.5)
        assert r["time_to_target_vs_ddp"] == pytest.approx(
            r["time_to_target_s"] / records[0]["time_to_target_s"]
        )
        assert (
            f"{r['name']}  {r['time_to_target_s']:6.2f} s  {r['time_to_target_vs_ddp']:.2f}x ddp" in printed
        )
    assert json.loads((out / "results.json").read_text())[1]["time_to_target_vs_ddp"] == pytest.approx(
        records[1]["time_to_target_vs_ddp"]
    )
    png = (out / "accuracy_vs_time.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    d = device_ms / 1e3
    for r in records:
        _check_record(r, workers, epochs, batch)
        assert r["device_ms"] == device_ms
        assert r["compute_s"] is None and r["compute_s_per_rank"] is None
        assert r["straggler"] == {"rank": 1, "factor": factor, "delay_s": pytest.approx((factor - 1) * d)}
        steps = r["steps_per_rank"]
        assert r["sleep_s_per_rank"] == pytest.approx([steps[0] * d, steps[1] * factor * d], rel=1e-9)
    assert "device ms" in h.format_table(records)


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "how, message", [("raise", "injected fault on rank 1 at step 2"), ("exit", "exit code 3")]
)
def test_worker_failure_is_a_clear_error(how, message):
    cfg = h.TrainConfig(
        system=h.parse_system("ddp", 2), workers=2, epochs=1, hidden=16, fault=(1, 2, how), timeout_s=30
    )
    store = h.start_store_server()
    with pytest.raises(h.WorkerError, match=message) as e:
        h.run_local(cfg, store, prefix="fail/", run_timeout_s=120)
    assert "'ddp'" in str(e.value)
    # The cause is named first, whichever failure torch noticed first (Note [Which worker failed]):
    # rank 0 fails only after rank 1 is gone, if at all.
    assert re.findall(r"-- Process (\d+) terminated", str(e.value))[0] == "1", str(e.value)


def test_failure_report_names_the_cause_first():
    from pyasync.demo.local import failure_report

    sigterm = -signal.SIGTERM
    # Rank 1 exited by itself; rank 0 raised after it (a reset connection), rank 2 was terminated:
    # whichever torch noticed first, rank 1 leads and rank 2 is left out.
    for first in (0, 1):
        report = failure_report([1, 3, sigterm], {0: (5.0, "Traceback: reset by peer")}, first)
        assert re.findall(r"-- Process (\d+) terminated", report) == ["1", "0"], report
        assert "Process 1 terminated with exit code 3 (no traceback" in report
        assert "Traceback: reset by peer" in report
    # Raised ranks come earliest first; a SIGKILLed rank with no traceback leads them.
    report = failure_report([1, 1, -9], {0: (7.0, "later"), 1: (6.0, "earlier")}, 0)
    assert re.findall(r"-- Process (\d+) terminated", report) == ["2", "1", "0"], report
    assert "signal SIGKILL" in report and report.index("earlier") < report.index("later")
    # The rank torch named is always reported, even when only SIGTERM ended it (from outside the run).
    report = failure_report([sigterm, None], {}, 0)
    assert report.startswith("-- Process 0 terminated with signal SIGTERM"), report


@pytest.mark.multiproc
def test_hung_worker_times_out_instead_of_hanging():
    # Rank 1 stops answering at step 2; rank 0's all-reduce times out after timeout_s and the parent
    # reports the failure (the run limit is far longer, so the workers' own timeout is what ends it).
    cfg = h.TrainConfig(
        system=h.parse_system("ddp", 2), workers=2, epochs=1, hidden=16, fault=(1, 2, "hang"), timeout_s=10
    )
    store = h.start_store_server()
    with pytest.raises(h.WorkerError, match="a worker failed") as e:
        h.run_local(cfg, store, prefix="hang/", run_timeout_s=300)
    assert "Process 0 terminated" in str(e.value) and "timed out" in str(e.value).lower()


@pytest.mark.multiproc
def test_torchrun_example(tmp_path):
    out = tmp_path / "rec.json"
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(ROOT / "examples" / "train_digits.py"),
        "--policy",
        "ddp",
        "--epochs",
        "1",
        "--batch-size",
        "32",
        "--hidden",
        "64",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rec = json.loads(out.read_text())
    _check_record(rec, workers=2, epochs=1, batch=32)
    assert "ddp" in proc.stdout and "replicas equal after training: True" in proc.stdout
