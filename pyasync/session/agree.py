"""Startup agreement: every rank checks that all ranks describe the same training job.

Each item (parameters, policy, compression, bucket layout, ...) is a list of text lines. Ranks
all-gather one 63-bit digest per item (fixed-size int64 tensors); when an item differs, they
all-gather that item's text as uint8 bytes (lengths first) so that every rank can name the first
differing line and raise the same error. Nothing is pickled.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["AgreementError", "check_agreement", "first_difference"]


class AgreementError(ValueError):
    """The ranks disagree about the model, the policy, the compression or the layout."""


def _digest(lines: Sequence[str]) -> int:
    h = hashlib.sha256("\n".join(lines).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def first_difference(a: Sequence[str], b: Sequence[str]) -> tuple[int, str | None, str | None]:
    """(index, line of a, line of b) of the first differing line; None for a missing line."""
    for i in range(max(len(a), len(b))):
        x = a[i] if i < len(a) else None
        y = b[i] if i < len(b) else None
        if x != y:
            return i, x, y
    return -1, None, None


def _gather_text(text: str, group, world: int) -> list[str]:
    data = torch.tensor(list(text.encode()), dtype=torch.uint8)
    n = torch.tensor([data.numel()], dtype=torch.int64)
    lens = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(lens, n, group=group)
    width = max(int(x.item()) for x in lens)
    padded = torch.zeros(max(width, 1), dtype=torch.uint8)
    padded[: data.numel()] = data
    outs = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(outs, padded, group=group)
    return [bytes(o[: int(lens[r].item())].tolist()).decode(errors="replace") for r, o in enumerate(outs)]


def check_agreement(items: dict[str, list[str]], group=None) -> None:
    """Raise the same AgreementError on every rank of ``group`` unless all ranks passed equal items.

    items: name -> description lines (the same names, in the same order, on every rank)."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    names = list(items)
    mine = torch.tensor([_digest(items[k]) for k in names] + [_digest(names)], dtype=torch.int64)
    all_d = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(all_d, mine, group=group)
    table = torch.stack(all_d)  # [world, items + 1]
    if bool((table == table[0]).all()):
        return
    if not bool((table[:, -1] == table[0, -1]).all()):
        # Different item lists (different pyasync versions): compare the names themselves.
        texts = _gather_text("\n".join(names), group, world)
        r = next(r for r in range(world) if texts[r] != texts[0])
        raise AgreementError(
            f"pyasync: ranks run different agreement checks (rank 0: {texts[0]!r}, "
            f"rank {r}: {texts[r]!r}); run the same pyasync version on every rank"
        )
    col = next(i for i in range(len(names)) if not bool((table[:, i] == table[0, i]).all()))
    name = names[col]
    texts = _gather_text("\n".join(items[name]), group, world)
    r = next(r for r in range(world) if int(table[r, col]) != int(table[0, col]))
    i, a, b = first_difference(texts[0].split("\n"), texts[r].split("\n"))
    raise AgreementError(
        f"pyasync: ranks disagree on the {name}: first difference at entry {i}: rank 0 has "
        f"{a if a is not None else '(nothing)'!r}, rank {r} has {b if b is not None else '(nothing)'!r}. "
        "Every rank must build the same model (same parameters, shapes, dtypes, requires_grad flags, "
        "parameter groups) and pass "
        "the same policy, compression and bucket_cap_mb to DistributedOptimizer."
    )
