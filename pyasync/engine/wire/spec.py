"""What this rank expects in messages (WireSpec): checks every header field against its own layout and the
agreed codec, before the payload is looked at. Every error names the sender and the field."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pyasync.engine.wire.header import CONTROL_KINDS, HEADER_BYTES, KIND_NAMES, PUSH, REPLY, Header
from pyasync.engine.wire.layout import coded_reply_parts, push_parts, reply_parts
from pyasync.errors import WireError
from pyasync.ops._common import CODEC_IDS, CODEC_NAMES

__all__ = ["WireSpec"]


class WireSpec:
    """What this rank expects in messages: the bucket/shard sizes and the agreed codec.

    shard_numels[b][r]: elements of shard r of bucket b; mask_lens[b][r]: parameters overlapping it;
    codec: the agreed codec name; block: the agreed block (int8/sign); topk_k: n -> k (top-k)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        shard_numels: Sequence[Sequence[int]],
        mask_lens: Sequence[Sequence[int]],
        codec: str,
        block: int,
        topk_k: Callable[[int], int] | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.shard_numels = [list(x) for x in shard_numels]
        self.mask_lens = [list(x) for x in mask_lens]
        self.codec = codec
        self.codec_id = CODEC_IDS[codec]
        self.block = block if codec in ("int8", "sign") else 0
        self.topk_k = topk_k

    @classmethod
    def for_compressor(
        cls,
        compressor,
        rank: int,
        world_size: int,
        shard_numels: Sequence[Sequence[int]],
        mask_lens: Sequence[Sequence[int]],
    ) -> WireSpec:
        """The spec of a job whose pushes ``compressor`` encodes (it states its own wire parameters)."""
        codec, block, _ = compressor.wire_params(1)
        return cls(
            rank,
            world_size,
            shard_numels,
            mask_lens,
            codec,
            block,
            topk_k=lambda n: compressor.wire_params(n)[2],
        )

    def push_bytes(self, bucket: int, shard: int) -> int:
        """Payload bytes of a push to shard ``shard`` of ``bucket`` under the agreed codec."""
        n = self.shard_numels[bucket][shard]
        k = self.topk_k(n) if self.codec == "topk" and n > 0 else 0
        return push_parts(self.codec, n, self.block, k, self.mask_lens[bucket][shard])[1]

    def max_push_frame(self) -> int:
        """Bytes of the largest frame a worker may send this rank (a PUSH to one of its non-empty
        shards, or a CLOSE): the size of the owner's receive buffer."""
        sizes = [
            self.push_bytes(b, self.rank) for b, row in enumerate(self.shard_numels) if row[self.rank] > 0
        ]
        return HEADER_BYTES + max(sizes, default=0)

    def coded_reply_bytes(self, n: int) -> int:
        """Payload bytes of a coded reply (the agreed lossy codec) for a shard of n elements."""
        k = self.topk_k(n) if self.codec == "topk" and n > 0 else 0
        return coded_reply_parts(self.codec, n, self.block, k, self.world_size)[1]

    def max_reply_frame(self) -> int:
        """Bytes of the largest frame an owner may send this rank (a REPLY for a non-empty shard of
        another rank, exact or coded): the size of the worker's receive buffer."""
        sizes = [
            max(reply_parts(n, self.world_size)[1], self.coded_reply_bytes(n) if self.codec_id else 0)
            for row in self.shard_numels
            for r, n in enumerate(row)
            if n > 0 and r != self.rank
        ]
        return HEADER_BYTES + max(sizes, default=0)

    def _bucket(self, h: Header, what: str) -> None:
        if not 0 <= h.bucket < len(self.shard_numels):
            raise WireError(
                f"{what} from rank {h.sender} names bucket {h.bucket}, but there are "
                f"{len(self.shard_numels)} buckets"
            )
        if not 0 <= h.shard < self.world_size:
            raise WireError(f"{what} from rank {h.sender} names shard {h.shard} of {self.world_size}")
        n = self.shard_numels[h.bucket][h.shard]
        if h.numel != n:
            raise WireError(
                f"{what} from rank {h.sender} for bucket {h.bucket} shard {h.shard} has numel "
                f"{h.numel}, expected {n}"
            )

    def check_push(self, h: Header, shard: int | None = None, final_ok: bool = False) -> None:
        """Validate a PUSH header addressed to this rank (before receiving its payload); or, given
        ``shard``, a push-layout frame of that shard's values (BSP's compressed replies). ``final_ok``:
        a FINAL push is a closed rank joining a BSP step on collectives with nothing to push."""
        if h.kind != PUSH:
            raise WireError(f"expected a PUSH from rank {h.sender}, got {KIND_NAMES[h.kind]}")
        if shard is None and h.shard != self.rank:
            raise WireError(f"PUSH from rank {h.sender} is for shard {h.shard}, but this is rank {self.rank}")
        if shard is not None and h.shard != shard:
            raise WireError(f"values from rank {h.sender} are for shard {h.shard}, expected shard {shard}")
        self._bucket(h, "PUSH")
        if h.clock < 0 or h.version < 0:
            raise WireError(
                f"PUSH from rank {h.sender} has a negative clock/version ({h.clock}, {h.version})"
            )
        if h.codec != self.codec_id:
            got = CODEC_NAMES.get(h.codec, f"id {h.codec}")
            raise WireError(f"PUSH from rank {h.sender} uses codec {got}, the agreed codec is {self.codec}")
        want_block = self.block
        if h.block != want_block:
            raise WireError(f"PUSH from rank {h.sender} has block {h.block}, expected {want_block}")
        want_k = self.topk_k(h.numel) if self.codec == "topk" else 0
        if h.k != want_k:
            raise WireError(f"PUSH from rank {h.sender} has k={h.k}, expected {want_k}")
        want_mask = self.mask_lens[h.bucket][h.shard]
        if h.count != want_mask:
            raise WireError(f"PUSH from rank {h.sender} has {h.count} mask entries, expected {want_mask}")
        if h.final and not final_ok:
            raise WireError(f"PUSH from rank {h.sender} carries the FINAL flag")
        _, total = push_parts(self.codec, h.numel, h.block, h.k, h.count)
        if h.nbytes != total:
            raise WireError(f"PUSH from rank {h.sender} announces {h.nbytes} payload bytes, expected {total}")

    def check_reply(self, h: Header) -> None:
        """Validate a REPLY header addressed to this rank."""
        if h.kind != REPLY:
            raise WireError(f"expected a REPLY from rank {h.sender}, got {KIND_NAMES[h.kind]}")
        if h.shard != h.sender:
            raise WireError(f"REPLY from rank {h.sender} carries shard {h.shard}, which it does not own")
        self._bucket(h, "REPLY")
        if h.count != self.world_size:
            raise WireError(f"REPLY from rank {h.sender} has {h.count} clocks, expected {self.world_size}")
        if h.codec != 0 and h.codec == self.codec_id:
            # A coded reply (Note [Compressed replies] in engine/core/replies.py): the agreed codec's
            # block, k.
            want_k = self.topk_k(h.numel) if self.codec == "topk" else 0
            if h.block != self.block or h.k != want_k:
                raise WireError(
                    f"REPLY from rank {h.sender} has block/k {h.block}/{h.k}, expected {self.block}/{want_k} "
                    f"(codec {self.codec})"
                )
            total = self.coded_reply_bytes(h.numel)
        elif h.codec != 0 or h.k != 0 or h.block != 0:
            raise WireError(
                f"REPLY from rank {h.sender} has codec/k/block {h.codec}/{h.k}/{h.block}, expected 0/0/0 "
                f"(exact values) or the agreed codec {self.codec}"
            )
        else:
            _, total = reply_parts(h.numel, h.count)
        if h.nbytes != total:
            raise WireError(
                f"REPLY from rank {h.sender} announces {h.nbytes} payload bytes, expected {total}"
            )

    def check_close(self, h: Header) -> None:
        """Validate a header-only control frame (CLOSE, PAUSE, RESUME)."""
        if h.kind not in CONTROL_KINDS:
            raise WireError(f"expected CLOSE, PAUSE or RESUME from rank {h.sender}, got {KIND_NAMES[h.kind]}")
        if h.nbytes != 0 or h.clock < 0:
            raise WireError(
                f"{KIND_NAMES[h.kind]} from rank {h.sender} has nbytes={h.nbytes}, clock={h.clock}"
            )
