"""Sharded checkpoints: one file per rank (its shard) plus a JSON manifest that commits them.

    pyasync.save_checkpoint("ckpt/step1000", opt)     # every rank, between steps
    pyasync.load_checkpoint("ckpt/step1000", opt)     # every rank, on a fresh optimizer of the same model

Directory layout (see docs/reliability.md, "Checkpoints"):

    manifest.json                          written last by rank 0; its presence commits the checkpoint
    shard-<save id>-r<rank>-of-<n>.pt      rank r's DistributedOptimizer.state_dict() (torch.save)
    .pyasync-lock                          the writers' lock (flock; holder's pid and host while held)

Modules: common.py (format, errors, atomic writes), lock.py (the directory lock), save.py,
validate.py (reading and checking), reshard.py (another world size), load.py.
"""

from pyasync.checkpoint.common import CheckpointChanged, CheckpointError
from pyasync.checkpoint.load import load_checkpoint
from pyasync.checkpoint.save import save_checkpoint

__all__ = ["CheckpointChanged", "CheckpointError", "load_checkpoint", "save_checkpoint"]
