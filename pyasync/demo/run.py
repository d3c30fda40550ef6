"""What one rank of a demo or benchmark run holds (RankRun) and what its timed loop measured
(LoopResult): shared by pyasync/demo/train.py, which makes them, and pyasync/demo/record.py, which
reports them."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from pyasync.demo.data import Digits

__all__ = ["LoopResult", "RankRun"]


@dataclasses.dataclass
class RankRun:
    """What one rank trains on: its shard, the model and the work budget (see Note [Work budget])."""

    rank: int  # this rank
    world: int  # ranks in the run
    data: Digits  # the whole data set (rank 0 evaluates on its test split)
    x: torch.Tensor  # this rank's shard of the training inputs
    y: torch.Tensor  # and of the labels
    per_pass: int  # steps of a rank per pass over its shard
    budget: int  # gradient steps of the whole cluster
    my_steps: int  # steps of this rank under a synchronous system
    model: nn.Module  # the replica this rank trains



@dataclasses.dataclass
class LoopResult:
    """What :func:`timed_loop` measured on one rank."""

    steps: int  # steps this rank took
    slept_s: float  # seconds this rank slept before its steps (the injected slowdowns, the emulated device)
    wall_s: float  # seconds from the start barrier to the end barrier
    eval_every: int  # rank 0 snapshots its parameters every this many of its steps
    snapshots: list[tuple[float, int, torch.Tensor]]  # rank 0: (seconds, samples claimed, parameters)

