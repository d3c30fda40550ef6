"""How an Engine ends: close() (drain, serve the others until every rank closed, install the final
values), abort() after a failure, and under elastic membership the departure of a rank and the two
halves of an epoch change (drain_epoch, stop_epoch; pyasync/session/membership.py). A mixin of
engine/engine.py's Engine: it uses the Engine's threads (pusher, owner, mailbox) and condition.
"""

from __future__ import annotations

import logging
import threading
import time

from pyasync.engine import wire
from pyasync.engine.core.clock import wait_until
from pyasync.engine.p2p.messages import Control, Stop

__all__ = ["Lifecycle"]

_log = logging.getLogger("pyasync")


class Lifecycle:
    """close(), abort() and the elastic epoch's halves, for the Engine."""

    # -- close ------------------------------------------------------------------------------------
    def _missing_finals(self) -> str:
        text = "every rank to close: final values missing from " + self._missing(self.mailbox.not_final())
        late = self.owner.unclosed()
        if late:
            text += f"; this rank's shards have not seen worker ranks {late} close"
        return text

    def _progress(self) -> int:
        """Grows while any rank still makes progress this rank can see (for close()'s deadline)."""
        return self.owner.processed_total() + self.mailbox.delivered

    def close(self) -> None:
        """Drain, serve the others until every rank has closed, install the final values, stop. After a
        failure: stop every thread at once and raise the failure if no call has raised it yet."""
        if self.closed:
            return
        self.closed = True
        if self.error is not None:  # closing after a failure: stop, and say why unless a call already did
            self.capture.remove()
            self.abort()
            if not self.reported:
                self.check()
            return
        ok = False
        try:
            self.pusher.q.put(Control(wire.CLOSE, self.clock))
            while True:
                with self.cond:
                    self.wait_seconds += wait_until(
                        self.cond,
                        lambda: self.mailbox.all_final() or (self.clip is not None and self.clip.ready()),
                        self.timeout,
                        self._missing_finals,
                        self._err,
                        progress=self._progress,
                    )
                    done = self.mailbox.all_final()
                if done:
                    break
                self.grad_norm = self.clip.run()  # a slower rank's round: this rank still helps clip it
            self.mailbox.install(final=True)
            ok = True
            if self.lost:  # elastic: a rank left while this one closed; the optimizer changes epoch
                self.closed, self.drained = False, True
                return
        except BaseException as e:
            self._sticky(e)
            raise
        finally:
            if not self.drained:
                self.capture.remove()
                if ok:
                    self._stop()
                else:
                    self.abort()

    def abort(self, reason: str | None = None) -> None:
        """Stop every engine thread at once (after a failure): wake what waits, join, close the sockets.
        The peers are told ``reason``, else this rank's failure, if there is one (so a rank that gives up
        is not mistaken for the first failure)."""
        if self.transport is not None:
            self.transport.abort(self.abort_reason(reason), getattr(self.error, "ranks", None))
        self.owner.abort()
        self.pusher.q.put(Stop(None))
        wait = min(5.0, self.timeout.total_seconds())
        for t in self.threads():
            t.join(wait)
        if self.transport is not None and hasattr(self.transport, "stop_heartbeats"):
            self.transport.stop_heartbeats()
        alive = [t.name for t in self.threads() if t.is_alive()]
        if alive:  # say so: a thread left inside a native call may crash the interpreter's exit
            _log.warning(
                "pyasync: rank %d: threads %s did not stop within %g s of abort(); they are daemon threads "
                "and may still be inside a socket call or a kernel when the interpreter exits",
                self.rank,
                alive,
                wait,
            )

    def _stop(self, close_transport: bool = True) -> None:
        self.pusher.q.put(Stop(self.timeout))
        self.pusher.join(self.timeout.total_seconds())
        self.owner.stop(self.timeout, receiver=not self.lost)
        if self.lost and self.transport is not None:
            # Ranks left: the receivers may still wait for a message only they would have sent (every
            # live rank's CLOSE and FINAL are in); waking them ends those waits.
            self.check()
            self.transport.wake_receivers()
            if self.owner.receiver is not None:
                self.owner.receiver.join(self.timeout.total_seconds())
        if self.mailbox.thread is not None:
            self.mailbox.thread.join(self.timeout.total_seconds())
        alive = [t.name for t in self.threads() if t.is_alive()]
        if alive:
            self.abort()
            raise TimeoutError(f"pyasync: threads {alive} did not stop within {self.timeout}")
        self.check()
        if self.transport is not None:
            if hasattr(self.transport, "stop_heartbeats"):
                self.transport.stop_heartbeats()
            if close_transport:
                self.transport.close()

    def threads(self) -> list[threading.Thread]:
        return [t for t in (self.pusher, self.mailbox.thread, *self.owner.threads()) if t is not None]

    # -- elastic membership (pyasync/session/membership.py) -------------------------------------------------
    def _on_lost(self, ranks: list[int]) -> None:
        """Elastic membership: ``ranks`` left (any thread). Nothing waits for them from now on; the
        optimizer starts the next membership epoch at its next call (pyasync/session/membership.py)."""
        with self.cond:
            new = set(ranks) - self.lost - {self.rank}
            if not new:
                return
            self.lost |= new
            self.lost_at = self.lost_at or time.time()
            self.mailbox.depart(new)
            self.cond.notify_all()
        self.owner.depart(sorted(new))
        _log.warning("pyasync: rank %d saw ranks %s leave (their connections ended)", self.rank, sorted(new))

    def silence_deadline(self) -> float:
        """Seconds of silence after which a peer counts as gone (Note [Heartbeats] in
        transport/heartbeats.py): ten times this rank's median step time, at least 3 s, at most the
        timeout."""
        recent = sorted(self.step_seconds)
        typical = recent[len(recent) // 2] if recent else 0.0
        return min(self.timeout.total_seconds(), max(3.0, 10.0 * typical))

    def drain_epoch(self) -> None:
        """Elastic membership, first half of an epoch change: CLOSE to every owner, wait (at most twice
        the timeout: a survivor blocked in a collective with the dead rank, a checkpoint save, notices
        only when that collective times out) until every live owner has applied every live worker's
        pushes and sent its final values, install them. The threads keep running (the shards can still
        be read); ``stop_epoch`` ends them."""
        if self.drained:  # close() already did it
            return
        self.check()
        if self.in_flight is not None:
            self._finish(self.in_flight)
        self.drained = True
        self.pusher.q.put(Control(wire.CLOSE, self.clock))
        try:
            with self.cond:
                self.wait_seconds += wait_until(
                    self.cond,
                    self.mailbox.all_final,
                    2 * self.timeout,  # a survivor may first sit out a collective (a save) for a timeout
                    self._missing_finals,
                    self._err,
                    progress=self._progress,
                )
            self.mailbox.install(final=True)
        except BaseException as e:
            self._sticky(e)
            raise

    def stop_epoch(self) -> None:
        """Second half: stop every thread, say goodbye to the live peers. The transport stays open (its
        connections still tell who dies during the epoch change) until ``transport.close()``."""
        self.closed = True
        self.capture.remove()
        try:
            self._stop(close_transport=False)
        except BaseException:
            self.abort()
            raise
