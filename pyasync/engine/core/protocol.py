"""The one interface both engines implement (``EngineProtocol``): what pyasync.optimizer, pyasync.checkpoint
and pyasync.session.membership use of an engine, so they need neither ``getattr`` probes nor the
engines' private members. The point-to-point Engine (engine/p2p/engine.py: SSP, ASP, Quorum,
bsp:p2p) and the CollectiveEngine (engine/collective/engine.py: BSP on collectives) both satisfy it.

The elastic epoch change (pyasync/session/membership.py) also uses members of the point-to-point Engine
alone (``drain_epoch``, ``stop_epoch``, ``lost_at``, ``mailbox``, ``pusher``, ``cond``, ``policy``,
``spec``): elastic=True needs that engine (pyasync/_construct.py), so they are not part of this protocol.
"""

from __future__ import annotations

import threading
from collections.abc import Set
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

from pyasync.engine.core.access import ShardAccess
from pyasync.engine.core.capture import Capture
from pyasync.engine.core.stats import Stats

__all__ = ["EngineProtocol"]


@runtime_checkable
class EngineProtocol(Protocol):
    """One rank's engine, as the optimizer, the checkpoints and the membership change drive it (from one
    thread: the training thread)."""

    #: close() or abort() ran (the optimizer's teardown sets it too before abort()); no call but close()
    #: and abort() may follow.
    closed: bool
    #: The optimizer's own gloo group (None with one rank); the optimizer sets it to None once the group
    #: is destroyed, so no reference keeps it alive.
    control: Any

    @property
    def clock(self) -> int:
        """Completed step() calls of this rank (the next step's clock)."""
        ...

    @property
    def lost(self) -> Set[int]:
        """The ranks this engine saw leave (elastic membership); empty when none, so its truthiness says
        whether a membership change is due. Always empty under BSP on collectives."""
        ...

    @property
    def drained(self) -> bool:
        """A rank left during close(): the live owners' final values are installed, the engine is not
        closed, and the optimizer changes epoch before closing again. Always False under BSP on
        collectives."""
        ...

    @property
    def shards(self) -> ShardAccess:
        """The state access of this rank's shards (snapshot, load, masters, install_values, restore_held;
        engine/core/access.py)."""
        ...

    @property
    def capture(self) -> Capture:
        """The gradient hooks; ``capture.remove()`` takes them off (the optimizer's teardown)."""
        ...

    @property
    def transport(self) -> Any:
        """The point-to-point transport (None under BSP on collectives with one rank); a failed collective
        of the optimizer's asks it which rank died."""
        ...

    def step(self, grad_scale: float | None = None, found_inf: bool = False) -> None:
        """Push this step's gradients, wait as the policy says, install fresh values. ``grad_scale``: the
        GradScaler scale the gradients still carry; ``found_inf``: nothing of this step is applied."""
        ...

    def finish(self) -> None:
        """Finish a step whose wait timed out (waiting again, at most the timeout) and install its
        answer; nothing when no step is in flight."""
        ...

    def close(self) -> None:
        """Drain, serve the others until every rank closed, install the final values, stop. After a
        failure: stop, and raise it unless a call already did. Idempotent."""
        ...

    def abort(self, reason: str | None = None) -> None:
        """Stop at once (after a failure, or without close()); the peers are told ``reason``, else this
        rank's failure."""
        ...

    def no_sync(self) -> AbstractContextManager[None]:
        """Context: gradients accumulate over several backward() calls, nothing is pushed."""
        ...

    def pause(self) -> None:
        """This rank waits in a barrier (or a save) and pushes nothing until ``resume()``."""
        ...

    def resume(self) -> None:
        """End a pause; returns once this rank's owner has every rank's RESUME."""
        ...

    def drain(self, want: list[int]) -> None:
        """Wait (at most the timeout) until every owned shard has processed ``want[w]`` pushes of each
        worker w (a checkpoint's consistent cut)."""
        ...

    def check(self) -> None:
        """Raise the recorded failure, if any."""
        ...

    def record_failure(self, e: BaseException) -> None:
        """Record ``e`` (a failed call, or a failed collective of the caller's): every later call raises
        the first failure recorded."""
        ...

    def installed_versions(self) -> dict[tuple[int, int], int]:
        """{(bucket, owner rank): version} of the shard values this rank installed."""
        ...

    def threads(self) -> list[threading.Thread]:
        """The engine's threads (none under BSP on collectives)."""
        ...

    def stats(self) -> Stats:
        """This rank's counters (pyasync.Stats)."""
        ...

