"""A process that trained with pyasync exits cleanly: no gloo group's native threads are left running
when the interpreter tears down (Note [A destroyed group that stays alive]).

Importing this module (``pyasync.optimizer`` does) imports ``torch.distributed.nn.functional`` at once
and registers :func:`release_destroyed_groups` to run at interpreter exit.
"""

from __future__ import annotations

import atexit
import sys
import types
import warnings

import torch.distributed as dist

# Imported for its side effect, before the caller's init_process_group: see the Note below.
import torch.distributed.nn.functional  # noqa: F401

__all__ = ["release_destroyed_groups"]

_FUNCTIONAL = "torch.distributed.nn.functional"


def release_destroyed_groups() -> int:
    """Drop the references ``torch.distributed.nn.functional`` keeps to process groups that were
    destroyed, so each is freed and its gloo threads are joined now. Returns how many functions held
    one. Safe to call any time: a group still registered is never touched.

    Note [A destroyed group that stays alive]
        ``torch.distributed.nn.functional`` writes ``group=group.WORLD`` as the default argument of ten
        functions (broadcast, all_reduce, ...), so the default group that exists when that module is
        first imported stays referenced for the life of the process. torch imports it lazily: the first
        ``torch.optim.Optimizer`` constructed imports ``torch._dynamo`` (``add_param_group`` is wrapped
        in ``_disable_dynamo``), which imports FSDP, ``_shard`` and this module. A script that calls
        ``init_process_group`` and then builds its optimizer (examples/train_digits.py, most scripts)
        therefore pins its default group: ``destroy_process_group()`` unregisters it but cannot free
        it, and its ProcessGroupGloo keeps three native threads (``gloo_tcp_loop`` and two
        ``pt_gloo_runloop``, see /proc/PID/task/*/comm) alive until the interpreter's teardown, which
        then crashes now and then ("terminate called without an active exception", SIGABRT, or
        SIGSEGV, in a thread without Python frames, after the script's last line ran): under torchrun
        one such worker fails the whole job. Measured: 1 of 30 README runs (``--epochs 1``) aborted so.

        Two remedies, both cheap: importing pyasync imports that module first (35 ms), so when pyasync
        is imported before ``init_process_group`` its defaults are ``None`` (the default group, looked
        up at call time: the same meaning) and a destroyed group is freed at once; and, for a script
        that imported it after ``init_process_group`` anyway, this function (run at interpreter exit,
        before the teardown, by the atexit hook below) replaces a default that names a group no longer
        registered with ``None``, which frees that group and joins its threads while the interpreter
        is still whole. A group the script never destroyed is left alone (destroying it is the
        script's call: torch warns about it)."""
    mod = sys.modules.get(_FUNCTIONAL)
    if mod is None or not dist.is_available():
        return 0
    registered = {id(g) for g in dist.distributed_c10d._world.pg_map}

    def stale(v) -> bool:
        return isinstance(v, dist.ProcessGroup) and id(v) not in registered

    n = 0
    for fn in list(vars(mod).values()):
        if not isinstance(fn, types.FunctionType) or not fn.__defaults__:
            continue
        if any(stale(v) for v in fn.__defaults__):
            fn.__defaults__ = tuple(None if stale(v) else v for v in fn.__defaults__)
            n += 1
    return n


def _at_exit() -> None:
    try:
        release_destroyed_groups()
    except Exception as e:  # never fail an exit; say why a crash may follow
        warnings.warn(
            f"pyasync: could not release destroyed process groups at exit ({type(e).__name__}: {e}); "
            "their gloo threads may outlive the interpreter",
            RuntimeWarning,
            stacklevel=1,
        )


atexit.register(_at_exit)
