"""Helpers for the fault tests (tests/faults/test_failures*.py): a small model, one training step, signals,
what is left of an exception once it crossed a process boundary, and the engine threads still alive.

Worker functions live in the test modules; these helpers run inside the spawned ranks.
"""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time

import torch
import torch.multiprocessing as mp

__all__ = [
    "Net",
    "ctx",
    "describe",
    "die",
    "engine_threads",
    "make",
    "spec",
    "train_step",
    "value_of",
    "wait_state",
]


def ctx():
    """The multiprocessing context of tests/_dist.py (events, barriers and values passed to ranks)."""
    return mp.get_context("spawn")


def spec(policy: str, world: int) -> str:
    """``policy``, with "quorum" meaning Quorum(n - 1) (backup workers: one rank may be missing)."""
    return f"quorum:{world - 1}" if policy == "quorum" else policy


class Net(torch.nn.Module):
    """Two small layers; ``on_backward`` runs inside backward(), after fc2's gradients, before fc1's."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, on_backward=None) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        if on_backward is not None and h.requires_grad:
            h.register_hook(lambda g: on_backward())
        return self.fc2(h)


def make(policy: str, world: int, timeout: datetime.timedelta, **kw):
    """(model, DistributedOptimizer) with the same start on every rank; several buckets, so a step's push
    is several messages to every owner."""
    import pyasync

    torch.manual_seed(0)
    model = Net()
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        policy=spec(policy, world),
        bucket_cap_mb=200 / 2**20,
        named_parameters=model.named_parameters(),
        timeout=timeout,
        **kw,
    )
    return model, opt


def train_step(model, opt, rank: int, t: int, on_backward=None, before_step=None) -> None:
    """zero_grad, forward, backward, step on data that depends on the rank and the step."""
    g = torch.Generator().manual_seed(1000 * rank + t)
    opt.zero_grad()
    model(torch.randn(4, 8, generator=g), on_backward).pow(2).mean().backward()
    if before_step is not None:
        before_step()
    opt.step()


def die() -> None:
    """SIGKILL this process (no handler, no cleanup, no goodbye)."""
    os.kill(os.getpid(), signal.SIGKILL)


def wait_state(pid: int, states: str, timeout: float) -> str:
    """Wait (at most ``timeout`` seconds, polling /proc) until process ``pid`` is in one of ``states``
    (``ps`` letters: "T" stopped, "Z" dead and not yet reaped; "X" also when it is gone); its state."""
    end = time.monotonic() + timeout
    while True:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            state = "X"
        if state in states or time.monotonic() > end:
            return state
        time.sleep(0.01)  # polling an observable state, not standing in for one


def value_of(v, timeout: float = 60.0) -> int:
    """An mp.Value's content once it is non-zero (waits at most ``timeout`` seconds, polling)."""
    end = time.monotonic() + timeout
    while v.value == 0 and time.monotonic() < end:
        time.sleep(0.01)  # polling a shared value, not standing in for one
    return v.value


def engine_threads() -> list[str]:
    """Names of this process's live pyasync engine threads."""
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("pyasync-") and t.is_alive())


def describe(e: BaseException | None) -> dict | None:
    """An exception as plain data (type, message, ``ranks``, and its chain of causes)."""
    if e is None:
        return None
    chain, c = [], e
    while c is not None and len(chain) < 8:
        chain.append({"type": type(c).__name__, "msg": str(c), "ranks": getattr(c, "ranks", None)})
        c = c.__cause__ or c.__context__
    return {"type": type(e).__name__, "msg": str(e), "ranks": getattr(e, "ranks", None), "chain": chain}
