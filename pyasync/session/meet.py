"""Meeting the other ranks with a deadline that names who is missing.

``join`` is a barrier through the job's store: each rank sets its own key and waits (at most
``timeout``) for every rank's key. When the wait times out, every rank reads which keys are missing,
so every rank names the same late, hung or dead ranks in the same exception. Used where ranks first
meet (the optimizer's construction), where a plain collective would wait the process group's own
timeout (30 minutes by default) and then report an address and a port.

``collective_failure`` turns a failed collective (a gloo error or timeout) into a PeerFailure naming the
ranks the transport saw fail, when it saw any.

Note [A bounded store]
    torch's TCPStore client bounds a ``wait`` (and the wait inside ``get``) by a ``poll``, but every
    reply is then read with a blocking ``recv`` that has no deadline: a store host that is stopped
    (SIGSTOP, a hung machine) and keeps its sockets open leaves ``get``, ``wait``, ``add``, ``check``
    and ``compare_set`` blocked for as long as it is stopped (measured: a survivor waited 97 s of a
    100 s SIGSTOP with ``timeout=10 s``), torch's own ``new_group`` and gloo's rendezvous on the same
    store included. :func:`bound_store` sets the kernel's receive and send timeouts (SO_RCVTIMEO,
    SO_SNDTIMEO) on this process's client connections to the store, to 2 x the optimizer's timeout +
    5 s (the longest, when several optimizers ask). That is longer than any wait pyasync asks of the
    store (each at most the timeout), so a live store's ``wait`` always ends on its own deadline: a
    socket timeout equal to it raced it and, when it won, failed a healthy store with "Socket
    Timeout" and left the client in the middle of a reply. A stopped host then fails every store call
    with "Socket Timeout" after at most that bound (after the wait's own deadline, the next call's
    ``recv``), and a dead one at once ("Connection reset by peer", "Broken pipe", "got 0 bytes").
    A live store answers in milliseconds, so nothing waits that long unless the host is gone.
    :func:`store_failure` turns such an error (a ``DistNetworkError`` anywhere in the chain) into a
    PeerFailure that names the store's address and the rank whose process hosts it (each rank looks
    whether it listens on the store's port, and the host writes its rank at the first meeting), and
    says what to do: an elastic job needs its store outside the workers (``python -m pyasync.store``).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import os
import socket
import stat
import struct
import time

import torch.distributed as dist

from pyasync.errors import PeerFailure

__all__ = [
    "StoreHost",
    "agree_members",
    "bound_store",
    "collective_failure",
    "control_group",
    "gave_up",
    "global_ranks",
    "join",
    "may_propose",
    "meet_members",
    "roll_call",
    "settle",
    "store",
    "store_failure",
]

_generation = itertools.count()  # joins made by this process (the same sequence on every rank)


def store():
    """The job's store (the one torch.distributed was initialised with), or None when unavailable."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:
        return None


# -- the store: bounded, and named when it fails (Note [A bounded store]) ------------------------------
_HOST_KEY = "pyasync/store_host"  # the global rank whose process hosts the store, when a worker does
_STORE_SLACK_S = 5.0  # the store bound is 2 x timeout + this (Note [A bounded store])
_bounded_s: dict[tuple[str, int], float] = {}  # (host, port) -> the receive timeout set on its clients


def _tcp_store(st):
    """The TCPStore under ``st`` (PrefixStores unwrapped), or None."""
    for _ in range(8):
        if st is None or hasattr(st, "port"):
            return st
        st = getattr(st, "underlying_store", None)
    return None


def _addresses(host: str) -> set[str]:
    try:
        return {a[4][0] for a in socket.getaddrinfo(host, None)} | {host}
    except OSError:
        return {host}


def _store_sockets(host: str, port: int, listening: bool):
    """This process's TCP sockets (dup'ed: close them) that talk to the store at ``host:port``
    (``listening``: that serve it), found in /proc/self/fd (Linux; nothing elsewhere)."""
    try:
        fds = [int(f) for f in os.listdir("/proc/self/fd")]
    except OSError:
        return
    addrs = _addresses(host)
    for fd in fds:
        try:  # sockets only: anything else is skipped before it is duplicated
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            dup = os.dup(fd)
        except OSError:
            continue
        try:
            s = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            continue
        try:
            if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            if listening:
                if s.getsockname()[1] == port and s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    yield s
                continue
            peer = s.getpeername()
            ip = peer[0].removeprefix("::ffff:")
            if peer[1] == port and (ip in addrs or peer[0] in addrs):
                yield s
        except OSError:
            pass
        finally:
            s.close()


def bound_store(st, timeout: datetime.timedelta) -> None:
    """Bound every reply this process's clients of the store ``st`` wait for by ``timeout`` (the longest
    asked so far): Note [A bounded store]. Best effort: a store that is not a TCPStore is left alone."""
    tcp = _tcp_store(st)
    if tcp is None:
        return
    key = (tcp.host, tcp.port)
    # Longer than any wait pyasync asks of the store (each at most ``timeout``): a live store's wait
    # ends on its own deadline, never on this one, which would leave the client mid-reply.
    secs = max(_bounded_s.get(key, 0.0), 2 * timeout.total_seconds() + _STORE_SLACK_S)
    tv = struct.pack("ll", int(secs), int((secs % 1) * 1e6))
    for s in _store_sockets(tcp.host, tcp.port, listening=False):
        with contextlib.suppress(OSError):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    _bounded_s[key] = secs


def _hosts_store(st) -> bool:
    tcp = _tcp_store(st)
    return tcp is not None and any(True for _ in _store_sockets(tcp.host, tcp.port, listening=True))


class StoreHost:
    """Where the job's store lives: its address and the global rank whose process hosts it (None: no
    worker does, e.g. ``python -m pyasync.store`` or torchrun's agent), as learnt at the first meeting."""

    rank: int | None = None
    known = False


def store_failure(e: BaseException, what: str, group=None, timeout=None) -> PeerFailure | None:
    """A PeerFailure naming the store's host when ``e`` (or its cause) is the store failing (no answer
    within the bound of Note [A bounded store], a connection reset or closed), else None."""
    c, n = e, 0
    while c is not None and not isinstance(c, dist.DistNetworkError) and n < 8:
        c, n = c.__cause__ or c.__context__, n + 1
    if c is None or not isinstance(c, dist.DistNetworkError):
        return None
    tcp = _tcp_store(store())
    where = f"{tcp.host}:{tcp.port}" if tcp is not None else "(unknown address)"
    raw = str(c).strip().splitlines()[0] if str(c).strip() else type(c).__name__
    how = (
        f"did not answer within {2 * timeout.total_seconds() + _STORE_SLACK_S:g} s"
        if timeout is not None and "timeout" in raw.lower()
        else "closed its connection"
    )
    host = StoreHost.rank
    ranks: list[int] = []
    if host is not None:
        members = global_ranks(group) if dist.is_initialized() else [host]
        ranks = [members.index(host)] if host in members else []
        who = f"hosted by the process of rank {host}, which is stopped, hung or dead, and the store with it"
    else:
        who = "hosted outside the workers, which is stopped, hung, dead or unreachable"
    err = PeerFailure(
        f"pyasync: the job's store at {where} ({who}) {how} during {what} ({raw}). Every rank needs the "
        "store at every membership change and at construction: an elastic job needs its store outside "
        "the workers, in a process that outlives them (`python -m pyasync.store --port PORT` on a "
        "machine that stays up, every rank pointed at it: the README's recipe)",
        ranks,
    )
    err.__cause__ = e
    return err


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
    rank joins every meeting, failed or not, so the meetings stay numbered alike on every rank. Every
    store call is bounded, and a store that fails is named (Note [A bounded store])."""
    ranks = global_ranks(group)
    if len(ranks) == 1:
        return []
    gen = next(_generation)
    st = store()
    if st is None:  # no store: gloo's monitored barrier names at least the missing ranks on rank 0
        if failed is None:
            dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)
        return []
    keys = _keys(gen, ranks)
    me = keys[ranks.index(dist.get_rank())]
    try:
        bound_store(st, timeout)
        if failed is not None:
            st.set(me, (_FAILED + _describe(failed))[:4000])
            return keys
        if not StoreHost.known and _hosts_store(st):
            st.set(_HOST_KEY, str(dist.get_rank()))
        st.set(me, _OK)
        missing = _wait_keys(st, keys, timeout)
        if not missing and not StoreHost.known:
            StoreHost.rank = int(st.get(_HOST_KEY)) if st.check([_HOST_KEY]) else None
            StoreHost.known = True
    except Exception as e:
        raise (store_failure(e, what, group, timeout) or e) from e
    if missing:
        with contextlib.suppress(Exception):
            st.set(me, _GONE)
            _linger(st, keys, missing, me, timeout)
        raise PeerFailure(
            f"pyasync: ranks {missing} did not reach {what} within {timeout.total_seconds():g} s "
            "(late, hung or dead); every rank of the process group must create the optimizer",
            missing,
        )
    bad = gave_up(keys, what)
    if bad is not None:
        raise bad
    return keys


def _linger(st, keys: list[str], missing: list[int], me: str, timeout: datetime.timedelta) -> None:
    """A meeting failed. When this process hosts the store (a worker does, under env://), wait (at most
    ``timeout``) until every other rank that came has read the outcome and marked its key "gone": the
    store ends with this process, and a rank whose own wait ended a moment later would otherwise find
    it gone and could only report the store, not the missing ranks."""
    if not _hosts_store(st):
        return
    others = [k for r, k in enumerate(keys) if r not in missing and k != me]
    end = time.monotonic() + timeout.total_seconds()
    while others and time.monotonic() < end:
        others = [k for k in others if st.get(k).decode(errors="replace") != _GONE]
        if others:
            time.sleep(0.05)


def membership_prefix(keys: list[str]) -> str:
    """The job's prefix in the store for membership records, named after the meeting whose keys are
    ``keys`` (its "join" prefix, with "membership" for "join"); "pyasync/job" without one."""
    return (keys[0].rsplit("/", 1)[0] if keys else "pyasync/job").replace("join", "membership", 1)


def solo_key() -> str:
    """The store prefix of an elastic job of one rank, which has no meeting to name it (the prefix a
    meeting of that one rank would give), so that workers can join it (Note [Joining a running job])."""
    return membership_prefix(_keys(next(_generation), [dist.get_rank()]))


def _keys(gen: int, ranks: list[int]) -> list[str]:
    prefix = f"pyasync/join/{gen}/{'-'.join(map(str, ranks))}"
    return [f"{prefix}/{g}" for g in ranks]


def _describe(e: BaseException) -> str:
    """A failure as a meeting key holds it: "<the ranks it names, JSON> <type>: <message>"."""
    return f"{json.dumps(list(getattr(e, 'ranks', ()) or ()))} {type(e).__name__}: {e}"


def _text(v: str) -> str:
    """A failed key's text without the ranks it names."""
    head, _, rest = v.partition(" ")
    return rest if head.startswith("[") else v


def _wait_keys(st, keys: list[str], timeout: datetime.timedelta, look=None, poll: float = 0.1) -> list[int]:
    """Wait (at most ``timeout``) for every key; the ranks whose key is missing then (empty: all came).
    ``look(missing)``, called every ``poll`` s while keys are missing, may end the wait by raising."""
    if look is None:
        try:
            st.wait(keys, timeout)
            return []
        except dist.DistNetworkError:
            raise
        except Exception:
            return [r for r, k in enumerate(keys) if not st.check([k])]
    end = time.monotonic() + timeout.total_seconds()
    while True:
        missing = [r for r, k in enumerate(keys) if not st.check([k])]
        if not missing:
            return []
        look(missing)
        left = end - time.monotonic()
        if left <= 0:
            return missing
        # Polling the keys (check) rather than a short st.wait: torch logs every wait that times out.
        time.sleep(min(left, poll))


def _named(st, keys: list[str], skip: list[int]) -> list[int]:
    """The ranks that the failed keys of a meeting name as dead (see ``_describe``)."""
    out: list[int] = []
    for r, k in enumerate(keys):
        if r in skip:
            continue
        v = st.get(k).decode(errors="replace")
        if v.startswith(_FAILED):
            with contextlib.suppress(ValueError):
                out += [int(x) for x in json.loads(v[len(_FAILED) :].split(" ", 1)[0])]
    return sorted(set(out))


def settle(group, timeout: datetime.timedelta, what: str, transport, failed: BaseException | None):
    """The last meeting of the construction: every rank comes, failed or not. Returns None when every
    rank got through, else the exception this rank raises: a PeerFailure naming the dead ranks, the
    same on every rank (or ``failed`` itself, when every rank came and failed alike).

    Note [Failing together at construction]
        After the first meeting a rank can die in the private group's set-up (the others then wait
        in gloo's rendezvous for its key), in the transport's set-up, in the agreement or in the
        initial broadcast. What the others saw depended on where: a rendezvous timeout listing store
        keys, gloo's "Connection closed by peer", a rank that stopped for its own failure taken for
        the dead one, or nothing at all (the broadcast's source returned while the others failed,
        and failed only at its first step). So every rank ends the construction here, through the
        store, failed or not:

        * a rank that got through writes "ok" and waits (at most ``timeout``) for the others' keys,
          looking every 0.1 s at its connections (a dead rank's end at once) and at the keys (one
          that says "failed" and names dead ranks): it raises the PeerFailure naming them at once;
        * a rank that failed names the dead ranks when it can (its connections:
          ``collective_failure``), writes "failed: <ranks> <error>" and raises at once when it named
          them; else it waits (at most ``timeout``: a live rank's own failure comes within that) for
          the others' keys, adopts the ranks another key names, and otherwise names the ranks that
          never came.

        So no rank's constructor returns while another's fails, and the meetings stay numbered alike."""
    ranks = global_ranks(group)
    st = store()
    if len(ranks) == 1 or st is None:
        return failed
    keys = _keys(next(_generation), ranks)
    me = ranks.index(dist.get_rank())
    try:
        if failed is None:
            st.set(keys[me], _OK)

            def look(missing: list[int]) -> None:
                dead = sorted(transport.probe()) if transport is not None else []
                dead = dead or _named(st, keys, missing)
                if dead:
                    raise PeerFailure(
                        f"pyasync: ranks {dead} failed during {what} (seen by this rank's connections "
                        "or by another rank)",
                        dead,
                    )

            missing = _wait_keys(st, keys, timeout, look)
            if missing:
                return PeerFailure(
                    f"pyasync: ranks {missing} did not finish {what} within {timeout.total_seconds():g} "
                    "s (late, hung or dead)",
                    missing,
                )
            err = gave_up(keys, what)
            if err is None:
                _leave_last(st, keys, ranks, timeout, transport)
            return err
        st.set(keys[me], (_FAILED + _describe(failed))[:4000])
        if isinstance(failed, PeerFailure) and failed.ranks:
            return failed

        def adopt(missing: list[int]) -> None:
            dead = _named(st, keys, [*missing, me])
            if dead:
                raise PeerFailure(f"pyasync: ranks {dead} failed during {what} ({failed})", dead)

        missing = _wait_keys(st, keys, timeout, adopt)
        if not missing:
            return failed
        err = PeerFailure(
            f"pyasync: ranks {missing} did not finish {what} (hung or dead): this rank failed with "
            f"{type(failed).__name__}: {failed}",
            missing,
        )
        err.__cause__ = failed
        return err
    except PeerFailure as e:
        if e.__cause__ is None and failed is not None:
            e.__cause__ = failed
        return e
    except Exception as e:
        return store_failure(e, what, group, timeout) or failed or e


def _leave_last(st, keys: list[str], ranks: list[int], timeout: datetime.timedelta, transport) -> None:
    """After a settled construction: the store's host returns only once every rank is done reading the
    meeting's keys (at most ``timeout``; at once when a rank's connection ends).

    Note [The store's host leaves last]
        The ranks read the others' keys by polling, and a rank that saw every key returns and trains.
        When its process also hosts the store (rank 0, unless torchrun's agent or ``pyasync.store``
        hosts it) and it dies a few steps later, a rank still reading the keys lost the store and
        raised from its constructor (a CI run of test_sigkill_of_rank_0_of_4: rank 2 slower to read,
        rank 0 dead at its third step), so one constructor failed while the others returned. Each rank
        counts itself done; the last one to count sets a key the host waits for. Best effort: a rank
        that dies after it read the keys is the first step's to report, not the constructor's."""
    done = f"{keys[0].rsplit('/', 1)[0]}/done"
    try:
        if st.add(done, 1) >= len(ranks):
            st.set(done + "/all", _OK)
        if StoreHost.rank != dist.get_rank():
            return

        def look(_missing: list[int]) -> None:
            if transport is not None and transport.probe():
                raise PeerFailure("pyasync: a rank's connection ended", [])

        _wait_keys(st, [done + "/all"], timeout, look, poll=0.01)
    except Exception:  # best effort: the first step names whoever failed
        pass


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
    failed = {r: _text(v[len(_FAILED) :]) for r, v in enumerate(values) if v.startswith(_FAILED)}
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
    except Exception as e:
        err = store_failure(e, f"a roll call ({tag})", group, wait)
        if err is not None:  # the store itself failed: name it (Note [A bounded store])
            raise err from e
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


# -- membership epochs (pyasync/session/membership.py) ------------------------------------------------------
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
    st, prefix: str, members: list[int], me: int, tp, old_globals: list[int], timeout, grace: float = 10.0
) -> list[int]:
    """Wait (at most ``timeout``) until every member has written its key under ``prefix``; the members
    whose old connections ended meanwhile (they died during the epoch change), if any, instead. A member
    new to the job (a joiner: not in ``old_globals``) that is still missing after ``grace`` seconds is
    taken for dead (it waits for this record and answers within a poll)."""
    st.set(f"{prefix}/{me}", "ok")
    keys = {g: f"{prefix}/{g}" for g in members}
    start = time.monotonic()
    end = start + timeout.total_seconds()
    while True:
        missing = [g for g in members if not st.check([keys[g]])]
        if not missing:
            return []
        failed = tp.probe() if tp is not None else {}
        died = [g for g in missing if g in old_globals and old_globals.index(g) in failed]
        if time.monotonic() - start > min(grace, timeout.total_seconds() / 2):
            died += [g for g in missing if g not in old_globals]
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
