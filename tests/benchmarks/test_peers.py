"""The benchmark's peers (bench/harness/peers.py) and the process-tree clean-up of local runs.

What needs no peer library runs everywhere: ending a worker's whole process tree (on a timeout, a
failure and a clean exit), system names, the socket byte parser, the /proc walk. The runs of hivemind
and torchft themselves need the peers' venv (``bash bench/peers/setup.sh``) and skip elsewhere, saying so.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # before the imports; spawned workers inherit sys.path
from _bench import load_e2e  # noqa: E402
from harness import peers as P  # noqa: E402
from harness import workload as W  # noqa: E402

from pyasync import demo as h  # noqa: E402
from pyasync.demo import local as L  # noqa: E402

# A process that ignores SIGTERM and starts a child that ignores it too, then waits to be killed.
STUBBORN = (
    "import signal, subprocess, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(600)'],"
    " stdout=subprocess.PIPE)\n"
    "child.stdout.readline()\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(600)\n"
)


def _alive(pid: int) -> bool:
    """True while ``pid`` is a live (not zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


linux_only = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")


# ---------------------------------------------------------------------------------------------------
# Ending process groups
# ---------------------------------------------------------------------------------------------------


@linux_only
def test_end_process_groups_escalates_to_sigkill():
    p = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, start_new_session=True)
    try:
        grandchild = int(p.stdout.readline())
        assert set(L.process_group_members(p.pid)) == {p.pid, grandchild}
        t0 = time.monotonic()
        left = L.end_process_groups([p.pid], grace_s=1.0)
        assert set(left) == {p.pid, grandchild}  # both ignored SIGTERM
        assert time.monotonic() - t0 < 10
        p.wait(timeout=10)
        assert p.returncode == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while _alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(grandchild) and L.process_group_members(p.pid) == []
    finally:
        if p.poll() is None:
            p.kill()


@linux_only
def test_end_process_groups_sigterm_is_enough_and_empty_groups_are_fine():
    p = subprocess.Popen(
        [sys.executable, "-c", "import time; print(flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    p.stdout.readline()
    assert L.end_process_groups([p.pid], grace_s=10.0) == []
    assert p.wait(timeout=10) == -signal.SIGTERM
    assert L.end_process_groups([p.pid], grace_s=1.0) == []  # nothing left: no error


def _tree_worker(cfg, rank, store, progress=None, data=None):
    """A worker that starts two grandchildren (one ignores SIGTERM), publishes their pids, and then
    hangs (cfg.fault's kind "hang") or returns (rank 0's result: its pids)."""
    obeys = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    stubborn = subprocess.Popen(
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
         "print(flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    stubborn.stdout.readline()  # its handler is in place
    store.set(f"pids{rank}", f"{obeys.pid},{stubborn.pid}")
    if cfg.fault is not None and cfg.fault[2] == "hang":
        threading.Event().wait()  # until the parent ends the run
    return [obeys.pid, stubborn.pid] if rank == 0 else None


def _pids_of(store, prefix, workers):
    out = []
    for r in range(workers):
        key = f"{prefix}harness//pids{r}"  # the workers' PrefixStore joins its prefix and key with "/"
        store.wait([key], datetime.timedelta(seconds=5))
        out += [int(x) for x in store.get(key).decode().split(",")]
    return out


@linux_only
@pytest.mark.multiproc
def test_run_timeout_ends_every_process_a_worker_started():
    cfg = h.TrainConfig(system=h.parse_system("ddp", 2), workers=2, epochs=1, hidden=16, fault=(0, 0, "hang"))
    store = h.start_store_server()
    with pytest.raises(h.WorkerError, match="did not finish within"):
        h.run_local(cfg, store, prefix="tree-timeout/", run_timeout_s=45, worker=_tree_worker)
    pids = _pids_of(store, "tree-timeout/", 2)  # published before the timeout, or the test is too slow
    assert len(pids) == 4
    survivors = [p for p in pids if _alive(p)]
    assert survivors == [], f"processes left behind after the run timed out: {survivors}"


@linux_only
@pytest.mark.multiproc
def test_clean_run_ends_what_its_workers_left_running():
    cfg = h.TrainConfig(system=h.parse_system("ddp", 2), workers=2, epochs=1, hidden=16)
    store = h.start_store_server()
    result = h.run_local(cfg, store, prefix="tree-clean/", run_timeout_s=120, worker=_tree_worker)
    pids = _pids_of(store, "tree-clean/", 2)
    assert result == pids[:2]
    assert [p for p in pids if _alive(p)] == []


# ---------------------------------------------------------------------------------------------------
# System names, byte counting helpers
# ---------------------------------------------------------------------------------------------------


def test_parse_peer_systems():
    hm = W.parse_system("hivemind", 4)
    assert (hm.kind, hm.peer_round, hm.synchronous, hm.is_peer) == ("hivemind", None, False, True)
    assert W.parse_system("hivemind:8", 4).peer_round == 8
    ft = W.parse_system("torchft", 4)
    assert (ft.kind, ft.synchronous, ft.is_peer) == ("torchft", True, True)
    assert not ft.is_ddp and not ft.is_pyasync
    assert not W.parse_system("ddp", 4).is_peer and not W.parse_system("asp", 4).is_peer


def test_parse_torchft_local_systems():
    import pyasync

    dl = W.parse_system("torchft-diloco", 4)
    assert (dl.kind, dl.synchronous, dl.is_peer, dl.policy) == ("torchft-diloco", True, True, None)
    assert not dl.is_ddp and not dl.is_pyasync
    # Default H and outer hyperparameters: pyasync's local:H ones, so the default comparison is like for like.
    local = pyasync.parse_policy("local:16")
    assert (dl.peer_round, dl.outer_lr, dl.outer_momentum) == (16, local.outer_lr, local.outer_momentum)
    assert (dl.outer_lr, dl.outer_momentum) == (0.5, 0.8)
    assert W.parse_system("torchft-diloco:16", 4) == dataclasses.replace(dl, name="torchft-diloco:16")
    tuned = W.parse_system("torchft-diloco:8:lr=0.7:momentum=0.9", 4)
    assert (tuned.peer_round, tuned.outer_lr, tuned.outer_momentum) == (8, 0.7, 0.9)
    assert W.parse_system("torchft-diloco:momentum=0", 4).outer_momentum == 0.0  # plain SGD outer step
    assert W.parse_system("TorchFT-DiLoCo:4", 4).name == "TorchFT-DiLoCo:4"  # the name as given
    ls = W.parse_system("torchft-localsgd:4", 4)
    assert (ls.kind, ls.synchronous, ls.is_peer, ls.peer_round) == ("torchft-localsgd", True, True, 4)
    assert ls.outer_lr is None and W.parse_system("torchft-localsgd", 4).peer_round == 16


def test_torchft_local_systems_through_the_shared_parser():
    from harness import cli

    specs = cli.parse_system_specs(
        "ddp,local:16,torchft-diloco:16,torchft-localsgd:16", 4, kinds=W.PEER_KINDS + ("ddp", "pyasync")
    )
    assert [s.kind for s in specs] == ["ddp", "pyasync", "torchft-diloco", "torchft-localsgd"]
    with pytest.raises(ValueError, match="torchft-diloco:16.*runs pyasync, torchft systems only"):
        cli.parse_system_specs("asp,torchft-diloco:16", 4, kinds=("pyasync", "torchft"))
    assert [s.name for s in W.parse_systems("torchft-diloco,torchft-diloco:8", 4)] == [
        "torchft-diloco",
        "torchft-diloco:8",
    ]


def test_e2e_help_names_the_torchft_local_systems():
    bench = load_e2e()
    text = "".join(bench.build_parser().format_help().split())  # argparse wraps lines at hyphens too
    assert "torchft-diloco[:H][:lr=X][:momentum=M]" in text and "torchft-localsgd[:H]" in text


@pytest.mark.parametrize(
    "token, message",
    [
        ("hivemind:0", "round must be an int >= 1"),
        ("hivemind:x", "round must be an int >= 1"),
        ("torchft:2", "torchft takes no argument"),
        ("torchft+int8", "runs without compression"),
        ("hivemind:4+fp16", "runs without compression"),
        ("gossip", "'torchft'"),
        ("gossip", "'torchft-diloco'"),
        ("torchft-diloco:0", r"torchft-diloco takes H, its inner steps per sync, an int >= 1"),
        ("torchft-diloco:-3", "an int >= 1"),
        ("torchft-diloco:x", "an int >= 1"),
        ("torchft-diloco:", "an int >= 1"),
        ("torchft-localsgd:0", r"torchft-localsgd takes H, its inner steps per sync, an int >= 1"),
        ("torchft-diloco:4:8", "takes one H"),
        ("torchft-diloco:16:lr=0", r"outer lr must be a finite number > 0 and its momentum in \[0, 1\)"),
        ("torchft-diloco:16:lr=inf", "outer lr must be a finite number > 0"),
        ("torchft-diloco:16:lr=fast", "outer lr must be a finite number > 0"),
        ("torchft-diloco:16:momentum=1", r"momentum in \[0, 1\)"),
        ("torchft-diloco:16:momentum=-0.1", r"momentum in \[0, 1\)"),
        (
            "torchft-diloco:16:beta=0.9",
            r"unknown option\(s\) \['beta'\] for torchft-diloco; it takes \['lr', 'momentum'\]",
        ),
        (
            "torchft-localsgd:16:lr=0.5",
            r"unknown option\(s\) \['lr'\] for torchft-localsgd; it takes no options",
        ),
        ("torchft-diloco:16+int8", "runs without compression"),
        ("torchft-localsgd+fp16", "runs without compression"),
    ],
)
def test_parse_peer_system_errors(token, message):
    with pytest.raises(ValueError, match=message):
        W.parse_system(token, 4)


SS_OUTPUT = """\
ESTAB 0 0 127.0.0.1:40001 127.0.0.1:40002 users:(("p2pd",pid=111,fd=9))
\t cubic wscale:7,7 rto:201 bytes_sent:1500 bytes_acked:1501 bytes_received:900 segs_out:10
ESTAB 0 0 127.0.0.1:40002 127.0.0.1:40001 users:(("p2pd",pid=222,fd=7))
\t cubic wscale:7,7 rto:201 bytes_sent:900 bytes_acked:901 bytes_received:1500
ESTAB 0 0 127.0.0.1:5000 127.0.0.1:5001 users:(("python",pid=333,fd=3))
\t cubic bytes_sent:77777 bytes_received:1
ESTAB 0 0 127.0.0.1:40003 127.0.0.1:40004 users:(("p2pd",pid=111,fd=10))
\t cubic wscale:7,7 rto:201 segs_out:1
"""


def test_parse_ss_bytes_sent():
    assert P.parse_ss_bytes_sent(SS_OUTPUT, {111}) == {
        "127.0.0.1:40001>127.0.0.1:40002": 1500,
        "127.0.0.1:40003>127.0.0.1:40004": 0,  # no bytes sent yet: ss omits the field
    }
    assert sum(P.parse_ss_bytes_sent(SS_OUTPUT, {111, 222}).values()) == 2400
    assert P.parse_ss_bytes_sent(SS_OUTPUT, {999}) == {}
    one_line = 'ESTAB 0 0 1.2.3.4:1 5.6.7.8:2 users:(("p2pd",pid=5,fd=1)) cubic bytes_sent:42\n'
    assert P.parse_ss_bytes_sent(one_line, {5}) == {"1.2.3.4:1>5.6.7.8:2": 42}


@linux_only
def test_descendants_finds_grandchildren_by_name():
    p = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, start_new_session=True)
    try:
        grandchild = int(p.stdout.readline())
        found = P.descendants(os.getpid())
        assert p.pid in found and grandchild in found
        assert P.descendants(grandchild) == {}
    finally:
        L.end_process_groups([p.pid], grace_s=0.5)
        p.wait(timeout=10)


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_socket_bytes_of_this_process_count_what_it_sent():
    import socket

    srv = socket.create_server(("127.0.0.1", 0))
    cli = socket.create_connection(srv.getsockname())
    conn, _ = srv.accept()
    try:
        cli.sendall(b"x" * 10_000)
        got = 0
        while got < 10_000:
            got += len(conn.recv(65536))
        sent = P.socket_bytes_sent({os.getpid()})
        name = f"127.0.0.1:{cli.getsockname()[1]}>127.0.0.1:{srv.getsockname()[1]}"
        assert sent[name] == 10_000
    finally:
        for s in (cli, conn, srv):
            s.close()


def test_peer_status_says_how_to_get_the_peers():
    for kind in W.PEER_KINDS:
        why = P.peer_status(kind)
        if importlib.util.find_spec(kind.split("-")[0]) is None:
            assert why is not None and "bench/peers/setup.sh" in why
    with pytest.raises(ValueError):
        P.peer_status("gossip")


# ---------------------------------------------------------------------------------------------------
# The peers themselves (peers' venv only)
# ---------------------------------------------------------------------------------------------------


def _p2pd_pids() -> set[int]:
    out = set()
    for e in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if e.isdigit():
            try:
                with open(f"/proc/{e}/comm") as f:
                    if f.read().strip() == "p2pd":
                        out.add(int(e))
            except OSError:
                pass
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", ["torchft", "hivemind:4", "torchft-diloco:4", "torchft-localsgd:4"])
def test_peer_tiny_run(tmp_path, kind):
    why = P.peer_status(kind.split(":")[0])
    if why is not None:
        pytest.skip(f"needs the peers' venv (bash bench/peers/setup.sh): {why}")
    bench = load_e2e()
    out = tmp_path / "out"
    args = ["--out", str(out), "--workers", "2", "--epochs", "4", "--batch-size", "32", "--systems", kind]
    args += ["--scenarios", "equal", "--models", "mlp", "--device-ms", "5", "--bandwidth", "4"]
    args += ["--eval-points", "5", "--no-progress", "--run-timeout", "300"]
    before = _p2pd_pids()
    (rec,) = bench.main(args)
    assert not rec.get("error") and rec["samples_per_s"] > 0 and 0 < rec["final_acc"] <= 1
    peer = rec["peer"]
    if kind == "torchft":
        n_params = sum(p.numel() for p in h.make_model(512, 0).parameters())
        assert rec["bytes_per_step"] == pytest.approx(n_params * 4)  # ring model, n=2: 1x the gradient
        assert rec["replicas_equal"] is True and rec["bandwidth_gbps"] == 4.0
        assert peer["committed_steps"] == rec["steps_per_rank"][0] + 1  # + the warm-up step
    elif kind.startswith("torchft-"):
        n_params = sum(p.numel() for p in h.make_model(512, 0).parameters())
        steps = rec["steps_per_rank"]
        assert steps[0] == steps[1] == 88 and peer["inner_steps"] == 88  # 4 epochs of 22 steps
        assert (
            peer["sync_every"] == 4
            and peer["syncs_committed"] == 22
            and peer["inner_steps_since_last_sync"] == 0
        )
        assert peer["allreduces"] == 22 * len(list(h.make_model(512, 0).parameters()))  # one per tensor
        assert rec["bytes_per_step"] == pytest.approx(n_params * 4 / 4)  # ring model, n=2: 1x per 4 steps
        assert rec["replicas_equal"] is True and rec["bandwidth_gbps"] == 4.0  # ended on a sync
        if kind.startswith("torchft-diloco"):
            assert (peer["outer_lr"], peer["outer_momentum"], peer["use_async_quorum"]) == (0.5, 0.8, False)
    else:
        assert peer["round_steps_per_peer"] == 4 and peer["target_group_size"] == 2
        assert rec["bandwidth_gbps"] == 4.0 and peer["link"] == "not emulated"
        assert rec["link_emulated"] is False and rec["samples_per_s_vs_ddp"] is None  # no ddp in this run
        if peer["bytes"] is not None:
            assert rec["mb_sent"] > 0
    # hivemind's processes outlive their worker as orphans (no longer our descendants) if anything: look
    # for libp2p daemons machine-wide (nothing else here runs one).
    assert _p2pd_pids() <= before


def test_summary_marks_rows_outside_the_link():
    from harness import summary as E

    recs = [
        {"system": "ddp", "model": "mlp", "scenario": "equal", "samples_per_s": 100.0, "bandwidth_gbps": 1.0},
        {"system": "hivemind", "model": "mlp", "scenario": "equal", "samples_per_s": 50.0,
         "bandwidth_gbps": 1.0, "link_emulated": False},
    ]  # fmt: skip
    E.add_ratios(recs)
    assert recs[1]["samples_per_s_vs_ddp"] == 0.5  # same invocation and bandwidth: compared, but marked
    rows = E.format_summary(recs).splitlines()[2:]
    assert "hivemind (no link)" in rows[1] and "(no link)" not in rows[0]
