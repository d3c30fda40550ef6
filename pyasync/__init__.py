"""pyasync: asynchronous data-parallel training for PyTorch.

    opt = pyasync.DistributedOptimizer(torch.optim.AdamW(model.parameters()), policy=pyasync.SSP(2),
                                       compression=pyasync.compression.Int8())

Importing pyasync never fails because the compiled core is missing; the first kernel call raises one
actionable error instead (see pyasync._ext).
"""

__version__ = "0.1.0"

from pyasync import compression
from pyasync.checkpoint import CheckpointChanged, CheckpointError, load_checkpoint, save_checkpoint
from pyasync.engine.core.stats import Stats
from pyasync.errors import DivergedError, NonFiniteGradientError, PeerFailure
from pyasync.optim import DelayedNesterov
from pyasync.optimizer import DistributedOptimizer
from pyasync.policy import ASP, BSP, SSP, Local, Policy, Quorum, parse_policy

__all__ = [
    "ASP",
    "BSP",
    "SSP",
    "CheckpointChanged",
    "CheckpointError",
    "DelayedNesterov",
    "DistributedOptimizer",
    "DivergedError",
    "Local",
    "NonFiniteGradientError",
    "PeerFailure",
    "Policy",
    "Quorum",
    "Stats",
    "compression",
    "load_checkpoint",
    "parse_policy",
    "save_checkpoint",
]
