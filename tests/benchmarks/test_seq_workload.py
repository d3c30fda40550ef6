"""The ``seq`` workload of the end-to-end benchmark (bench/harness/seqtask.py): the sorting task's data, the
transformer, that it learns in a short single-process run, how the benchmark's options and configs reach
it, and one tiny real run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # before the imports; spawned workers inherit sys.path
from _bench import load_e2e  # noqa: E402
from harness import seqtask as Q  # noqa: E402
from harness import summary as E  # noqa: E402
from harness import workload as W  # noqa: E402

from pyasync import demo as h  # noqa: E402


def test_sort_split_is_fixed_sorted_and_seeded():
    a, b = Q.load_sort_split(0), Q.load_sort_split(0)
    assert a.x_train.shape == a.y_train.shape == (8192, Q.SEQ_LENGTH)
    assert a.x_test.shape == a.y_test.shape == (2048, Q.SEQ_LENGTH)
    assert a.x_train.dtype == a.y_train.dtype == torch.int64
    assert a.x_train.equal(b.x_train) and a.y_test.equal(b.y_test)
    for x, y in ((a.x_train, a.y_train), (a.x_test, a.y_test)):
        assert (y[:, 1:] >= y[:, :-1]).all()  # sorted ascending
        assert y.equal(x.sort(dim=1).values)  # the same symbols
        assert int(x.min()) == 0 and int(x.max()) == Q.VOCAB - 1
    other = Q.load_sort_split(1)
    assert not other.x_train.equal(a.x_train)
    small = Q.load_sort_split(3, n_train=10, n_test=5, length=4, vocab=3)
    assert small.x_train.shape == (10, 4) and int(small.x_train.max()) <= 2
    with pytest.raises(ValueError, match="length >= 2"):
        Q.load_sort_split(0, length=1)


def test_transformer_shape_and_seeded_init():
    m1, m2 = Q.make_seq_model(64, 0), Q.make_seq_model(64, 0)
    for p, q in zip(m1.parameters(), m2.parameters(), strict=True):
        assert p.equal(q)
    assert not next(iter(Q.make_seq_model(64, 1).parameters())).equal(next(iter(m1.parameters())))
    n = sum(p.numel() for p in m1.parameters())
    assert 60_000 < n < 80_000
    x = Q.load_sort_split(0).x_train[:5]
    assert m1(x).shape == (5, Q.VOCAB, Q.SEQ_LENGTH)
    with pytest.raises(ValueError, match="multiple of heads"):
        Q.SortTransformer(30, Q.SEQ_LENGTH)


def _token_accuracy_baseline(y_train: torch.Tensor, y_test: torch.Tensor) -> float:
    """Test accuracy of the best input-blind guess: each position's most frequent training label."""
    mode = torch.stack([torch.bincount(col, minlength=Q.VOCAB).argmax() for col in y_train.T])
    return float((y_test == mode).float().mean())


def test_seq_learns_in_a_short_single_process_run():
    # The workload's own optimiser settings (lr 0.03, momentum 0.9) with BSP's global batch (4 x 64):
    # well past the input-blind baseline (sorted outputs make some positions easy to guess) in 120 steps.
    spec = W.MODELS["seq"]
    data = W.load_split("seq", 0)
    model = W.BenchConfig(
        system=W.parse_system("bsp", 4), workers=4, model="seq", hidden=spec.hidden, lr=spec.lr
    ).build_model(data)
    assert isinstance(model, Q.SortTransformer)
    baseline = _token_accuracy_baseline(data.y_train, data.y_test)
    assert 0.3 < baseline < 0.6
    before = h.accuracy(model, data.x_test, data.y_test)
    opt = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=spec.momentum)
    g = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(120):
            idx = torch.randint(0, len(data.x_train), (256,), generator=g)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(data.x_train[idx]), data.y_train[idx]).backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    after = h.accuracy(model, data.x_test, data.y_test)
    assert before < baseline < after - 0.25, (before, baseline, after)


def test_bench_config_builds_each_workloads_model():
    bsp = W.parse_system("bsp", 2)
    mlp = W.BenchConfig(system=bsp, workers=2, model="mlp", hidden=32)
    assert isinstance(mlp.build_model(mlp.load_data())[0], torch.nn.Linear)
    seq = W.BenchConfig(system=bsp, workers=2, model="seq", hidden=32)
    assert isinstance(seq.build_model(seq.load_data()), Q.SortTransformer)
    assert W.MODELS["seq"].momentum == 0.9 and W.MODELS["mlp"].momentum == W.MODELS["wide"].momentum == 0
    targets = {m: s.target for m, s in W.MODELS.items()}
    assert E.parse_targets("seq=0.9", targets, {m: s.metric for m, s in W.MODELS.items()})["seq"] == 0.9
    with pytest.raises(ValueError, match="model must be one of"):
        W.load_split("sort", 0)


@pytest.mark.multiproc
def test_e2e_tiny_seq_run(tmp_path):
    bench = load_e2e()
    out = tmp_path / "out"
    records = bench.main(
        [
            *("--out", str(out), "--workers", "2", "--epochs", "1", "--batch-size", "64"),
            *("--systems", "ddp,asp:inverse+topk:0.01", "--scenarios", "equal", "--models", "seq"),
            *("--eval-points", "4", "--target", "seq=0.3", "--no-progress"),
        ]
    )
    saved = json.loads((out / "e2e.json").read_text())
    assert [r["system"] for r in saved] == ["ddp", "asp:inverse+topk:0.01"] and len(records) == 2
    assert (out / "accuracy_vs_time_seq.png").stat().st_size > 0
    assert (out / "accuracy_vs_samples_seq.png").stat().st_size > 0
    steps = h.steps_per_epoch(8192, 2, 64)
    for r in saved:
        assert not r.get("error") and r["model"] == "seq" and r["replicas_equal"] is True
        assert r["config"]["model"] == "seq" and r["config"]["momentum"] == 0.9
        assert r["config"]["lr"] == W.MODELS["seq"].lr and r["config"]["hidden"] == W.MODELS["seq"].hidden
        assert r["target_acc"] == 0.3 and r["time_to_target_s"] == E.time_to_target(r["curve"], 0.3)
        assert 0 < r["final_acc"] <= 1 and r["final_acc"] == r["curve"][-1]["acc"]
        assert sum(r["steps_per_rank"]) == 2 * steps
    ddp, asp = saved
    n_params = sum(p.numel() for p in Q.make_seq_model(64, 0).parameters())
    assert ddp["bytes_per_step"] == pytest.approx(n_params * 4)  # ring all-reduce, n=2: 1x the gradient
    assert asp["policy"] == "asp:inverse" and asp["compression"] == "topk:0.01"
    assert asp["bytes_per_step"] < 0.2 * ddp["bytes_per_step"]


def test_quick_plan_runs_seq_on_equal_workers_only():
    bench = load_e2e()
    args = bench.build_parser().parse_args(["--out", "x", "--quick"])
    plan = [(m, sc.name) for m, sc in bench._plan(args, ["mlp", "wide", "seq"])]
    assert [sc for m, sc in plan if m == "seq"] == ["equal"]
    assert [sc for m, sc in plan if m == "mlp"] == ["equal", "slow2x", "transient"]
    args = bench.build_parser().parse_args(["--out", "x", "--quick", "--scenarios", "slow2x"])
    assert [(m, sc.name) for m, sc in bench._plan(args, ["seq"])] == [("seq", "slow2x")]
    assert bench.QUICK_EPOCHS.keys() == W.MODELS.keys()


def test_plot_styles_tell_policy_variants_apart():
    from harness.plots import _style

    names = ["ddp", "bsp", "ssp:1", "ssp:3", "asp", "asp:inverse", "quorum:3", "quorum:3:fold", "local:16",
             "local:16:async", "local:16:quorum:3"]
    styles = {n: _style({"kind": "ddp" if n == "ddp" else "pyasync", "policy": None if n == "ddp" else n})
              for n in names}  # fmt: skip
    assert len({s["color"] for s in styles.values()}) == len(names)
    assert _style({"policy": "ssp:2"})["color"] == styles["ssp:1"]["color"]
    int8 = _style({"policy": "asp", "compression": "int8"})
    assert int8["color"] == styles["asp"]["color"] and int8["linestyle"] != styles["asp"]["linestyle"]
    scaled = _style({"policy": "local:16:async", "lr_scale": 2.0})
    assert scaled["color"] == styles["local:16:async"]["color"] and scaled.get("marker")
    assert "marker" not in styles["local:16:async"]
