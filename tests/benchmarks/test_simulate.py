"""The scale model (bench/simulate.py): exact throughput and staleness oracles with zero communication,
processor sharing, the ring and link formulas, SSP's bound read from the trace, determinism, the
calibration constants and the bytes model against the committed measurements, and the command line
(grid and --check) writing the documented fields."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import simulate as S  # noqa: E402

C = 0.05  # compute time per step (s)
BATCH = 32
POLICIES = ("ddp", "bsp", "bsp:p2p", "ssp:0", "ssp:1", "ssp:3", "asp", "quorum:n-1", "quorum:n")


def run(spec, n, costs, scen="equal", budget=None, **kw):
    budget = budget or 60 * n
    return S.simulate(S.parse_policy(spec, n), n, costs, S.scenario(scen), budget, batch=BATCH, **kw)


# ---------------------------------------------------------------------------------------------------
# Zero communication: exact figures
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", POLICIES)
@pytest.mark.parametrize("n", [2, 5, 8])
def test_equal_workers_without_costs_run_at_compute_speed(spec, n):
    res = run(spec, n, S.Costs(C))
    assert res.samples_per_s == pytest.approx(n * BATCH / C, rel=1e-9)
    assert res.window_samples_per_s == pytest.approx(n * BATCH / C, rel=1e-9)
    assert res.steps == [60] * n
    assert sum(res.wait_s) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("spec", ["ddp", "bsp", "bsp:p2p", "ssp:0", "quorum:n"])
def test_one_slow_worker_halves_the_synchronous_policies(spec):
    n = 8
    res = run(spec, n, S.Costs(C), "one-slow")
    assert res.samples_per_s == pytest.approx(n * BATCH / (2 * C), rel=1e-9)
    assert res.pushes_dropped == 0


def test_one_slow_worker_asp_loses_only_half_a_worker():
    n = 8
    res = run("asp", n, S.Costs(C), "one-slow", budget=400 * n)
    assert res.window_samples_per_s == pytest.approx((n - 1 + 0.5) * BATCH / C, rel=0.01)
    fast, slow = res.steps[:-1], res.steps[-1]
    assert all(s == pytest.approx(2 * slow, rel=0.02) for s in fast)


def test_one_slow_worker_quorum_drops_the_straggler():
    n = 8
    res = run("quorum:n-1", n, S.Costs(C), "one-slow", budget=400 * n)
    # every step is computed (the e2e measure), the straggler's are all late and dropped
    assert res.window_samples_per_s == pytest.approx((n - 1 + 0.5) * BATCH / C, rel=0.01)
    applied = res.window_samples_per_s * res.applied_fraction
    assert applied == pytest.approx((n - 1) * BATCH / C, rel=0.01)
    assert res.pushes_dropped == pytest.approx(res.steps[-1], abs=1)
    assert res.staleness.max() == 0


def test_equal_workers_quorum_n_minus_1_drops_one_push_per_round():
    """As measured by the engine (bench/results/e2e_cpu: 392 of 1600 dropped): the last of n is late."""
    n = 4
    res = run("quorum:3", n, S.Costs(C), budget=400)
    assert res.pushes_dropped == 100 and res.pushes_applied == 300


@pytest.mark.parametrize("n", [2, 4, 16])
def test_asp_staleness_is_n_minus_1_with_equal_workers(n):
    res = run("asp", n, S.Costs(C), budget=50 * n)
    st = res.staleness
    assert len(st) == 50 * n
    assert np.all(st[n:] == n - 1)  # after the first round, every push sees the n - 1 others'
    assert res.staleness_stats()["p50"] == n - 1


def test_ssp0_equals_bsp_throughput_and_ssp_staleness_counts_pushes():
    n = 6
    res = run("ssp:0", n, S.Costs(C), "lognormal:0.6", seed=3)
    bsp = run("bsp:p2p", n, S.Costs(C), "lognormal:0.6", seed=3)
    assert res.samples_per_s == pytest.approx(bsp.samples_per_s, rel=1e-9)
    assert res.staleness.max() <= n - 1  # SSP(0): only the pushes of the same clock


def test_quorum_n_equals_bsp_p2p():
    costs = S.Costs(
        C, push_tx_s=0.004, reply_tx_s=0.001, latency_s=1e-4, owner_push_s=1e-4, owner_round_s=2e-4
    )
    a = run("quorum:n", 6, costs, "lognormal:0.3", seed=1)
    b = run("bsp:p2p", 6, costs, "lognormal:0.3", seed=1)
    assert a.samples_per_s == b.samples_per_s and a.steps == b.steps


# ---------------------------------------------------------------------------------------------------
# Local steps: H steps of compute per push, under the outer policy's rules
# ---------------------------------------------------------------------------------------------------

LOCAL = ("local:16", "local:16:quorum:n-1", "local:16:async")


@pytest.mark.parametrize(
    "spec, outer",
    # local:1:async's outer policy is ASP that waits for its own answers: SSP with no effective bound
    [("local:1", "bsp"), ("local:1:quorum:n-1", "quorum:n-1"), ("local:1:async", "ssp:1000000")],
)
@pytest.mark.parametrize("scen", ["lognormal:0.3", "one-slow"])
def test_local_with_one_step_equals_its_outer_policy(spec, outer, scen):
    costs = S.Costs(
        C, push_tx_s=0.004, reply_tx_s=0.001, latency_s=1e-4, owner_push_s=1e-4, owner_round_s=2e-4,
        collective_s=0.003,
    )  # fmt: skip
    a = run(spec, 6, costs, scen, seed=2, trace=True)
    b = run(outer, 6, costs, scen, seed=2, trace=True)
    assert a.samples_per_s == b.samples_per_s and a.window_samples_per_s == b.window_samples_per_s
    assert a.steps == b.steps and a.pushes_dropped == b.pushes_dropped
    assert np.array_equal(a.staleness, b.staleness) and a.trace == b.trace


@pytest.mark.parametrize("spec", LOCAL)
def test_local_equal_workers_without_costs_push_every_h_steps(spec):
    n, h = 4, 16
    res = run(spec, n, S.Costs(C), budget=10 * h * n, trace=True)
    assert res.samples_per_s == pytest.approx(n * BATCH / C, rel=1e-9)
    assert res.steps == [10 * h] * n
    assert res.pushes_applied + res.pushes_dropped == 10 * n  # one push per H steps
    for w in range(n):  # each worker's pushes carry the outer clocks 0..9, at the end of every H-th step
        assert [k for _, v, k in res.trace["pushes"] if v == w] == list(range(10))
        times = [t for t, v, _ in res.trace["pushes"] if v == w]
        assert times == pytest.approx([(i + 1) * h * C for i in range(10)], rel=1e-9)


def test_local_async_staleness_counts_outer_steps():
    """As ASP's: with equal workers each push sees the n - 1 others' of the round before (in pushes)."""
    n = 5
    res = run("local:16:async", n, S.Costs(C), budget=16 * 20 * n)
    assert len(res.staleness) == 20 * n
    assert np.all(res.staleness[n:] == n - 1)


def test_local_bytes_fall_by_h_and_each_step_pays_the_inner_optimizer():
    n, h, link = 64, 16, S.LINKS["10g"]
    work = S.Workload()
    for spec, outer in zip(LOCAL, ("bsp", "quorum:n-1", "asp")):
        loc = S.model_costs(S.parse_policy(spec, n), n, work, link, S.KERNELS)
        out = S.model_costs(S.parse_policy(outer, n), n, work, link, S.KERNELS)
        assert loc.bytes_per_step == pytest.approx(out.bytes_per_step / h, rel=1e-12)
        assert loc.local_host_s == pytest.approx(S.KERNELS["apply:none"] * work.params, rel=1e-12)
        assert (loc.push_tx_s, loc.reply_tx_s, loc.collective_s) == (
            out.push_tx_s, out.reply_tx_s, out.collective_s,
        )  # fmt: skip
        assert out.local_host_s == 0.0


def test_one_slow_worker_halves_local_sync_but_not_local_async():
    """local:16 meets at a barrier every 16 steps, so the 2x straggler halves it as it halves BSP;
    local:16:async waits only for its own answers, so it loses half a worker, as ASP; quorum:n-1 too
    (the straggler's pushes are late and dropped)."""
    n = 8
    sync = run("local:16", n, S.Costs(C), "one-slow", budget=16 * 10 * n)
    assert sync.samples_per_s == pytest.approx(n * BATCH / (2 * C), rel=1e-9)
    for spec in ("local:16:async", "local:16:quorum:n-1"):
        res = run(spec, n, S.Costs(C), "one-slow", budget=16 * 100 * n)
        assert res.window_samples_per_s == pytest.approx((n - 1 + 0.5) * BATCH / C, rel=0.01), spec
        assert res.steps[-1] == pytest.approx(max(res.steps) / 2, rel=0.05)
    assert run("local:16:quorum:n-1", n, S.Costs(C), "one-slow", budget=16 * 100 * n).pushes_dropped > 0


def test_local_policies_parse():
    pol = S.parse_policy("local:16:quorum:n-1", 8)
    assert (pol.kind, pol.quorum, pol.local, pol.local_steps) == ("quorum", 7, "quorum", 16)
    assert pol.resolved == "local:16:quorum:7" and not pol.synchronous
    assert S.parse_policy("local:16", 8).kind == "bsp" and S.parse_policy("local:16", 8).synchronous
    assert S.parse_policy("local:4:async+int8", 8).kind == "asp:wait"
    assert S.parse_policy("local:4:async+int8", 8).codec == "int8"
    assert type(S.parse_policy("local:4:async", 8).round(8)).__name__ == "PushRound"
    assert S.parse_policy("local:4", 8).round(8) is None  # a barrier on collectives: no owner
    for bad in ("local", "local:0", "local:16:quorum:9", "local:16:quorum:n-8", "local:16:lr=0.5",
                "local:16:foo", "local:16:quorum"):  # fmt: skip
        with pytest.raises(ValueError):
            S.parse_policy(bad, 8)


def test_cli_grid_local_policies(tmp_path):
    out = tmp_path / "sim.json"
    argv = ["--out", str(out), "--n", "8", "--policies", "ddp,quorum:n-1,local:16:quorum:n-1",
            "--scenarios", "one-slow", "--worker-steps", "256", "--steps", "4", "--link", "10g"]  # fmt: skip
    assert S.main(argv) == 0
    recs = {r["policy"]: r for r in json.loads(out.read_text())}
    for r in recs.values():
        assert set(r) == GRID_FIELDS
    loc, q = recs["local:16:quorum:n-1"], recs["quorum:n-1"]
    assert loc["policy_resolved"] == "local:16:quorum:7"
    assert loc["budget_steps"] == 16 * q["budget_steps"]  # as many pushes per worker as the others' steps
    assert loc["bytes_per_step"] == pytest.approx(q["bytes_per_step"] / 16, rel=1e-12)
    assert loc["samples_per_s_vs_ddp"] > q["samples_per_s_vs_ddp"]


# ---------------------------------------------------------------------------------------------------
# Processor sharing, ring, links
# ---------------------------------------------------------------------------------------------------


def test_processor_sharing_equal_workers():
    """4 workers, 2 cores, W CPU seconds each: every step takes 2 W."""
    w = 0.01
    res = run("ddp", 4, S.Costs(C, host_c_s=w, extra_only=True), cores=2, budget=40)
    assert res.samples_per_s == pytest.approx(4 * BATCH / (2 * w), rel=1e-9)


def test_processor_sharing_lends_a_sleeping_stragglers_core():
    """Rank 3 sleeps d before its W: the others share 2 cores three ways meanwhile, so a DDP step takes
    2 W + d / 3, not 2 W + d (by hand: valid while 2 d / 3 <= W)."""
    w, d = 0.01, 0.003
    costs = S.Costs(d, host_c_s=w, extra_only=True)  # extra_only: the straggler (factor 2) sleeps (2 - 1) d
    res = run("ddp", 4, costs, "one-slow", cores=2, budget=40)
    assert res.samples_per_s == pytest.approx(4 * BATCH / (2 * w + d / 3), rel=1e-9)


def test_ddp_ring_formula():
    n, link = 16, S.LINKS["10g"]
    work = S.Workload(params=1_000_000, batch=BATCH, compute_s=C)
    pol = S.parse_policy("ddp", n)
    costs = S.model_costs(pol, n, work, link, S.KERNELS)
    ring = 2 * (n - 1) * (link.alpha_s + link.latency_s) + 2 * (n - 1) / n * 4e6 * link.beta_s_per_byte
    assert costs.collective_s == pytest.approx(ring + S.KERNELS["apply:none"] * 1e6, rel=1e-12)
    assert costs.bytes_per_step == pytest.approx(2 * (n - 1) / n * 4e6)
    res = S.simulate(pol, n, costs, S.scenario("equal"), 10 * n, batch=BATCH)
    assert res.samples_per_s == pytest.approx(n * BATCH / (C + costs.collective_s), rel=1e-9)


def test_asp_bound_by_its_link():
    """With (almost) no compute, ASP runs at the rate each rank's link can carry: per step one push
    burst and n - 1 answers (one to each other worker's push)."""
    n, push, reply = 4, 0.02, 0.005
    costs = S.Costs(1e-6, push_tx_s=push, reply_tx_s=reply)
    res = run("asp", n, costs, budget=400 * n)
    assert res.window_samples_per_s == pytest.approx(n * BATCH / (push + (n - 1) * reply), rel=0.02)


def test_bsp_p2p_step_is_push_then_answers():
    """BSP point to point, equal workers: compute, the push burst, then each owner's n - 1 answers."""
    n, push, reply = 4, 0.02, 0.005
    costs = S.Costs(C, push_tx_s=push, reply_tx_s=reply)
    res = run("bsp:p2p", n, costs, budget=40 * n)
    assert res.samples_per_s == pytest.approx(n * BATCH / (C + push + (n - 1) * reply), rel=1e-9)


# ---------------------------------------------------------------------------------------------------
# SSP's bound, determinism
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("s", [0, 1, 3])
def test_ssp_never_more_than_s_clocks_ahead(s):
    n = 6
    costs = S.Costs(C, push_tx_s=0.002, reply_tx_s=0.001, latency_s=1e-4, owner_push_s=2e-4)
    res = run(f"ssp:{s}", n, costs, "lognormal:0.6", budget=80 * n, seed=7, trace=True)
    tr = res.trace
    pushes = {w: sorted(t for t, v, _ in tr["pushes"] if v == w) for w in range(n)}
    closed = {w: t for t, w in tr["closes"]}
    lead = 0
    for t, w, k, _ in tr["starts"]:  # w starts step k having completed k steps
        for v in range(n):
            if v == w or closed.get(v, np.inf) <= t:
                continue
            done_v = int(np.searchsorted(pushes[v], t, side="right"))
            assert k - done_v <= s, (t, w, k, v, done_v)
            lead = max(lead, k - done_v)
    assert lead == s  # the bound is reached: the model does not hold workers back more than SSP does


def test_deterministic_with_a_seed():
    costs = S.Costs(C, push_tx_s=0.003, reply_tx_s=0.001)
    a = run("asp", 8, costs, "pauses", seed=11)
    b = run("asp", 8, costs, "pauses", seed=11)
    c = run("asp", 8, costs, "pauses", seed=12)
    assert a.samples_per_s == b.samples_per_s and np.array_equal(a.staleness, b.staleness)
    assert a.steps == b.steps and a.wait_s == b.wait_s
    assert a.samples_per_s != c.samples_per_s


def test_scenarios_and_policies_parse():
    assert S.parse_policy("quorum:n-1", 8).quorum == 7
    assert S.parse_policy("quorum:n", 8).quorum == 8
    assert S.parse_policy("asp+int8", 8).codec == "int8"
    for bad in ("quorum:9", "quorum:n-8", "ssp", "ddp+int8", "foo", "asp+zip"):
        with pytest.raises(ValueError):
            S.parse_policy(bad, 8)
    f = S.scenario("one-slow").factors(np.random.default_rng(0), 4, 3)
    assert f.tolist() == [[1, 1, 1], [1, 1, 1], [1, 1, 1], [2, 2, 2]]
    f = S.scenario("lognormal:0.6").factors(np.random.default_rng(0), 256, 400)
    assert f.mean() == pytest.approx(1.0, abs=0.01)  # mean 1 by construction
    f = S.scenario("pauses:0.5:10").factors(np.random.default_rng(0), 64, 100)
    assert set(np.unique(f)) == {1.0, 11.0}
    with pytest.raises(ValueError):
        S.scenario("sometimes")


# ---------------------------------------------------------------------------------------------------
# Calibration against the committed measurements
# ---------------------------------------------------------------------------------------------------


def test_calibration_constants_match_the_result_files():
    fit = S.loopback_from_overlap(ROOT / "bench/results/overlap_cpu.json")
    lb = S.LINKS["loopback"]
    assert fit["ddp_alpha_s"] == pytest.approx(lb.alpha_s, rel=0.01)
    assert fit["pyasync_alpha_s"] == pytest.approx(lb.alpha_p2p_s, rel=0.01)
    assert fit["ddp_beta_s_per_byte"] == pytest.approx(lb.beta_s_per_byte, rel=0.01)
    kern = S.kernels_from_file(ROOT / "bench/results/kernels_cpu_2core.json")
    assert set(S.KERNELS) <= set(kern)
    for op, v in S.KERNELS.items():
        assert kern[op] == pytest.approx(v, rel=0.001), op


def test_bytes_model_matches_the_measured_counters():
    """pyasync's own byte counts in the e2e runs: pushes, answers, close()'s final answers."""
    recs = S.load_e2e([ROOT / "bench/results/e2e_cpu", ROOT / "bench/results/e2e_cpu_wide"])
    seen = 0
    for r in recs:
        if r.get("kind") != "pyasync" or r.get("skipped"):
            continue
        pol = S.record_policy(r)
        n = r["workers"]
        model = S.check_bytes_per_step(pol, n, r["params"], sum(r["steps_per_rank"]) / n)
        tol = 2e-4 if pol.codec == "none" else 2e-3  # codec block tails
        assert model == pytest.approx(r["bytes_per_step"], rel=tol), (r["system"], r["model"])
        seen += 1
    assert seen >= 40


# ---------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------

GRID_FIELDS = {
    "bench", "link", "scenario", "scenario_about", "n", "policy", "policy_resolved", "compression",
    "samples_per_s", "samples_per_s_vs_ddp", "applied_samples_per_s", "makespan_samples_per_s",
    "compute_bound_samples_per_s", "staleness_mean", "staleness_p50", "staleness_p99", "staleness_max",
    "wait_fraction", "dropped_fraction", "steps_per_worker", "bytes_per_step", "budget_steps", "batch",
    "costs", "scenario_params", "calibration", "seed", "window", "sim_s", "machine", "command",
}  # fmt: skip
CHECK_FIELDS = {
    "bench", "folder", "model", "scenario", "system", "workers", "cores", "device_ms", "bandwidth_gbps",
    "measured_samples_per_s", "role", "calibrated_from", "policy_model", "compression", "host_cpu_ms",
    "host_compute_ms", "compute_s", "predicted_samples_per_s", "error", "within_tolerance", "tolerance",
    "measured_vs_ddp", "predicted_vs_ddp", "measured_bytes_per_step", "predicted_bytes_per_step",
    "bytes_source", "bytes_error", "measured_staleness_p50", "measured_staleness_p99",
    "predicted_staleness_p50", "predicted_staleness_p99", "measured_dropped", "predicted_dropped_fraction",
    "costs", "seed", "window", "machine", "command", "calibration_note",
}  # fmt: skip


def test_cli_grid_writes_the_documented_fields(tmp_path, capsys):
    out, plots = tmp_path / "sim.json", tmp_path / "png"
    argv = ["--out", str(out), "--plot", str(plots), "--n", "8,32", "--policies", "ddp,asp,quorum:n-1",
            "--scenarios", "one-slow,pauses", "--worker-steps", "256", "--link", "10g"]  # fmt: skip
    assert S.main(argv) == 0
    recs = json.loads(out.read_text())
    assert len(recs) == 2 * 2 * 3
    for r in recs:
        assert set(r) == GRID_FIELDS
        assert r["calibration"]["link"]["name"] == "10g"
        assert r["samples_per_s"] > 0 and r["samples_per_s"] <= r["compute_bound_samples_per_s"] * 1.01
    ddp = [r for r in recs if r["policy"] == "ddp"]
    assert all(r["samples_per_s_vs_ddp"] == 1.0 for r in ddp)
    asp = {(r["scenario"], r["n"]): r for r in recs if r["policy"] == "asp"}
    assert asp[("one-slow", 8)]["samples_per_s_vs_ddp"] > 1.5
    assert sorted(p.name for p in plots.iterdir()) == ["simulate_10g_one-slow.png", "simulate_10g_pauses.png"]
    with pytest.raises(SystemExit):  # bad arguments exit with argparse's status 2
        S.main(["--n", "1", "--policies", "ddp"])


def test_cli_check_on_the_two_worker_runs(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert S.main(["--check", str(ROOT / "bench/results/e2e_cpu_2workers"), "--check-out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 12
    for r in rows:
        assert set(r) == CHECK_FIELDS
    fits = [r for r in rows if r["role"] == "fit"]
    preds = [r for r in rows if r["role"] == "predict"]
    assert len(fits) == 6 and len(preds) == 6
    assert all(abs(r["error"]) < 1e-3 for r in fits)
    assert all(r["scenario"] == "slow2x" and r["calibrated_from"].endswith("(equal)") for r in preds)
    assert "predictions within 15%" in capsys.readouterr().out


def test_check_on_emulated_device_runs(tmp_path):
    """A folder like the coming e2e_cpu_device: 4 workers on 2 cores, D = 20 ms of emulated device per
    step. DDP, equal: a step is D + 2 W (four share two cores), so the fit gives W = 5 ms from 8533.3
    samples/s. With rank 3 sleeping 2 D, the others finish at D + 1.5 W <= 2 D and the step takes 2 D + W:
    45 ms, 5688.9 samples/s."""
    base = {
        "system": "ddp", "kind": "ddp", "policy": None, "compression": None, "model": "mlp", "workers": 4,
        "params": 301066, "device_ms": 20.0, "bandwidth_gbps": None, "compute_s": None,
        "config": {"budget_steps": 400, "batch_size": 64}, "machine": {"cpu_affinity": 2},
        "steps_per_rank": [100] * 4, "bytes_per_step": 1806396.0, "transient": None, "speeds": None,
    }  # fmt: skip
    recs = [
        {**base, "scenario": "equal", "straggler": None, "samples_per_s": 4 * 64 / 0.030},
        {**base, "scenario": "slow2x", "straggler": {"rank": 3, "factor": 2.0}, "samples_per_s": 5000.0},
    ]
    folder = tmp_path / "e2e_cpu_device"
    folder.mkdir()
    (folder / "e2e.json").write_text(json.dumps(recs))
    rows = S.run_check([str(folder)])
    fit, pred = rows
    assert fit["role"] == "fit" and fit["host_cpu_ms"] == pytest.approx(5.0, rel=1e-4)
    assert pred["role"] == "predict"
    assert pred["predicted_samples_per_s"] == pytest.approx(4 * 64 / 0.045, rel=1e-4)
    assert pred["error"] == pytest.approx(4 * 64 / 0.045 / 5000.0 - 1, rel=1e-3)
