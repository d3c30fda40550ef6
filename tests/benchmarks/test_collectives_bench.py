"""Smoke test of bench/collectives.py: 2 ranks, two small sizes, one round; the record schema and that
every (size, op) pair is measured. Never a speed ratio (that is what the benchmark reports)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import collectives  # noqa: E402

pytestmark = pytest.mark.multiproc


def test_collectives_bench_records(tmp_path):
    out = tmp_path / "c.json"
    rc = collectives.main(
        ["--ranks", "2", "--sizes", "1K,4K", "--iters", "2", "--rounds", "1", "--out", str(out)]
    )
    assert rc == 0
    recs = json.loads(out.read_text())
    assert {(r["numel"], r["op"]) for r in recs} == {(n, o) for n in (1000, 4000) for o in collectives.OPS}
    for r in recs:
        assert r["bench"] == "collectives" and r["ranks"] == 2
        assert r["ms"] > 0 and r["cpu_ms"] >= 0 and len(r["rounds"]) == 1
        assert r["machine"]["cpu_count"] >= 1 and r["command"]


def test_collectives_bench_refuses_bad_sizes(capsys):
    with pytest.raises(SystemExit):
        collectives.main(["--sizes", "abc"])
    assert "--sizes" in capsys.readouterr().err
