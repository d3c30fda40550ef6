"""The collectives of a BSP step on collectives (Note [BSP on collectives] in engine/collective/engine.py),
run on the optimizer's own gloo group: a collective that fails becomes one error that names the ranks
that died or did not come, recorded by the engine's ``Failures`` so every later call raises it too."""

from __future__ import annotations

import datetime
from collections.abc import Callable

from pyasync.errors import PeerFailure
from pyasync.session.meet import collective_failure, roll_call

__all__ = ["RESUME", "StepGroup"]

_ROLL_CALL = datetime.timedelta(seconds=5)  # how long survivors wait for each other to name the absent

#: What a survivor of a dead rank can do under BSP on collectives (it cannot go on without it).
RESUME = (
    "BSP on collectives cannot go on without a rank: resume from the last checkpoint "
    "(pyasync.load_checkpoint), or train with elastic=True under bsp:p2p, SSP, ASP or Quorum"
)


class StepGroup:
    """The optimizer's own group as the collective engine's parts use it: ``run`` a collective, ``wait``
    for an asynchronous one, ``failure`` for one that failed. Receives the group (``control``; None
    with one rank), the transport (it may have seen a rank die), the timeout, the engine's clock (to
    name the step) and ``record`` (the engine's Failures.record). It counts the step collectives run
    (``rounds``, steps and joins alike: the same sequence on every rank), which tags the roll calls and
    the compressed replies."""

    def __init__(
        self,
        *,
        control,
        transport,
        timeout: datetime.timedelta,
        clock: Callable[[], int],
        record: Callable[[BaseException], None],
    ) -> None:
        self.control, self.transport, self.timeout = control, transport, timeout
        self.clock, self.record = clock, record
        self.rounds = 0  # step collectives run (steps and joins)

    def begin_round(self) -> None:
        """One more step collective (stepping or joining): every rank counts the same."""
        self.rounds += 1

    def run(self, what: str, fn, *args, **kwargs):
        """``fn(*args, group=control, **kwargs)``; a failure raises ``failure(what, e)``."""
        try:
            return fn(*args, group=self.control, **kwargs)
        except Exception as e:
            raise self.failure(what, e) from e

    def wait(self, work, what: str) -> None:
        """Wait for an asynchronous collective's ``work``; a failure raises ``failure(what, e)``."""
        try:
            work.wait()
        except Exception as e:
            raise self.failure(what, e) from e

    def failure(self, what: str, e: BaseException) -> BaseException:
        """A collective of this step failed: a PeerFailure naming the ranks that died (seen by the
        transport) or that did not come (a roll call through the store), kept for every later call."""
        clock = self.clock()
        # A dead rank's connections end at once (its kernel closes them): a short look suffices
        # before the roll call, which then names ranks that hang.
        err = collective_failure(e, self.transport, f"{what} of step {clock}", wait=1.0)
        if not isinstance(err, PeerFailure):
            missing = roll_call(self.control, f"round{self.rounds}", min(self.timeout, _ROLL_CALL))
            if missing:
                err = PeerFailure(
                    f"pyasync: ranks {missing} did not reach step {clock} ({what}) within "
                    f"{self.timeout.total_seconds():g} s: late, hung or dead (under BSP every rank steps "
                    "together; a rank that stops early must call close())",
                    missing,
                )
            else:
                err = RuntimeError(f"pyasync: {what} of step {clock} failed: {e}")
        if isinstance(err, PeerFailure) and RESUME not in str(err):
            err.args = (f"{err.args[0]}; {RESUME}", *err.args[1:])
        self.record(err)
        return err
