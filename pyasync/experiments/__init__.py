"""Shared harness of the demo, the torchrun example and end-to-end benchmarks.

One small, real workload (an MLP on scikit-learn's ``load_digits``) trained data-parallel under either
``torch.nn.parallel.DistributedDataParallel`` or :class:`pyasync.DistributedOptimizer`, with the same
data, model, seed, straggler and measurements for every system, so the systems are compared on equal
terms. ``python -m pyasync.demo`` drives it with local processes (:func:`run_local`),
``examples/train_digits.py`` under ``torchrun`` (:func:`store_from_env`, :func:`join_run`,
:func:`train_worker`); both only parse options and print. docs/demo.md describes the measurements.

- ``workload``: systems and options, the data sets and models, the injected slowdowns;
- ``train``: the training loop and the per-run record;
- ``ddp``: DDP's communication hook (all-reduce, fp16, PowerSGD) with byte counts and link emulation;
- ``local``: spawned local runs with progress, timeouts and worker-failure reporting;
- ``report``: staleness percentiles, the table and the plots;
- ``e2e``: the end-to-end benchmark's scenarios, time to target and summary (``bench/e2e.py``).
"""

from pyasync.experiments.local import WorkerError, calibrate_local, run_local, start_store_server
from pyasync.experiments.report import (
    TABLE_COLUMNS,
    format_table,
    histogram_percentile,
    plot_curves,
    plot_e2e,
)
from pyasync.experiments.train import calibrate_worker, join_run, store_from_env, train_worker
from pyasync.experiments.workload import (
    MODELS,
    Digits,
    ModelSpec,
    SystemSpec,
    TrainConfig,
    accuracy,
    load_digits_split,
    load_split,
    load_teacher_split,
    make_model,
    measure_compute_s,
    parse_straggler,
    parse_system,
    parse_systems,
    shard_indices,
    steps_per_epoch,
    transient_slow,
)

__all__ = [
    "MODELS",
    "TABLE_COLUMNS",
    "Digits",
    "ModelSpec",
    "SystemSpec",
    "TrainConfig",
    "WorkerError",
    "accuracy",
    "calibrate_local",
    "calibrate_worker",
    "format_table",
    "histogram_percentile",
    "join_run",
    "load_digits_split",
    "load_split",
    "load_teacher_split",
    "make_model",
    "measure_compute_s",
    "parse_straggler",
    "parse_system",
    "parse_systems",
    "plot_curves",
    "plot_e2e",
    "run_local",
    "shard_indices",
    "start_store_server",
    "steps_per_epoch",
    "store_from_env",
    "train_worker",
    "transient_slow",
]
