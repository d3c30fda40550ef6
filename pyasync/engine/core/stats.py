"""Stats: what one rank's engine has done so far."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Stats", "collect_stats"]


@dataclass
class Stats:
    """Counters of one rank: its worker side (clock, waits, pushes sent) and the shards it owns
    (applied / dropped / skipped pushes and their staleness).

    clock: completed step() calls of this worker.
    min_included_clock: every worker's pushes up to this clock are in the parameters installed now
        (-1: not yet for every worker).
    staleness: {staleness in versions: count} of the pushes applied to this rank's shards.
    pushes_applied / pushes_dropped / nonfinite_skipped: pushes to this rank's shards (one push = one
        bucket shard of one worker's step) applied, dropped by the policy (Quorum late="drop"), or
        skipped because they held NaN/Inf.
    bytes_sent / bytes_received: bytes this rank put on / took off the network (headers included).
    wait_seconds: seconds step() and close() spent waiting for the policy.
    compression_ratio: fp32 bytes of the pushed gradient slices / encoded bytes (1.0 uncompressed).
    grad_norm: with max_grad_norm, the norm of the last step's gradient before clipping (under BSP the
        mean gradient's, as DDP + clip_grad_norm_; otherwise this worker's push); None without.
    buckets_reencoded: buckets encoded again in step() because their gradients changed after backward
        (or were unscaled or clipped there); see Note [What step() pushes].
        Under BSP on collectives: buckets whose reduce ran again in step() for that reason, on any rank
        (Note [Reduces launched from backward]).
    buckets_early: under BSP on collectives, buckets whose reduce this rank launched from the backward
        hooks (the rest launched in step()).
    patience_expired: under ASP's patience, the steps this worker started without the answers to its
        own last push from an owner that had answered in time before (Note [Patience with one's own
        answers]: a stopped or very slow owner; each costs at most one patience).
    intake_peak: most received pushes this rank's owner held at once (bounded, Note [Bounded intake]).
    epoch / members: the membership epoch and its ranks (global ranks; elastic=True, see
        pyasync/session/membership.py); epochs: every membership change this rank went through (lost ranks,
        members, seconds, pushes re-sent, what was re-initialized); pushes_resent: this worker's pushes
        to owners that died, replayed on the freshest replica (engine/p2p/replay.py); pushes_lost: those
        that could not be (none is expected). The other counters are the current epoch's.
    """

    clock: int = 0
    min_included_clock: int = -1
    staleness: dict[int, int] = field(default_factory=dict)
    pushes_applied: int = 0
    pushes_dropped: int = 0
    nonfinite_skipped: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    wait_seconds: float = 0.0
    compression_ratio: float = 1.0
    pushes_sent: int = 0
    updates_applied: int = 0
    grad_norm: float | None = None
    buckets_reencoded: int = 0
    buckets_early: int = 0
    intake_peak: int = 0
    patience_expired: int = 0
    epoch: int = 0
    members: list[int] = field(default_factory=list)
    epochs: list[dict] = field(default_factory=list)
    pushes_lost: int = 0
    pushes_resent: int = 0


def collect_stats(clock: int, mailbox, owner, pusher, wait_seconds: float, grad_norm: float | None) -> Stats:
    """One rank's Stats from its engine's parts (read without locks: counters only grow)."""
    st = Stats(clock=clock)
    st.min_included_clock = mailbox.min_included_clock(clock)
    for a in owner.appliers:
        st.bytes_sent += a.bytes_sent
        for sh in list(a.shards.values()):
            c = sh.round.c
            st.pushes_applied += c.applied
            st.pushes_dropped += c.dropped
            st.nonfinite_skipped += c.nonfinite
            st.updates_applied += c.updates
            for k, v in list(c.staleness.items()):
                st.staleness[k] = st.staleness.get(k, 0) + v
    st.staleness = dict(sorted(st.staleness.items()))
    st.bytes_sent += pusher.bytes_sent
    st.bytes_received = mailbox.bytes_received + owner.bytes_received
    st.wait_seconds = wait_seconds
    st.compression_ratio = pusher.raw_bytes / pusher.enc_bytes if pusher.enc_bytes else 1.0
    st.pushes_sent = pusher.pushes_sent
    st.grad_norm = grad_norm
    st.buckets_reencoded = pusher.reencoded
    st.intake_peak = owner.intake.peak
    return st
