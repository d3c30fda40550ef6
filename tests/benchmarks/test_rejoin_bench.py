"""bench/rejoin.py on a tiny state: a joiner is admitted into a job of 2, and the record's figures are
consistent (the joiner's request-to-engine time within its process-start-to-first-push time, the
members' pause within the bound, the counted bytes as the layout says)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from _dist import multiproc

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import rejoin


@multiproc
def test_a_join_is_measured(tmp_path):
    out = tmp_path / "rejoin.json"
    (row,) = rejoin.main(["--numel", "1M", "--donors", "2", "--timeout", "120", "--out", str(out)])
    assert json.loads(out.read_text())["runs"] == [row]
    assert 0 < row["joiner_request_to_engine_s"] < row["joiner_start_to_first_push_s"] < 120
    assert 0 < row["members_pause_s"] <= row["members_pause_max_s"] < 60
    assert row["replica_bytes_per_donor"] == 10**6 * 4 // 2
    assert row["allreduce_reshard_bytes_per_member"] == int(2 * 2 / 3 * 2 * 10**6 * 4)
    # counted: the joiner gets the whole replica (4 MB) and its third of masters and momentum (8 MB / 3)
    assert abs(row["joiner_bytes_received"] - (4 * 10**6 + 8 * 10**6 / 3)) < 0.01 * 8 * 10**6 / 3, row
    # each donor sends its half of the replica and what leaves its shard, less than the all-reduce did
    assert row["replica_bytes_per_donor"] < row["member_bytes_sent_median"] <= row["member_bytes_sent_max"]
    assert row["member_bytes_sent_max"] < row["allreduce_reshard_bytes_per_member"]
    assert row["busiest_link_bytes"] == max(row["member_bytes_sent_max"], row["joiner_bytes_received"])
    # the processes' own CPU time in the change: some, and no more than two cores in that time
    assert 0 < row["joiner_cpu_s"] <= 2 * row["joiner_request_to_engine_s"] + 0.1, row
    assert 0 < row["members_cpu_s_max"] <= 2 * row["members_pause_max_s"] + 0.1, row


@multiproc
def test_a_job_of_one_worker_is_joined(tmp_path):
    """One donor: the joiner gets the whole replica and half the state from the job's only worker."""
    out = str(tmp_path / "rejoin.json")
    (row,) = rejoin.main(["--numel", "1M", "--donors", "1", "--timeout", "120", "--out", out])
    assert abs(row["joiner_bytes_received"] - (4 * 10**6 + 8 * 10**6 / 2)) < 0.01 * 8 * 10**6 / 2, row
    assert row["member_bytes_sent_max"] == row["joiner_bytes_received"], row
