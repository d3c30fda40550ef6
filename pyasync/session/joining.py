"""The store records through which a new worker joins a running elastic job (Note [Joining a running job]).

Note [Joining a running job]
    A replacement starts the same training script with ``elastic=True`` and the environment variable
    ``PYASYNC_JOIN=1`` (``python -m pyasync.launch`` sets it for the workers it restarts). Its own
    default process group has one rank, on the job's store (``init_process_group(store=..., rank=0,
    world_size=1)``, or ``env://`` with ``WORLD_SIZE=1`` and the job's ``MASTER_ADDR``/``MASTER_PORT``),
    so its store keys are the members' keys. Then:

    1. **Find the job.** At construction the job's rank 0 (the only rank of a job of one) wrote the
       job's prefix (``pyasync/elastic/job``), its job id (``PYASYNC_JOB_ID``, else torchrun's run
       id), epoch 0's members and the agreement items of session/bootstrap.py (parameters, policy,
       codec, optimizer and hyperparameters, ...).
       The joiner compares its own with them: a worker that does not belong (another job's id,
       another model, other hyperparameters, another codec) is refused with the first difference,
       before the job sees it.
    2. **Ask.** It takes an id above every member's (``{job}/ids``, counted) and writes its request
       (``{job}/joiner/<id>`` = ``waiting``).
    3. **Admission.** The members look for waiting requests at most every ``POLL_S`` seconds at the end
       of ``step()`` (one store call when nothing changed) and in ``close()``; one that sees a request
       starts a membership change (Note [Membership epochs] in session/membership.py): drain, agree on
       the members (the survivors and the waiting joiners; a departure and a join in one change
       combine), meet, a fresh group (Note [Groups of later epochs] in session/groups.py), re-shard onto
       the m + 1 members: masters and optimizer state move to their new owners, the joiner receives
       every bucket's values from the owners of the last epoch at once (each sends its own shards,
       point to point), and every member checks that its replica's checksums (CRC-32 per bucket)
       equal the others'. Then the joiner's engine starts with the others' and it pushes. Means
       divide by the new count; Quorum(k) grows back to the k the user asked for.
    4. **Who decides at the end.** Members in ``close()`` decide once, through the store
       (``{job}/epoch<n>/fate``: ``grow`` or ``end``), whether to admit a request that arrived while
       they closed, so that they all take the same branch; a joiner that finds ``end`` is told that
       the job finished before it could join.

    A joiner that dies before it met the members is dropped from the change after ``GRACE_S`` seconds
    (its request marked ``gone``), and the members go on without it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

from pyasync.errors import PeerFailure

__all__ = ["GRACE_S", "POLL_S", "Requests", "decide_fate", "joining", "publish"]

JOB_KEY = "pyasync/elastic/job"
POLL_S = 0.2  # members look for join requests at most this often
GRACE_S = 10.0  # a joiner that met nobody within this is taken for dead
WAITING, MEMBER, GONE = "waiting", "member", "gone"


def joining() -> bool:
    """Whether this process was started to join a running job (``PYASYNC_JOIN=1``)."""
    return os.environ.get("PYASYNC_JOIN", "") == "1"


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def job_id() -> str:
    """This worker's job id: ``PYASYNC_JOB_ID`` (``python -m pyasync.launch`` sets one per job), else
    torchrun's run id (``--rdzv-id``: ``TORCHELASTIC_RUN_ID``), else empty (the job is not named)."""
    return os.environ.get("PYASYNC_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID", "")


def publish(st, key: str, members: list[int], items: dict[str, list[str]]) -> None:
    """Rank 0 at construction of an elastic job: what a joiner needs to find and check the job."""
    st.set(f"{key}/epoch0", json.dumps(sorted(members)))
    st.set(f"{key}/setup", json.dumps(items, sort_keys=True))
    st.set(f"{key}/job", job_id())
    st.set(f"{key}/idbase", str(max(members) + 1))
    st.set(JOB_KEY, key)


class Requests:
    """A member's view of the join requests (the store records above), polled cheaply."""

    def __init__(self, st, key: str) -> None:
        self.st, self.key = st, key
        self.seen = 0  # requests counted so far
        self.settled: set[int] = set()  # ids known not to be waiting (members, gone)
        self.next_poll = 0.0

    def _ids(self) -> list[int]:
        n = int(self.st.add(f"{self.key}/ids", 0))
        if n == 0:
            return []
        base = int(_text(self.st.get(f"{self.key}/idbase")))
        return [base + i for i in range(n)]

    def waiting(self, members: list[int]) -> list[int]:
        """The ids whose request waits, not members (one store call when there is none)."""
        out = []
        for j in self._ids():
            if j in self.settled or j in members:
                continue
            k = f"{self.key}/joiner/{j}"
            if self.st.check([k]):
                s = _text(self.st.get(k))
                if s == WAITING:
                    out.append(j)
                else:
                    self.settled.add(j)
        return out

    def due(self, members: list[int]) -> bool:
        """At most every POLL_S seconds: whether a request waits."""
        now = time.monotonic()
        if now < self.next_poll:
            return False
        self.next_poll = now + POLL_S
        return bool(self.waiting(members))

    def mark(self, ids: list[int], status: str) -> None:
        for j in ids:
            self.st.set(f"{self.key}/joiner/{j}", status)
            self.settled.add(j)


def decide_fate(st, key: str, number: int, grow: bool) -> bool:
    """The members of epoch ``number`` in close(): the first to decide wins; True: admit the joiners."""
    got = st.compare_set(f"{key}/epoch{number}/fate", "", "grow" if grow else "end")
    return _text(got) == "grow"


def find_job(st, timeout: float) -> str:
    """The prefix of the elastic job running on this store (waits for it, at most ``timeout``)."""
    import datetime

    try:
        st.wait([JOB_KEY], datetime.timedelta(seconds=timeout))
    except Exception as e:
        raise PeerFailure(
            f"pyasync: PYASYNC_JOIN=1, but no elastic job wrote its record into this store within "
            f"{timeout:g} s: start the job first (elastic=True), or unset PYASYNC_JOIN for a new job",
            [],
        ) from e
    return _text(st.get(JOB_KEY))


def check_belongs(st, key: str, items: dict[str, list[str]]) -> None:
    """Refuse a joiner of another job (its job id differs), or whose agreement items differ from the
    job's, naming the first difference."""
    job, mine_id = _text(st.get(f"{key}/job")), job_id()
    if job != mine_id:
        raise ValueError(
            f"pyasync: this worker cannot join the running job: its job id is {mine_id!r}, the job's on "
            f"this store is {job!r} (PYASYNC_JOB_ID, else torchrun's --rdzv-id). Point the replacement "
            "at its own job's store, or start it with the job's id"
        )
    theirs = json.loads(_text(st.get(f"{key}/setup")))
    mine = json.loads(json.dumps(items, sort_keys=True))
    for what in sorted(set(theirs) | set(mine)):
        a, b = theirs.get(what), mine.get(what)
        if a == b:
            continue
        a, b = a or [], b or []
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        raise ValueError(
            f"pyasync: this worker cannot join the running job: its {what} differ(s) from the job's, first "
            f"at item {i}: the job has {a[i] if i < len(a) else '(nothing)'!r}, this worker "
            f"{b[i] if i < len(b) else '(nothing)'!r}. Start the replacement with the same model, "
            "optimizer, hyperparameters, policy and compression as the job"
        )


def ask(st, key: str) -> int:
    """Write this worker's request; its id (above every member's)."""
    n = int(st.add(f"{key}/ids", 1))
    j = int(_text(st.get(f"{key}/idbase"))) + n - 1
    st.set(f"{key}/joiner/{j}", WAITING)
    return j


def admitted(st, key: str, me: int, deadline: float, n: int = 1) -> tuple[int, list[int], list[int]]:
    """Wait until a membership epoch admits ``me``: (its number, its members, the previous epoch's members).
    Raises PeerFailure when the job ended first or nothing admitted it before ``deadline``."""
    import datetime

    while True:
        k = f"{key}/epoch{n}"
        if st.check([k]):
            members = json.loads(_text(st.get(k)))
            if me in members:  # the members wrote which epoch this one follows (it may not be n - 1)
                st.wait([f"{k}/base"], datetime.timedelta(seconds=max(0.1, deadline - time.monotonic())))
                base = int(_text(st.get(f"{k}/base")))
                return n, members, json.loads(_text(st.get(f"{key}/epoch{base}")))
            n += 1
            continue
        fate = f"{key}/epoch{n - 1}/fate"
        if st.check([fate]) and _text(st.get(fate)) == "end":
            raise PeerFailure(
                f"pyasync: the job finished (epoch {n - 1}) before it admitted worker {me}", [me]
            )
        left = deadline - time.monotonic()
        if left <= 0:
            raise PeerFailure(
                f"pyasync: no membership epoch admitted worker {me} in time (the members look for joiners "
                "at the end of each step(); are they training?)",
                [me],
            )
        with contextlib.suppress(Exception):  # a bounded wait for the record, then look again
            st.wait([k], datetime.timedelta(seconds=min(left, 0.5)))
