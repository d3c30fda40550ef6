"""Meeting the other ranks with a deadline that names who is missing.

``join`` is a barrier through the job's store: each rank sets its own key and waits (at most
``timeout``) for every rank's key. When the wait times out, every rank reads which keys are missing,
so every rank names the same late, hung or dead ranks in the same exception. Used where ranks first
meet (the optimizer's construction), where a plain collective would wait the process group's own
timeout (30 minutes by default) and then report an address and a port.

``collective_failure`` turns a failed collective (a gloo error or timeout) into a PeerFailure naming the
ranks the transport saw fail, when it saw any.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import time

import torch.distributed as dist

from pyasync.errors import PeerFailure

__all__ = [
    "agree_members",
    "collective_failure",
    "control_group",
    "gave_up",
    "global_ranks",
    "join",
    "may_propose",
    "meet_members",
    "roll_call",
    "store",
]

_generation = itertools.count()  # joins made by this process (the same sequence on every rank)


def store():
    """The job's store (the one torch.distributed was initialised with), or None when unavailable."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:
        return None


def global_ranks(group) -> list[int]:
    n = dist.get_world_size(group)
    return [dist.get_global_rank(group, r) for r in range(n)] if group is not None else list(range(n))


_OK, _GONE, _FAILED = "ok", "gone", "failed: "


def join(group, timeout: datetime.timedelta, what: str, failed: BaseException | None = None) -> list[str]:
    """Wait until every rank of ``group`` reached this point (at most ``timeout``); PeerFailure naming the
    ranks that did not (by their rank in ``group``) otherwise. Returns the meeting's store keys (for
    ``gave_up``).

    Each rank writes its key: "ok"; "failed: <error>" when ``failed`` is given (this rank's own
    construction failed before the meeting: it tells the others at once, returns, and the caller raises
    its error); "gone" once it gave up waiting, so a rank that comes later is told who gave up. Every
    rank joins every meeting, failed or not, so the meetings stay numbered alike on every rank."""
    ranks = global_ranks(group)
    if len(ranks) == 1:
        return []
    gen = next(_generation)
    st = store()
    if st is None:  # no store: gloo's monitored barrier names at least the missing ranks on rank 0
        if failed is None:
            dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)
        return []
    prefix = f"pyasync/join/{gen}/{'-'.join(map(str, ranks))}"
    keys = [f"{prefix}/{g}" for g in ranks]
    me = keys[ranks.index(dist.get_rank())]
    if failed is not None:
        st.set(me, (_FAILED + f"{type(failed).__name__}: {failed}")[:4000])
        return keys
    st.set(me, _OK)
    try:
        st.wait(keys, timeout)
    except Exception as e:
        missing = [r for r, k in enumerate(keys) if not st.check([k])]
        with contextlib.suppress(Exception):
            st.set(me, _GONE)
        raise PeerFailure(
            f"pyasync: ranks {missing} did not reach {what} within {timeout.total_seconds():g} s "
            "(late, hung or dead); every rank of the process group must create the optimizer",
            missing,
        ) from e
    bad = gave_up(keys, what)
    if bad is not None:
        raise bad
    return keys


def gave_up(keys: list[str], what: str) -> PeerFailure | None:
    """After a meeting: a PeerFailure naming the ranks whose construction failed or that gave up waiting
    (their keys say so), or None when every rank says "ok"."""
    st = store()
    if st is None or not keys:
        return None
    try:
        values = [st.get(k).decode(errors="replace") if st.check([k]) else _GONE for k in keys]
    except Exception:
        return None
    failed = {r: v[len(_FAILED) :] for r, v in enumerate(values) if v.startswith(_FAILED)}
    gone = [r for r, v in enumerate(values) if v == _GONE]
    if failed:
        ranks = sorted(failed)
        return PeerFailure(
            f"pyasync: ranks {ranks} failed before {what}: "
            + "; ".join(f"rank {r}: {failed[r]}" for r in ranks),
            ranks,
        )
    if gone:
        return PeerFailure(
            f"pyasync: ranks {gone} gave up waiting for this rank at {what} (it came later than their "
            "timeout); start every rank's construction within the timeout",
            gone,
        )
    return None


def roll_call(group, tag: str, wait: datetime.timedelta) -> list[int]:
    """After a collective of ``group`` failed: every rank that gets here sets its key under ``tag`` (the
    same on every rank, e.g. the step) and waits up to ``wait`` for the others'; the ranks (in ``group``)
    whose key is still missing, i.e. that did not reach this point: late, hung or dead. Empty when
    every rank arrived or when there is no store to ask."""
    st = store()
    if st is None:
        return []
    ranks = global_ranks(group)
    keys = [f"pyasync/rollcall/{'-'.join(map(str, ranks))}/{tag}/{g}" for g in ranks]
    try:
        st.set(keys[ranks.index(dist.get_rank())], "1")
        st.wait(keys, wait)
        return []
    except Exception:
        try:
            return [r for r, k in enumerate(keys) if not st.check([k])]
        except Exception:
            return []


def control_group(group, timeout: datetime.timedelta):
    """A private gloo group of ``group``'s ranks (same order) whose collectives wait at most ``timeout``:
    the optimizer runs its own collectives there (agreement, broadcast, barrier, checkpoints), so they
    never wait the user group's timeout and never mix with the user's collectives."""
    ranks = global_ranks(group)
    g = dist.new_group(
        ranks=ranks,
        backend="gloo",
        timeout=timeout,
        use_local_synchronization=group is not None,
        sort_ranks=False,
    )
    if dist.get_rank(g) != dist.get_rank(group):
        raise RuntimeError(
            f"private group rank {dist.get_rank(g)} != process_group rank {dist.get_rank(group)}"
        )
    return g


def collective_failure(e: BaseException, transport, what: str, wait: float = 5.0) -> BaseException:
    """The exception to raise for a collective ``what`` that failed with ``e``: a PeerFailure naming the
    ranks the transport saw fail (waiting briefly for its receivers to notice), else ``e`` itself."""
    if isinstance(e, PeerFailure):
        return e
    failed = transport.wait_failures(wait) if transport is not None else {}
    if failed:
        ranks = sorted(failed)
        err = PeerFailure(
            f"pyasync: {what} failed: " + "; ".join(f"rank {r} failed: {failed[r]}" for r in ranks), ranks
        )
        err.__cause__ = e
        return err
    return e


# -- membership epochs (pyasync/membership.py) ------------------------------------------------------
def may_propose(proposal: list[int], old: list[int]) -> bool:
    """Only a majority of the old members may decide the next epoch (half of them, when they include the
    lowest old rank): a rank that was stopped and finds every peer gone when it runs again (they
    dropped it) is a minority, and waits for the majority's decision instead of forming a job of one."""
    return 2 * len(proposal) > len(old) or (2 * len(proposal) == len(old) and min(old) in proposal)


def agree_members(store, key: str, proposal: list[int], old: list[int], timeout) -> list[int]:
    """The members of the next epoch: the first proposal of a majority written at ``key`` wins
    (``compare_set``); a minority waits (at most ``timeout``) for it."""
    if may_propose(proposal, old):
        got = store.compare_set(key, "", json.dumps(sorted(proposal)))
    else:
        try:
            store.wait([key], timeout)
        except Exception as e:
            raise PeerFailure(
                f"pyasync: this rank sees only {sorted(proposal)} of the ranks {old} still running, a "
                f"minority, and no majority decided the next membership within {timeout}",
                sorted(set(old) - set(proposal)),
            ) from e
        got = store.get(key)
    members = json.loads(got.decode() if isinstance(got, bytes) else got)
    if not isinstance(members, list) or not all(isinstance(r, int) for r in members):
        raise ValueError(f"pyasync: the job's store holds a malformed membership at {key!r}: {got!r}")
    return members


def meet_members(
    st, prefix: str, members: list[int], me: int, tp, old_globals: list[int], timeout
) -> list[int]:
    """Wait (at most ``timeout``) until every member has written its key under ``prefix``; the members
    whose old connections ended meanwhile (they died during the epoch change), if any, instead."""
    st.set(f"{prefix}/{me}", "ok")
    keys = {g: f"{prefix}/{g}" for g in members}
    end = time.monotonic() + timeout.total_seconds()
    while True:
        missing = [g for g in members if not st.check([keys[g]])]
        if not missing:
            return []
        failed = tp.probe() if tp is not None else {}
        died = [g for g in missing if old_globals.index(g) in failed]
        if died:
            return died
        if time.monotonic() > end:
            raise PeerFailure(
                f"pyasync: ranks {missing} did not join membership epoch {prefix.rsplit('/', 2)[-2]} "
                f"within {timeout.total_seconds():g} s",
                missing,
            )
        with contextlib.suppress(Exception):  # a bounded wait for the keys, then look again
            st.wait([keys[g] for g in missing], datetime.timedelta(seconds=0.1))
