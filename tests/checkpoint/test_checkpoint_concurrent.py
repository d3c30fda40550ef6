"""Concurrent saves and loads on one checkpoint directory (Note [Checkpoint directory lock],
Note [Checkpoint cleanup], Note [Loading while a save commits]).

* The directory lock: excludes a second holder (also a plain fcntl.flock holder), records and reports
  the holder's pid and host, dies with its holder, falls back to "unlocked" where flock is missing.
* Cleanup (called directly, and hooked between a real commit and its cleanup): never deletes a file
  that the manifest on disk names or that is newer than the commit, nor a live writer's temporary
  file; unlocked, only the replaced manifest's files.
* A second job saving while the lock is held (by the test process, by another job stopped inside its
  commit): CheckpointError on every rank, nothing written, the first save commits, the job trains on.
* Two jobs saving many times into one directory while a monitor reads the manifest: never a name of
  a missing file (the issue's "39% of polls").
* A load during a commit: CheckpointChanged on every rank (a file removed, or ranks that read
  different manifests), never a mixed load; the retry loads.

Every cross-process wait is an event or a collective, bounded by a timeout; nothing is timed.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch
import torch.multiprocessing as mp
from _dist import multiproc, run_workers
from test_checkpoint import _equal, _make, _state, _train_step

from pyasync.checkpoint import lock as dirlock
from pyasync.checkpoint.common import host_id
from pyasync.checkpoint.save import TMP_STALE_S, cleanup

WAIT = 120.0  # seconds: the bound on every event wait in a worker or in the test
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _wait(ev, what: str) -> None:
    if not ev.wait(WAIT):
        raise TimeoutError(f"{what} did not happen within {WAIT:g} s")


def _opt_state(opt) -> list[torch.Tensor]:
    """What a checkpoint holds of this rank: masters, optimizer state, residuals (not the model's
    parameters: under Quorum(k < n) they may lag the masters at a step boundary)."""
    sd = opt.state_dict()
    out = []
    for b in sorted(sd["shards"]):
        out.append(sd["shards"][b]["master"])
        out.extend(v for _, v in sorted(sd["shards"][b]["optim"].items()))
    out.extend(v for _, v in sorted(sd["residuals"].items()))
    return out


def _read_json(path: str):
    with open(path, "rb") as f:
        return json.loads(f.read())


def _listing(d) -> dict[str, str]:
    """Every file in d: name -> sha256 of its bytes."""
    return {f: hashlib.sha256((d / f).read_bytes()).hexdigest() for f in sorted(os.listdir(d))}


# -- the lock, in this process ---------------------------------------------------------------------


def test_dir_lock_excludes_and_names_the_holder(tmp_path):
    d = str(tmp_path / "new" / "dir")  # created by the first acquire
    a = dirlock.DirLock(d)
    assert a.acquire() == dirlock.HELD
    rec = _read_json(a.path)
    assert rec["pid"] == os.getpid() and rec["host"] == socket.gethostname()
    b = dirlock.DirLock(d)
    assert b.acquire() == dirlock.BUSY and b.fd is None
    assert b.holder == (os.getpid(), socket.gethostname())
    assert dirlock.describe_holder(*b.holder) == f"lock held by pid {os.getpid()} on {socket.gethostname()}"
    a.release()
    a.release()  # idempotent
    assert os.path.getsize(a.path) == 0, "a released lock still names its holder"
    with dirlock.DirLock(d) as c:
        assert c.state == dirlock.HELD

    # Any flock holder excludes a save, also one that records nothing.
    import fcntl

    fd = os.open(os.path.join(d, dirlock.LOCK_FILE), os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        e = dirlock.DirLock(d)
        assert e.acquire() == dirlock.BUSY and e.holder == (None, None)
        assert "did not record its pid" in dirlock.describe_holder(*e.holder)
    finally:
        os.close(fd)
    with dirlock.DirLock(d) as f:
        assert f.state == dirlock.HELD


def test_dir_lock_dies_with_its_holder(tmp_path):
    """A holder killed mid-save leaves no stale lock: the kernel drops a flock with its process."""
    d = str(tmp_path)
    code = (
        "import sys; from pyasync.checkpoint.lock import DirLock, HELD\n"
        f"lk = DirLock({d!r}); assert lk.acquire() == HELD\n"
        "print('held', flush=True); sys.stdin.read()\n"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO
    )
    try:
        ready, _, _ = select.select([p.stdout], [], [], WAIT)
        assert ready and p.stdout.readline().strip() == b"held", "the holder did not take the lock"
        lk = dirlock.DirLock(d)
        assert lk.acquire() == dirlock.BUSY and lk.holder[0] == p.pid
    finally:
        p.kill()
        p.wait(WAIT)
    with dirlock.DirLock(d) as lk:
        assert lk.state == dirlock.HELD


def test_dir_lock_without_flock(tmp_path, monkeypatch):
    """No flock (NFS without a lock service, a FUSE file system, no fcntl module): UNLOCKED, never an
    exception; another error: ERROR with the reason."""

    def refuse(code):
        def flock(fd, op):
            raise OSError(code, os.strerror(code))

        return flock

    for code in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
        monkeypatch.setattr(dirlock.fcntl, "flock", refuse(code))
        lk = dirlock.DirLock(str(tmp_path))
        assert lk.acquire() == dirlock.UNLOCKED and lk.fd is None, code
        assert "flock is not supported" in lk.error
        lk.release()
    monkeypatch.setattr(dirlock.fcntl, "flock", refuse(errno.EIO))
    lk = dirlock.DirLock(str(tmp_path))
    assert lk.acquire() == dirlock.ERROR and "cannot lock" in lk.error
    monkeypatch.undo()
    monkeypatch.setattr(dirlock, "fcntl", None)
    lk = dirlock.DirLock(str(tmp_path))
    assert lk.acquire() == dirlock.UNLOCKED and "not available" in lk.error
    monkeypatch.undo()
    (tmp_path / "afile").write_text("x")
    lk = dirlock.DirLock(str(tmp_path / "afile" / "sub"))  # a path under a file: cannot be created
    assert lk.acquire() == dirlock.ERROR and "cannot create or open the lock file" in lk.error


# -- cleanup, called directly ----------------------------------------------------------------------


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(WAIT)
    return p.pid


def _build_dir(d, t0: int) -> tuple[set[str], set[str]]:
    """A directory as rank 0 sees it right after committing save 'c0...' at time t0 (ns), with a newer
    save 'e0...' committed by hand between the commit and the cleanup. Returns (keep, replaced)."""
    d.mkdir()
    sec = 1_000_000_000

    def put(name: str, age_s: float) -> None:
        (d / name).write_bytes(b"x")
        t = t0 - int(age_s * sec)
        os.utime(d / name, ns=(t, t))

    def shards(sid: str, age_s: float) -> set[str]:
        names = {f"shard-{sid}-r{r}-of-2.pt" for r in range(2)}
        for n in names:
            put(n, age_s)
        return names

    replaced = shards("a" * 16, 10)  # the manifest this save replaced
    orphan = shards("b" * 16, 20)  # a failed save's, named by no manifest
    keep = shards("c" * 16, 1)  # this save's
    newer = shards("e" * 16, -1)  # a newer save's, committed between our commit and our cleanup
    pending = shards("f" * 16, -2)  # a save still writing, not committed
    shards("d" * 16, 5)  # older than our commit, yet named by the manifest on disk: never deleted
    (d / "manifest.json").write_text(
        json.dumps({"save_id": "e" * 16, "shards": [{"file": n} for n in sorted(newer)]
                    + [{"file": f"shard-{'d' * 16}-r{r}-of-2.pt"} for r in range(2)]})
    )
    me, dead = host_id(), _dead_pid()
    put(f".pyasync-tmp-{me}-{os.getpid()}-live", 0)  # a live writer on this host
    put(f".pyasync-tmp-{me}-{dead}-dead", 0)  # its writer is gone
    put(".pyasync-tmp-0badc0de-1-otherhost", 0)  # another host's, fresh
    put(".pyasync-tmp-0badc0de-1-stale", TMP_STALE_S + 60)  # another host's, untouched for long
    put(".pyasync-tmp-legacyname", 0)  # older pyasync's name, fresh
    put(".pyasync-tmp-legacystale", TMP_STALE_S + 60)
    put("notes.txt", 100)  # not ours
    assert orphan and pending
    return keep, replaced


def test_cleanup_never_deletes_a_newer_manifests_files(tmp_path):
    t0 = time.time_ns()
    for locked in (True, False):
        d = tmp_path / f"locked{locked}"
        keep, replaced = _build_dir(d, t0)
        before = set(os.listdir(d))
        deleted = set(cleanup(str(d), keep, t0, replaced, locked))
        assert set(os.listdir(d)) == before - deleted
        tmp_gone = {f for f in before if f.endswith("-dead")}
        tmp_gone |= {".pyasync-tmp-0badc0de-1-stale", ".pyasync-tmp-legacystale"}
        want = set(replaced) | tmp_gone
        if locked:  # under the lock a failed save's orphans go too
            want |= {f"shard-{'b' * 16}-r{r}-of-2.pt" for r in range(2)}
        assert deleted == want, (locked, sorted(deleted ^ want))
        # In particular: the newer manifest's files, the pending save's and ours are all there.
        m = json.loads((d / "manifest.json").read_text())
        assert all((d / s["file"]).exists() for s in m["shards"])
        assert all((d / f).exists() for f in keep)

    # No readable manifest on disk: no shard file is deleted at all.
    d = tmp_path / "nomanifest"
    keep, replaced = _build_dir(d, t0)
    (d / "manifest.json").write_text("{trunc")
    deleted = cleanup(str(d), keep, t0, replaced, True)
    assert not [f for f in deleted if f.startswith("shard-")]


# -- a real save, one rank: the hook between commit and cleanup, and the unlocked fallback ------------


def _one_rank(rank, world, root):
    import pyasync
    from pyasync.checkpoint import save as save_mod

    d = os.path.join(root, "ckpt")
    model, opt = _make("adamw", seed=0)
    _train_step(model, opt, rank, 0)
    pyasync.save_checkpoint(d, opt)
    out = {}

    # A newer save commits (by hand) between this save's commit and its cleanup: copies of this
    # save's shard files under a newer save id, written after the commit, and a manifest naming them.
    real = save_mod.cleanup

    def newer_then_cleanup(dd, keep, before_ns, replaced, locked):
        m = _read_json(os.path.join(dd, "manifest.json"))
        sid = "e" * 16
        for s in m["shards"]:
            new = s["file"].replace(m["save_id"], sid)
            shutil.copyfile(os.path.join(dd, s["file"]), os.path.join(dd, new))
            os.utime(os.path.join(dd, new), ns=(before_ns + 1, before_ns + 1))  # after the commit
            s["file"] = new
        m["save_id"] = sid
        with open(os.path.join(dd, "manifest.json"), "w") as f:
            json.dump(m, f)
        out["keep"], out["locked"] = sorted(keep), locked
        return real(dd, keep, before_ns, replaced, locked)

    _train_step(model, opt, rank, 1)
    save_mod.cleanup = newer_then_cleanup
    try:
        pyasync.save_checkpoint(d, opt)
    finally:
        save_mod.cleanup = real
    at_second = _state(model, opt)
    m = _read_json(os.path.join(d, "manifest.json"))
    out["newer_files_kept"] = all(os.path.exists(os.path.join(d, s["file"])) for s in m["shards"])
    out["newer_is_current"] = m["save_id"] == "e" * 16
    out["ours_kept"] = all(os.path.exists(os.path.join(d, f)) for f in out["keep"])
    model2, opt2 = _make("adamw", seed=1)
    pyasync.load_checkpoint(d, opt2)  # the newer manifest: copies of the second save's files
    out["newer_loads"] = _equal(at_second, _state(model2, opt2))
    opt2.close()

    # No flock here: the save warns and goes on; its cleanup deletes only the replaced manifest's
    # files, so a failed save's orphan stays (until a locked save sweeps it).
    orphan = os.path.join(d, "shard-" + "b" * 16 + "-r0-of-1.pt")
    open(orphan, "wb").close()
    os.utime(orphan, ns=(1, 1))
    replaced = {s["file"] for s in m["shards"]}

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available (simulated)")

    real_flock = dirlock.fcntl.flock
    dirlock.fcntl.flock = no_flock
    _train_step(model, opt, rank, 2)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pyasync.save_checkpoint(d, opt)
    finally:
        dirlock.fcntl.flock = real_flock
    at_third = _state(model, opt)
    out["warned"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    out["orphan_kept_unlocked"] = os.path.exists(orphan)
    out["replaced_deleted"] = not any(os.path.exists(os.path.join(d, f)) for f in replaced)
    model3, opt3 = _make("adamw", seed=2)
    pyasync.load_checkpoint(d, opt3)
    out["unlocked_loads"] = _equal(at_third, _state(model3, opt3))
    opt3.close()

    _train_step(model, opt, rank, 3)
    pyasync.save_checkpoint(d, opt)  # locked again: sweeps the orphan
    out["orphan_swept_locked"] = not os.path.exists(orphan)
    opt.close()
    return out


def test_real_save_cleanup_hook_and_unlocked_fallback(tmp_path):
    (r,) = run_workers(_one_rank, 1, args=(str(tmp_path),), timeout=120)
    assert r["locked"] is True and len(r["keep"]) == 1
    assert r["newer_is_current"] and r["newer_files_kept"], "cleanup deleted a newer manifest's files"
    assert r["ours_kept"] and r["newer_loads"]
    assert len(r["warned"]) == 1 and "saving without the directory lock" in r["warned"][0], r["warned"]
    assert "No locks available" in r["warned"][0]
    assert r["orphan_kept_unlocked"] and r["replaced_deleted"] and r["unlocked_loads"]
    assert r["orphan_swept_locked"]


# -- a second writer -------------------------------------------------------------------------------


def _refused(rank, world, d, policy, saved, locked, tried, released):
    import torch.distributed as dist

    import pyasync
    from pyasync.checkpoint import CheckpointError

    model, opt = _make("sgd", seed=0, policy=policy)
    for t in range(3):
        _train_step(model, opt, rank, t)
    pyasync.save_checkpoint(d, opt)
    dist.barrier()  # rank 0's cleanup is done too
    if rank == 0:
        saved.set()
    _wait(locked, "the test taking the lock")
    _train_step(model, opt, rank, 3)
    try:
        pyasync.save_checkpoint(d, opt)
        err = "SAVED"
    except CheckpointError as e:
        err = str(e)
    dist.barrier()
    if rank == 0:
        tried.set()
    _wait(released, "the test releasing the lock")
    _train_step(model, opt, rank, 4)  # the refused save left the optimizer usable
    pyasync.save_checkpoint(d, opt)
    last = _opt_state(opt)
    opt.close()
    _, opt2 = _make("sgd", seed=7, policy=policy)
    pyasync.load_checkpoint(d, opt2)
    out = {"err": err, "loads_last": _equal(last, _opt_state(opt2))}
    opt2.close()
    return out


@pytest.mark.parametrize("policy", ["bsp", "quorum:1"])
@multiproc
def test_second_writer_is_refused_on_every_rank(tmp_path, policy):
    """The test process holds the directory lock (the real DirLock) while a 2-rank job saves: every
    rank raises 'another save is writing to DIR (lock held by pid N on HOST)', not a byte in the
    directory changes, and the job trains on and saves once the lock is free. Quorum(1) on 2 ranks:
    the refused save still pauses, meets twice and resumes (Note [Barriers and quorums])."""
    ctx = mp.get_context("spawn")
    saved, locked, tried, released = (ctx.Event() for _ in range(4))
    d = tmp_path / "ckpt"
    box: dict = {}

    def job():
        try:
            box["res"] = run_workers(
                _refused, 2, args=(str(d), policy, saved, locked, tried, released), timeout=240
            )
        except BaseException as e:  # pytest.fail in the thread: re-raised below
            box["exc"] = e
            for ev in (saved, tried):
                ev.set()

    th = threading.Thread(target=job, daemon=True)
    th.start()
    try:
        _wait(saved, "the job's first save")
        lk = dirlock.DirLock(str(d))
        assert lk.acquire() == dirlock.HELD
        try:
            before = _listing(d)
            locked.set()
            _wait(tried, "the job's refused save")
            after = _listing(d)
        finally:
            lk.release()
    finally:
        locked.set()
        released.set()
        th.join(WAIT * 2)
    assert not th.is_alive(), "the job did not finish"
    if "exc" in box:
        raise box["exc"]
    res = box["res"]
    assert after == before, "the refused save changed the directory"
    want = f"another save is writing to {d} (lock held by pid {os.getpid()} on {socket.gethostname()})"
    for rank, r in enumerate(res):
        assert want in r["err"], (rank, r["err"])
        assert "wrote nothing" in r["err"]
        assert r["loads_last"], f"rank {rank}: the directory does not load the last save"


def _writer_a(rank, world, d, holding, go, a_done):
    import torch.distributed as dist

    import pyasync
    from pyasync.checkpoint import save as save_mod

    model, opt = _make("adamw", seed=0)
    for t in range(3):
        _train_step(model, opt, rank, t)
    real = save_mod.atomic_write

    def stop_in_commit(path, data):  # rank 0, holding the lock, stops right before the commit
        if os.path.basename(path) == "manifest.json":
            holding.set()
            _wait(go, "job B's refused save")
        return real(path, data)

    if rank == 0:
        save_mod.atomic_write = stop_in_commit
    try:
        pyasync.save_checkpoint(d, opt)
    finally:
        save_mod.atomic_write = real
    mine = _state(model, opt)
    opt.close()
    model2, opt2 = _make("adamw", seed=3)
    pyasync.load_checkpoint(d, opt2)
    loads = _equal(mine, _state(model2, opt2))
    opt2.close()
    dist.barrier()
    if rank == 0:
        a_done.set()
    return {"pid": os.getpid(), "loads_own": loads}


def _writer_b(rank, world, d, go, a_done):
    import torch.distributed as dist

    import pyasync
    from pyasync.checkpoint import CheckpointError

    model, opt = _make("adamw", seed=1)
    for t in range(2):
        _train_step(model, opt, rank, 10 + t)
    try:
        pyasync.save_checkpoint(d, opt)
        err = "SAVED"
    except CheckpointError as e:
        err = str(e)
    dist.barrier()
    if rank == 0:
        go.set()
    _wait(a_done, "job A's commit")
    pyasync.save_checkpoint(d, opt)  # A is done: B may save now
    mine = _state(model, opt)
    opt.close()
    model2, opt2 = _make("adamw", seed=4)
    pyasync.load_checkpoint(d, opt2)
    loads = _equal(mine, _state(model2, opt2))
    opt2.close()
    return {"err": err, "loads_own": loads}


@multiproc
def test_two_jobs_save_into_one_directory(tmp_path):
    """Job A's rank 0 stops inside its save, holding the lock, right before its commit; job B saves
    into the same directory: every rank of B gets the CheckpointError naming A's rank 0, A then
    commits and its checkpoint loads exactly; after A is done, B saves and its checkpoint loads."""
    ctx = mp.get_context("spawn")
    holding, go, a_done = (ctx.Event() for _ in range(3))
    d = str(tmp_path / "ckpt")
    box: dict = {}

    def job_a():
        try:
            box["a"] = run_workers(_writer_a, 2, args=(d, holding, go, a_done), timeout=240)
        except BaseException as e:
            box["exc"] = e
            holding.set()
            a_done.set()

    th = threading.Thread(target=job_a, daemon=True)
    th.start()
    try:
        _wait(holding, "job A holding the lock inside its commit")
        if "exc" not in box:
            box["b"] = run_workers(_writer_b, 2, args=(d, go, a_done), timeout=240)
    finally:
        go.set()
        th.join(WAIT * 2)
    assert not th.is_alive(), "job A did not finish"
    if "exc" in box:
        raise box["exc"]
    a, b = box["a"], box["b"]
    want = f"another save is writing to {d} (lock held by pid {a[0]['pid']} on {socket.gethostname()})"
    for rank in range(2):
        assert want in b[rank]["err"], (rank, b[rank]["err"])
        assert a[rank]["loads_own"], f"job A rank {rank}: its checkpoint does not load exactly"
        assert b[rank]["loads_own"], f"job B rank {rank}: its later checkpoint does not load exactly"


# -- the monitor (the 39% of polls) --------------------------------------------------------

SAVES = 25


def _many_saves(rank, world, d, seed, ready, start):
    import torch.distributed as dist

    import pyasync
    from pyasync.checkpoint import CheckpointError

    model, opt = _make("sgd", seed=seed)
    dist.barrier()
    if rank == 0:
        ready.set()
    _wait(start, "the start")  # both jobs start saving together
    done = refused = 0
    for t in range(SAVES):
        _train_step(model, opt, rank, t)
        try:
            pyasync.save_checkpoint(d, opt)
            done += 1
        except CheckpointError as e:
            if "another save is writing to" not in str(e):
                raise
            refused += 1
    opt.close()
    return {"done": done, "refused": refused}


def _look(d: str) -> tuple[str, list[str]] | None:
    """(save id, names of missing files) of the manifest in d now; None before the first commit."""
    try:
        with open(os.path.join(d, "manifest.json"), "rb") as f:
            m = json.loads(f.read())
    except FileNotFoundError:
        return None
    return m["save_id"], [s["file"] for s in m["shards"] if not os.path.exists(os.path.join(d, s["file"]))]


def _load_only(rank, world, d):
    import pyasync

    _, opt = _make("sgd", seed=rank + 5)
    pyasync.load_checkpoint(d, opt)
    opt.close()
    return True


@multiproc
def test_monitor_never_sees_a_manifest_naming_a_missing_file(tmp_path):
    """Two 2-rank jobs save SAVES times each into one directory, unsynchronised, while a thread of the
    test reads the manifest and checks that every file it names exists. A missing file is dangling
    only if the manifest, read again, is still the same one (otherwise a newer save replaced it in
    between: a reader's retry, counted). Never dangling; every save either commits or is refused
    with the lock error; the directory loads at the end and holds no temporary file."""
    ctx = mp.get_context("spawn")
    start = ctx.Event()
    ready = {"a": ctx.Event(), "b": ctx.Event()}
    d = str(tmp_path / "ckpt")
    stop = threading.Event()
    seen: dict = {"polls": 0, "manifests": set(), "changed": 0, "dangling": []}

    def monitor():
        try:
            watch()
        except BaseException as e:  # re-raised below
            seen["error"] = e

    def watch():
        while True:
            last = stop.is_set()
            got = _look(d)
            seen["polls"] += 1
            if got is not None:
                seen["manifests"].add(got[0])
                if got[1]:
                    again = _look(d)
                    if again is not None and again[0] == got[0]:
                        seen["dangling"].append(got)
                    else:
                        seen["changed"] += 1
            if last:
                return
            stop.wait(0.002)  # pacing on a 2-core machine, not synchronisation

    box: dict = {}

    def job(name, seed):
        try:
            box[name] = run_workers(_many_saves, 2, args=(d, seed, ready[name], start), timeout=300)
        except BaseException as e:
            box[f"exc-{name}"] = e
            ready[name].set()

    mon = threading.Thread(target=monitor, daemon=True)
    jobs = [threading.Thread(target=job, args=(n, s), daemon=True) for n, s in (("a", 0), ("b", 1))]
    mon.start()
    for th in jobs:
        th.start()
    try:
        for name in ("a", "b"):
            _wait(ready[name], f"job {name} ready")
    finally:
        start.set()
    for th in jobs:
        th.join(WAIT * 3)
    stop.set()
    mon.join(WAIT)
    assert not any(th.is_alive() for th in jobs) and not mon.is_alive()
    if "error" in seen:
        raise seen["error"]
    for k, v in box.items():
        if k.startswith("exc-"):
            raise v
    assert not seen["dangling"], f"manifests naming missing files: {seen['dangling'][:3]}"
    for name in ("a", "b"):
        for rank in range(2):
            r = box[name][rank]
            assert r["done"] + r["refused"] == SAVES, (name, rank, r)
        assert box[name][0] == box[name][1], f"job {name}: ranks disagree on which saves were refused"
    assert box["a"][0]["done"] + box["b"][0]["done"] >= 1
    assert seen["manifests"], "the monitor never saw a manifest"
    assert not [f for f in os.listdir(d) if f.startswith(".pyasync-tmp-")], os.listdir(d)
    run_workers(_load_only, 2, args=(d,), timeout=120)


# -- a load while a save commits -------------------------------------------------------------------


def _swap(dst: str, src: str, remove_old: bool) -> None:
    """What a save committing into dst does: its shard files, then the manifest by os.replace, then
    (its cleanup) the old manifest's files. Here the new checkpoint is the one in src."""
    old = _read_json(os.path.join(dst, "manifest.json"))
    new = _read_json(os.path.join(src, "manifest.json"))
    for s in new["shards"]:
        shutil.copyfile(os.path.join(src, s["file"]), os.path.join(dst, s["file"]))
    shutil.copyfile(os.path.join(src, "manifest.json"), os.path.join(dst, "manifest.tmp"))
    os.replace(os.path.join(dst, "manifest.tmp"), os.path.join(dst, "manifest.json"))
    if remove_old:
        for s in old["shards"]:
            os.unlink(os.path.join(dst, s["file"]))


def _load_race(rank, world, root):
    import torch.distributed as dist

    import pyasync
    from pyasync.checkpoint import CheckpointChanged, CheckpointError
    from pyasync.checkpoint import load as load_mod

    one, two = os.path.join(root, "one"), os.path.join(root, "two")
    model, opt = _make("sgd-int8", seed=0)
    _train_step(model, opt, rank, 0)
    pyasync.save_checkpoint(one, opt)
    for t in range(1, 3):
        _train_step(model, opt, rank, t)
    pyasync.save_checkpoint(two, opt)
    at_two = _state(model, opt)
    opt.close()

    model2, opt2 = _make("sgd-int8", seed=5)
    before = _state(model2, opt2)
    real = load_mod.read_manifest
    out = {}
    for case, remove_old in (("mixed", False), ("removed", True)):
        d = os.path.join(root, case)
        if rank == 0:
            shutil.copytree(one, d)
        dist.barrier()

        def racing(dd, remove_old=remove_old):
            # Rank 0 reads the manifest; then rank 1 commits checkpoint two into the directory (as a
            # concurrent save would) and reads the new manifest. Collectives order the two.
            if rank == 0:
                m = real(dd)
                dist.barrier()
                dist.barrier()
                return m
            dist.barrier()
            _swap(dd, two, remove_old)
            dist.barrier()
            return real(dd)

        load_mod.read_manifest = racing
        try:
            pyasync.load_checkpoint(d, opt2)
            out[case] = ("LOADED", "")
        except CheckpointError as e:
            out[case] = (type(e).__name__, str(e))
        finally:
            load_mod.read_manifest = real
        out[f"{case}_untouched"] = _equal(before, _state(model2, opt2))
        pyasync.load_checkpoint(d, opt2)  # the retry loads checkpoint two
        out[f"{case}_retry"] = _equal(at_two, _state(model2, opt2))
        before = _state(model2, opt2)

    # A file missing under an unchanged manifest is a broken checkpoint, not a changed one.
    d = os.path.join(root, "broken")
    if rank == 0:
        shutil.copytree(one, d)
        m = _read_json(os.path.join(d, "manifest.json"))
        os.unlink(os.path.join(d, m["shards"][1]["file"]))
    dist.barrier()
    try:
        pyasync.load_checkpoint(d, opt2)
        out["broken"] = ("LOADED", "")
    except CheckpointChanged as e:
        out["broken"] = ("CheckpointChanged", str(e))
    except CheckpointError as e:
        out["broken"] = ("CheckpointError", str(e))
    opt2.close()
    return out


@multiproc
def test_load_during_a_commit_is_never_mixed(tmp_path):
    """'mixed': rank 0 reads checkpoint one's manifest, rank 1 the manifest of checkpoint two that a
    save committed in between, and both files exist: without the save ids in the ok all_gather this
    loaded half of each. 'removed': the commit's cleanup also removed the file rank 0 was about to
    read. Both: CheckpointChanged on every rank, nothing loaded, the retry loads checkpoint two."""
    res = run_workers(_load_race, 2, args=(str(tmp_path),), timeout=180)
    for rank, r in enumerate(res):
        for case in ("mixed", "removed"):
            kind, msg = r[case]
            assert kind == "CheckpointChanged", (rank, case, r[case])
            assert "nothing was loaded" in msg and "retry" in msg, (rank, case, msg)
            assert r[f"{case}_untouched"], f"rank {rank} {case}: the failed load modified the optimizer"
            assert r[f"{case}_retry"], f"rank {rank} {case}: the retry did not load checkpoint two"
        assert "the ranks read different manifests" in r["mixed"][1], r["mixed"]
        assert r["broken"][0] == "CheckpointError", r["broken"]
    assert "changed while loading" in res[0]["removed"][1] and "-r0-of-2.pt" in res[0]["removed"][1]
    assert "rank(s) [0] saw the checkpoint change" in res[1]["removed"][1]
    assert "cannot read the shard file named by the manifest" in res[1]["broken"][1]
