"""The asynchronous engine: buckets, shards, wire format, worker and owner threads.

See docs/architecture.md. The public face is :class:`pyasync.DistributedOptimizer`.
"""

from pyasync.engine.core.buckets import compute_bucket_assignment_by_size
from pyasync.engine.core.shards import build_layout, shard_bounds
from pyasync.engine.core.stats import Stats

__all__ = ["Stats", "build_layout", "compute_bucket_assignment_by_size", "shard_bounds"]
