"""Helpers shared by the checkpoint tests (tests/checkpoint/)."""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import torch

__all__ = ["reseal", "whole"]


def whole(per_rank: list[dict], b: int, name: str) -> torch.Tensor:
    """Bucket ``b``'s "master" values or optimizer state ``name``, concatenated over the ranks' shards
    (``per_rank``: each rank's ``state_dict()["shards"]``)."""
    parts = []
    for shards in per_rank:
        if str(b) in shards:
            sh = shards[str(b)]
            parts.append(sh["master"] if name == "master" else sh["optim"][name])
    return torch.cat(parts)


def reseal(d: str, rank: int, edit) -> None:
    """Let edit(state_dict) change rank ``rank``'s shard file, then fix its size and sha256 in the
    manifest, so that only the structure check can catch it."""
    mpath = os.path.join(d, "manifest.json")
    mm = json.loads(Path(mpath).read_text())
    entry = next(s for s in mm["shards"] if s["rank"] == rank)
    fpath = os.path.join(d, entry["file"])
    sd = torch.load(fpath, weights_only=True)
    edit(sd)
    buf = io.BytesIO()
    torch.save(sd, buf)
    data = buf.getvalue()
    Path(fpath).write_bytes(data)
    entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    Path(mpath).write_text(json.dumps(mm))
