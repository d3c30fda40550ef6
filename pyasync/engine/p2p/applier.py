"""Appliers: the threads that own the shards of a rank. Each runs the round machine of its shards
(engine/core/round.py) and carries out the actions it returns: decode, apply (engine/core/rule.py), answer.

Bucket b is owned by applier b % A. An applier alone touches its shards' state, so the hot path takes
no lock, and pushes to shards of different appliers never wait on each other. Its queue carries typed
messages (engine/p2p/messages.py).
"""

from __future__ import annotations

import datetime
import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from pyasync.engine.core import round as rnd
from pyasync.engine.core.rule import ShardState, UpdateRule
from pyasync.engine.core.streams import used_here, wait_event
from pyasync.engine.p2p.messages import Call, Close, Depart, Pause, Push, Release, Result, Stop
from pyasync.ops import codecs as ops_codecs
from pyasync.policy import AUTO_CLIP

if TYPE_CHECKING:
    from pyasync.engine.core.clip import ClipGate
    from pyasync.engine.core.replies import ReplyFrames

__all__ = [
    "Applier",
    "OwnedShard",
    "OwnerSide",
    "add_to_aggregate",
    "apply_aggregate",
    "apply_push",
    "spike_clip",
]


class OwnerSide(Protocol):
    """What an Applier uses of the rank's owner side (engine/p2p/owner.py's Owner): it answers and
    releases the pushes the applier finished, and hears of progress and failures. A protocol, so that
    applier.py does not import owner.py (which builds the appliers)."""

    gate: ClipGate | None  # the clipping gate (engine/core/clip.py), or None
    replies: ReplyFrames  # what each worker holds, for coded replies and delay compensation

    def fail(self, where: str, e: BaseException) -> None: ...
    def release(self, push: Push) -> None: ...
    def progressed(self) -> None: ...
    def resumed(self, w: int) -> None: ...
    def drain_sends(self, ap: Applier, timeout: datetime.timedelta) -> None: ...
    def answer(self, ap: Applier, sh: OwnedShard, dests, final: bool, ahead=()) -> None: ...


@dataclass
class OwnedShard:
    """One shard this rank owns: its round (policy bookkeeping) and its optimizer state."""

    round: rnd.Round
    state: ShardState
    agg: torch.Tensor | None = None  # the aggregate being summed (aggregate rounds), zeroed after each update
    norm: float | None = None  # running norm of the applied pushes' gradients (Note [Spike clipping])

    @property
    def bucket(self) -> int:
        return self.state.bucket


def apply_push(
    rule: UpdateRule,
    sh: OwnedShard,
    push: Push,
    n: int,
    lr_factor: float,
    implicit: float = 0.0,
    per_round: bool = False,
    dc: tuple[float, torch.Tensor] | None = None,
    clip: float | str = 0.0,
    gap_held: torch.Tensor | None = None,
) -> None:
    """Apply one push as an update of its own (Apply): its gradient x 1/n (Adam: its learning rate x 1/n,
    Note [A round of pushes] in pyasync/policy.py), the learning rate x ``lr_factor``, the explicit
    momentum less ``implicit`` (Note [Momentum correction]); ``per_round``: the optimizer's moments
    advance per round of n pushes (Note [Moments per round]); ``dc``: (lambda, what the pushing worker
    held of the shard), delay compensation (Note [Delay compensation]); ``clip`` > 0: the gradient is
    clipped at ``clip`` x the shard's running norm (Note [Spike clipping]); "auto": at AUTO_CLIP where the
    optimizer keeps moments (momentum, Adam), not at all where it does not; ``gap_held``: what the
    pushing worker held of the shard, for the gap-aware penalty (Note [Gap-aware penalty])."""
    adaptive = rule.kind == "adam"
    if clip == "auto":
        clip = AUTO_CLIP if sh.state.state1 is not None else 0.0
    scale = spike_clip(sh, push.payload, float(clip)) if clip else 1.0
    rule.apply(
        sh.state,
        payload=push.payload,
        grad_scale=(1.0 if adaptive else 1.0 / n) * scale,
        seg_mask=list(push.mask),
        lr_factor=lr_factor / n if adaptive else lr_factor,
        momentum_shift=implicit,
        round_of=n if per_round else 1,
        dc_lambda=dc[0] if dc is not None else 0.0,
        dc_held=dc[1] if dc is not None else None,
        gap_held=gap_held,
    )


def payload_norm(sh: OwnedShard, payload) -> float:
    """The L2 norm of the gradient ``payload`` decodes to (on a float codec, without decoding)."""
    if payload.codec in ("none", "fp16", "bf16", "topk"):
        return float(torch.linalg.vector_norm(payload.codes, dtype=torch.float32))
    dense = ops_codecs.decode(payload, out=sh.state.scratch_buf(), validate=False)
    return float(torch.linalg.vector_norm(dense))


def spike_clip(sh: OwnedShard, payload, c: float) -> float:
    """The factor that clips this push's gradient at ``c`` x the shard's running norm (1.0 when within),
    and the running norm moved by the clipped norm, over about 32 pushes (Note [Spike clipping]). A push
    with no gradient on the shard (norm 0: its parameters took no part in the step) leaves the running
    norm alone, so that it does not clip the next real push."""
    norm = payload_norm(sh, payload)
    if norm == 0.0:
        return 1.0
    ref = sh.norm
    f = c * ref / norm if ref is not None and norm > c * ref else 1.0
    clipped = norm * f
    sh.norm = clipped if ref is None else ref + (clipped - ref) / 32
    return f


def add_to_aggregate(sh: OwnedShard, push: Push, divisor: int) -> None:
    """Add one push x 1/divisor to the shard's aggregate (Sum)."""
    if sh.agg is None:
        sh.agg = torch.zeros_like(sh.state.master)
    ops_codecs.decode(push.payload, out=sh.agg, alpha=1.0 / divisor, accumulate=True, validate=False)


def apply_aggregate(rule: UpdateRule, sh: OwnedShard, mask, scale: float) -> None:
    """Apply the aggregate x ``scale`` as one update on the masked-in segments, then clear it (Update)."""
    if scale != 1.0:
        sh.agg.mul_(scale)
    rule.apply(sh.state, dense=sh.agg, seg_mask=list(mask))
    sh.agg.zero_()


class Applier(threading.Thread):
    """Applies the pushes of its shards, in arrival order per shard."""

    def __init__(self, owner: OwnerSide, index: int, rule: UpdateRule, world_size: int, divisor: int) -> None:
        super().__init__(name=f"pyasync-applier-{index}", daemon=True)
        self.owner = owner
        self.rule = rule
        self.n = world_size
        self.divisor = divisor
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.shards: dict[int, OwnedShard] = {}
        self.bytes_sent = 0  # reply bytes (headers included)

    # -- the thread ---------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            while True:
                msg = self.q.get()
                if isinstance(msg, Push):
                    sh = self.shards[msg.bucket]
                    if sh.round.departed[msg.worker]:  # it arrived just before its sender left
                        self.owner.release(msg)
                        continue
                    self._do(
                        sh,
                        sh.round.push(msg.worker, msg.clock, msg.version, msg.payload.finite, msg.mask, msg),
                    )
                    self.owner.progressed()
                elif isinstance(msg, Close):
                    for sh in self.shards.values():
                        self._do(sh, sh.round.close(msg.worker))
                    self.owner.progressed()
                elif isinstance(msg, Depart):
                    for sh in self.shards.values():
                        self._do(sh, sh.round.depart(msg.worker))
                    self.owner.progressed()
                elif isinstance(msg, Pause):
                    for sh in self.shards.values():
                        self._do(sh, sh.round.pause(msg.worker, msg.on))
                    if not msg.on:
                        self.owner.resumed(msg.worker)
                elif isinstance(msg, Release):
                    sh = self.shards[msg.bucket]
                    self._do(sh, sh.round.release(msg.scale))
                    self.owner.progressed()
                elif isinstance(msg, Call):
                    try:
                        msg.result.set(msg.fn(self))
                    except BaseException as e:
                        msg.result.fail(e)
                elif isinstance(msg, Stop):
                    if msg.timeout is not None:  # None: stopped after a failure, nothing to wait for
                        self.owner.drain_sends(self, msg.timeout)
                    return
                else:
                    raise TypeError(f"applier got an unknown message {type(msg).__name__}")
        except BaseException as e:
            self.owner.fail(f"applier thread {self.name}", e)

    # -- actions ------------------------------------------------------------------------------------
    def _do(self, sh: OwnedShard, actions: list) -> None:
        for a in actions:
            if isinstance(a, rnd.Apply):
                self._apply(sh, a)
            elif isinstance(a, rnd.Sum):
                self._sum(sh, a.item)
            elif isinstance(a, rnd.Update):
                apply_aggregate(self.rule, sh, a.mask, a.scale)
            elif isinstance(a, rnd.Gate):
                sq = float(torch.dot(sh.agg, sh.agg)) if sh.agg is not None else 0.0
                self.owner.gate.report(a.version, sh.bucket, sq)
            elif isinstance(a, rnd.Release):
                self.owner.release(a.item)
            elif isinstance(a, rnd.Answer):
                self.owner.answer(self, sh, a.dests, a.final, a.ahead)
            else:
                raise TypeError(f"unknown round action {a!r}")

    def _ready(self, sh: OwnedShard, push: Push) -> None:
        """Order this thread's stream after the push's producer (a no-op on the CPU)."""
        dev = sh.state.master.device
        wait_event(push.event, dev)
        used_here(push.payload.tensors(), dev)

    def _apply(self, sh: OwnedShard, a: rnd.Apply) -> None:
        push = a.item
        self._ready(sh, push)
        held = self.owner.replies.held.get((sh.bucket, push.worker)) if a.dc or a.gap else None
        dc = (a.dc, held) if held is not None and a.dc else None
        gap = held if a.gap else None
        apply_push(self.rule, sh, push, self.n, a.lr_factor, a.implicit, a.per_round, dc, a.clip, gap)
        self.owner.release(push)

    def _sum(self, sh: OwnedShard, push: Push) -> None:
        self._ready(sh, push)
        add_to_aggregate(sh, push, self.divisor)
        self.owner.release(push)

    # -- calls from other threads (run in this thread through Call) ---------------------------------
    def loaded(self, bucket: int) -> None:
        """The shard's values were loaded (this thread, between pushes): the owner's replies forget what
        each worker holds of it (Note [Compressed replies on the point-to-point path])."""
        self.owner.replies.forget(bucket)

    def call(self, fn: Any) -> Result:
        """Queue ``fn(self)`` to run in this thread; returns its Result."""
        res = Result()
        self.q.put(Call(fn, res))
        return res
