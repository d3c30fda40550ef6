"""The demo: DDP against pyasync's policies with one slow worker (``python -m pyasync.demo``).

One small, real workload (an MLP on scikit-learn's ``load_digits``) trained data-parallel under either
``torch.nn.parallel.DistributedDataParallel`` or :class:`pyasync.DistributedOptimizer`, with the same
data, model, seed, straggler and measurements for every system, so the systems are compared on equal
terms. ``python -m pyasync.demo`` drives it with local processes (:func:`run_local`),
``examples/train_digits.py`` under ``torchrun`` (:func:`store_from_env`, :func:`join_run`,
:func:`train_worker`); both only parse options and print. docs/demo.md describes the measurements.

- ``data``: the digits split, shards, batches and the MLP;
- ``config``: the systems (``ddp`` or a pyasync policy, with compression) and :class:`TrainConfig`;
- ``straggler``: the slow rank's injected sleep and the compute time it is measured against;
- ``systems``: DDP with a byte-counting all-reduce, or pyasync's optimizer;
- ``train``: joining a run, the set-up and the timed loop of one rank;
- ``record``: the record rank 0 makes of a run;
- ``local``: spawned local runs with progress, timeouts and worker-failure reporting;
- ``report``: staleness percentiles, the table and the plot;
- ``cli``: the command line.

The end-to-end benchmark (``bench/e2e.py``) builds on these pieces; nothing here depends on it.
"""

from pyasync.demo.cli import main
from pyasync.demo.config import SystemSpec, TrainConfig, parse_system, parse_systems
from pyasync.demo.data import (
    Digits,
    accuracy,
    batches,
    load_digits_split,
    make_model,
    shard_indices,
    steps_per_epoch,
)
from pyasync.demo.local import WorkerError, progress_bar, run_local, start_store_server
from pyasync.demo.report import TABLE_COLUMNS, format_table, histogram_percentile, plot_curves
from pyasync.demo.straggler import measure_compute_s, parse_straggler
from pyasync.demo.train import join_run, store_from_env, train_worker

__all__ = [
    "TABLE_COLUMNS",
    "Digits",
    "SystemSpec",
    "TrainConfig",
    "WorkerError",
    "accuracy",
    "batches",
    "format_table",
    "histogram_percentile",
    "join_run",
    "load_digits_split",
    "main",
    "make_model",
    "measure_compute_s",
    "parse_straggler",
    "parse_system",
    "parse_systems",
    "plot_curves",
    "progress_bar",
    "run_local",
    "shard_indices",
    "start_store_server",
    "steps_per_epoch",
    "store_from_env",
    "train_worker",
]
