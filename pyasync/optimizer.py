"""DistributedOptimizer: the face users touch.

    opt = pyasync.DistributedOptimizer(torch.optim.AdamW(model.parameters()), policy="ssp:2")
    for x, y in loader:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    opt.close()

See docs/architecture.md for the engine behind it.
"""

from __future__ import annotations

import contextlib
import datetime
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from pyasync import compression as _compression
from pyasync import teardown as _teardown  # noqa: F401  (Note [A destroyed group that stays alive])
from pyasync._construct import (
    check_elastic,
    check_elastic_transport,
    check_options,
    describe_group,
    trainable_params,
)
from pyasync.engine import wire
from pyasync.engine.collective.engine import CollectiveEngine
from pyasync.engine.core.buckets import compute_bucket_assignment_by_size
from pyasync.engine.core.rule import UpdateRule
from pyasync.engine.core.shards import build_layout
from pyasync.engine.core.stats import Stats
from pyasync.engine.p2p.engine import Engine
from pyasync.policy import BSP, Policy, parse_policy
from pyasync.session.agree import AgreementError, check_agreement
from pyasync.session.meet import collective_failure, control_group, gave_up, global_ranks, join, settle
from pyasync.session.membership import change_epoch
from pyasync.transport.base import Transport
from pyasync.transport.tcp import TcpTransport

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["DistributedOptimizer"]


def _destroy(group) -> None:
    try:
        dist.destroy_process_group(group)
    except Exception as e:
        warnings.warn(
            f"pyasync: could not destroy the optimizer's gloo group: {e}", RuntimeWarning, stacklevel=3
        )


def _stop_transport(tp, err: BaseException) -> None:
    """A construction that fails: close the transport, telling the peers why and whom it names."""
    if isinstance(tp, Transport):
        tp.abort(f"{type(err).__name__}: {err}", list(getattr(err, "ranks", ()) or ()))


def _tell_peers(process_group, timeout, e: BaseException) -> None:
    """This rank's construction failed before the meeting: tell the other ranks (best effort)."""
    with contextlib.suppress(Exception):
        if (
            isinstance(timeout, datetime.timedelta)
            and dist.is_initialized()
            and dist.get_rank(process_group) >= 0
            and dist.get_world_size(process_group) > 1
        ):
            join(process_group, timeout, "the construction of the DistributedOptimizer", failed=e)


def _abandon(
    engine: Engine,
    control,
    why: str = "it left without close() (its DistributedOptimizer was dropped, or the interpreter exited)",
    owner: weakref.ref | None = None,
) -> None:
    """The optimizer went away (or the interpreter exits) without close(), or its membership change
    failed: stop the engine's threads; then destroy the optimizer's own group ``control`` and drop the
    references to it (the engine's, and ``owner``'s, the optimizer if it is still alive, as at exit), so
    its gloo threads are joined now and not left to the interpreter's teardown (See Note [A destroyed
    group that stays alive] in pyasync/teardown.py)."""
    if not engine.closed:
        engine.closed = True
        engine.capture.remove()
        engine.abort(why)
    if control is None:
        return
    engine.control = None
    opt = owner() if owner is not None else None
    if opt is not None and opt._control is control:
        opt._control = None
    if dist.is_available() and any(g is control for g in dist.distributed_c10d._world.pg_map):
        _destroy(control)


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap a torch optimizer for asynchronous data-parallel training.

    Args:
        optimizer: any torch.optim optimizer (SGD, Adam and AdamW use fused kernels; others run a
            private instance of their class on each owned shard). Its param_groups are shared.
        policy: BSP() (default), SSP(s), ASP(), Quorum(k), or a string "bsp", "asp", "ssp:2",
            "quorum:3" (see pyasync.policy).
        compression: a pyasync.compression Compressor, None (no compression) or a spec string
            ("int8", "topk:0.01", ...).
        bucket_cap_mb: bucket size cap in MiB (2**20 bytes) of parameter data.
        process_group: the ranks that train together (None: the default group; torch.distributed must
            be initialised).
        named_parameters: optional iterable of (name, parameter), for messages and checkpoint keys.
        timeout: the longest any wait (step, close, startup) may take before a clear error.
        num_appliers: applier threads per rank (shards of different buckets are applied in parallel).
        on_nonfinite: what a gradient holding NaN/Inf does. "skip" (default): the push is never
            applied (owners count it in ``stats().nonfinite_skipped``; this rank logs a warning with
            the bucket's parameter names, once). "raise": the same, and then ``step()`` raises
            :class:`pyasync.NonFiniteGradientError` on the rank that computed it (after its step
            completed, so the optimizer stays usable). The check is fused into the encode kernels.
            Under either setting, 20 non-finite steps in a row raise :class:`pyasync.DivergedError`.
        transport: a factory ``transport(group, timeout) -> pyasync.transport.Transport`` that builds
            the point-to-point transport the engine talks over, given a gloo group of the optimizer's
            ranks (None: TCP sockets, pyasync.transport.tcp; ``pyasync.transport.gloo.GlooTransport`` is
            the other one). Benchmarks use it to put an emulated link in front.
        max_grad_norm: clip gradients to this total norm inside the engine (None: no clipping). Under
            BSP the mean gradient of every step is clipped, as DDP followed by
            ``torch.nn.utils.clip_grad_norm_`` does (so BSP still equals DDP); under SSP, ASP and Quorum
            each worker's push is clipped to it. ``stats().grad_norm`` is the norm before clipping.
        grad_edits: "detect" (default): the gradient pushed for a step is exactly what ``.grad`` holds
            when ``step()`` is called; buckets are encoded while backward runs and sent by ``step()``,
            and a bucket edited in between is encoded again there (see docs/reliability.md). Under BSP
            on collectives each bucket's reduce is launched while backward runs, and a bucket edited
            after it on any rank is reduced again by every rank. "forbid":
            buckets are sent while backward runs (more overlap on models of many buckets); an edit
            after backward() makes step() raise (the step is lost), as does a GradScaler.

        elastic: survive a dead worker (SSP, ASP, Quorum, ``bsp:p2p``; SGD, Adam, AdamW): the survivors
            move to a new membership epoch without it and keep training (pyasync/session/membership.py, Note
            [Membership epochs]); ``stats().epochs`` reports every change. Needs a store that outlives
            the workers (torchrun's agent hosts it).

    Works with ``torch.amp.GradScaler``: ``scaler.step(opt)`` always reaches ``step()``, which divides
    the scale out while encoding and, on a step where this rank found an inf or NaN, pushes nothing that
    any owner applies (so a synchronous round never waits for a rank that skipped). Every wait is
    bounded by ``timeout``; a rank that dies makes every other rank raise
    :class:`pyasync.PeerFailure` naming it.
    """

    #: GradScaler calls step() on every step and sets ``grad_scale`` and ``found_inf`` first.
    _step_supports_amp_scaling = True

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        policy: Policy | str | None = None,
        compression: Any = None,
        bucket_cap_mb: float = 25,
        process_group: dist.ProcessGroup | None = None,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
        timeout: datetime.timedelta = datetime.timedelta(seconds=60),
        num_appliers: int = 2,
        on_nonfinite: str = "skip",
        transport: Callable[[dist.ProcessGroup | None, datetime.timedelta], Transport] | None = None,
        max_grad_norm: float | None = None,
        grad_edits: str = "detect",
        elastic: bool = False,
    ) -> None:
        # Everything checked locally first. A rank whose checks fail still tells the others (at the
        # meeting: they raise a PeerFailure naming it at once, and the meetings stay numbered alike).
        try:
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
            if isinstance(optimizer, DistributedOptimizer):
                raise TypeError(
                    "optimizer is already a DistributedOptimizer; wrap the plain torch optimizer once"
                )
            other = getattr(optimizer, "_pyasync_wrapper", lambda: None)()
            if other is not None and not other.closed:
                raise TypeError(
                    f"this {type(optimizer).__name__} is already wrapped by an open DistributedOptimizer "
                    f"({other!r}); "
                    "wrap a torch optimizer once (or close() the first wrapper before wrapping it again)"
                )
            self._policy = parse_policy(policy)
            self._comp = _compression.from_spec(compression)
            check_options(
                bucket_cap_mb, timeout, num_appliers, on_nonfinite, transport, process_group, max_grad_norm
            )
            self._max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
            if grad_edits not in ("detect", "forbid"):
                raise ValueError(f"grad_edits must be 'detect' or 'forbid', got {grad_edits!r}")
            self._grad_edits = grad_edits
            if grad_edits == "forbid" and max_grad_norm is not None and not self._policy.clips_mean:
                raise ValueError(
                    f"max_grad_norm under {self._policy.spec()} clips each push before it is sent, which "
                    "grad_edits='forbid' (send while backward runs) cannot do; use grad_edits='detect'"
                )
            self._elastic = check_elastic(elastic, self._policy, max_grad_norm, optimizer, transport)
            self._epoch, self._clock0, self._epochs = 0, 0, []  # membership epochs (session/membership.py)
            self._epoch_failure: BaseException | None = None  # a membership change that failed (raised)
            self._last_checkpoint: tuple[str, int] | None = None  # (directory, epoch) of the last save
            self._group = process_group
            self._rank = dist.get_rank(process_group)
            if self._rank < 0:
                raise ValueError("this rank is not a member of process_group")
            self._world = dist.get_world_size(process_group)
            self._globals = global_ranks(process_group)
            self._policy.validate(self._world)
            self._timeout = timeout

            # Shared with the wrapped optimizer (lr schedulers work on either).
            self.optimizer = optimizer
            self.defaults = optimizer.defaults
            self.param_groups = optimizer.param_groups
            self.state = optimizer.state
            self._optimizer_step_pre_hooks: dict = OrderedDict()
            self._optimizer_step_post_hooks: dict = OrderedDict()
            self._optimizer_state_dict_pre_hooks: dict = OrderedDict()
            self._optimizer_state_dict_post_hooks: dict = OrderedDict()
            self._optimizer_load_state_dict_pre_hooks: dict = OrderedDict()
            self._optimizer_load_state_dict_post_hooks: dict = OrderedDict()
            self._engine: Engine | CollectiveEngine | None = None

            self._params, groups, self._names = trainable_params(self.param_groups, named_parameters)
            cap = max(1, int(bucket_cap_mb * (1 << 20)))
            assign = compute_bucket_assignment_by_size(
                [p.numel() * p.element_size() for p in self._params],
                [str(p.dtype) for p in self._params],
                [str(p.device) for p in self._params],
                cap,
            )
            self._assign, self._groups = assign, groups
            self._layouts = self._build_layouts(self._world)
            self._rule = UpdateRule(optimizer)

            if max_grad_norm is not None and self._policy.clips_mean and self._world > 1:
                empty = [
                    r for r in range(self._world) if not any(lay.shards[r].numel for lay in self._layouts)
                ]
                if empty:
                    raise ValueError(
                        f"max_grad_norm under {self._policy.spec()} needs every rank to own part of the "
                        "parameters, "
                        f"but ranks {empty} own none (the model has fewer elements per bucket than ranks)"
                    )
        except Exception as e:
            _tell_peers(process_group, timeout, e)
            raise

        # Meet (bounded, naming who is missing), then the optimizer's own group, transport, agreement and
        # rank 0's values: collectives in the training thread, before any engine thread starts. Then
        # every rank meets once more, failed or not (Note [Failing together at construction]).
        self._control = None
        tp = None
        if self._world > 1:
            what = "the construction of the DistributedOptimizer"
            keys = join(process_group, timeout, what)
            self._job = (keys[0].rsplit("/", 1)[0] if keys else "pyasync/job").replace(
                "join", "membership", 1
            )
            failed: BaseException | None = None
            try:
                try:
                    self._control = control_group(process_group, timeout)
                except Exception as e:  # the others may have given up just as this rank met them
                    raise (gave_up(keys, what) or e) from e
                tp = (transport or TcpTransport)(self._control, timeout)
                if not isinstance(tp, Transport):
                    raise TypeError(f"the transport factory returned a {type(tp).__name__}, not a Transport")
                if self._elastic:
                    check_elastic_transport(tp)
                check_agreement(self._agreement_items(groups), self._control)
                self._broadcast_initial()
            except AgreementError as e:
                failed = e
            except Exception as e:
                failed = collective_failure(e, tp if isinstance(tp, Transport) else None, what, wait=1.0)
                if failed is not e and failed.__cause__ is None:
                    failed.__cause__ = e
            except BaseException as e:  # KeyboardInterrupt: tell the others, then stop
                failed = e
            if failed is not None:  # stop first: a peer blocked in a collective with this rank fails now
                if self._control is not None:
                    _destroy(self._control)
                    self._control = None
                if getattr(failed, "ranks", None):  # peers hear whom this rank stopped for (not for itself)
                    _stop_transport(tp, failed)
            err = settle(process_group, timeout, what, tp if failed is None else None, failed)
            if err is not None:
                _stop_transport(tp, err)
                if self._control is not None:
                    _destroy(self._control)
                    self._control = None
                if err is failed:
                    raise err
                raise err from (failed or err.__cause__)

        self._engine_args = dict(on_nonfinite=on_nonfinite, num_appliers=num_appliers, factory=transport)
        self._make_engine(tp)
        optimizer._pyasync_wrapper = weakref.ref(self)

    def _make_engine(self, tp: Transport | None) -> None:
        """The engine of this rank for the current group, layouts and policy (at construction, and at
        every membership epoch)."""
        a = self._engine_args
        spec = wire.WireSpec.for_compressor(
            self._comp,
            self._rank,
            self._world,
            shard_numels=[[s.numel for s in lay.shards] for lay in self._layouts],
            mask_lens=[[len(s.segments) for s in lay.shards] for lay in self._layouts],
        )
        common = dict(
            params=self._params,
            layouts=self._layouts,
            policy=self._policy,
            compressor=self._comp,
            rule=self._rule,
            transport=tp,
            rank=self._rank,
            world_size=self._world,
            timeout=self._timeout,
            spec=spec,
            names=self._names,
            on_nonfinite=a["on_nonfinite"],
            max_grad_norm=self._max_grad_norm,
            control=self._control,
            grad_edits=self._grad_edits,
        )
        if isinstance(self._policy, BSP) and not self._policy.p2p:
            self._engine = CollectiveEngine(**common)  # Note [BSP on collectives]
        else:
            self._engine = Engine(**common, num_appliers=a["num_appliers"], elastic=self._elastic)
        # A rank that exits without close(): stop the threads, so peers see it leave (a PeerFailure
        # there) and the interpreter's exit never meets a thread inside a socket call.
        self._finalizer = weakref.finalize(
            self, _abandon, self._engine, self._control, owner=weakref.ref(self)
        )

    def _build_layouts(self, world: int):
        return build_layout(self._assign, [p.numel() for p in self._params], self._groups, world)

    def _start_epoch(
        self, group, members: list[int], layouts, policy: Policy, epoch: int, clock: int
    ) -> None:
        """Membership epoch ``epoch`` (session/membership.py): this rank's new group, layouts, policy and
        engine; the old engine has stopped."""
        self._finalizer.detach()
        old_control = self._control
        self._group = group
        self._globals = list(members)
        self._rank = members.index(dist.get_rank())
        self._world = len(members)
        self._layouts, self._policy = layouts, policy
        self._epoch = epoch
        self._clock0 += clock
        self._control = group if self._world > 1 else None
        tp = (self._engine_args["factory"] or TcpTransport)(group, self._timeout) if self._world > 1 else None
        self._make_engine(tp)
        if old_control is not None:
            _destroy(old_control)

    def _agreement_items(self, groups: list[int]) -> dict[str, list[str]]:
        """What every rank must describe identically (see engine/agree.py). The requires_grad flags come
        first: a parameter frozen on one rank only would otherwise show as a shape difference (the
        trainable lists shift)."""
        return {
            "requires_grad flags": [
                f"param_groups[{gi}][{j}] shape={tuple(p.shape)} requires_grad={p.requires_grad}"
                for gi, g in enumerate(self.param_groups)
                for j, p in enumerate(g["params"])
            ],
            "parameters": [
                f"{i} {self._names[i]} shape={tuple(p.shape)} dtype={p.dtype} group={groups[i]}"
                for i, p in enumerate(self._params)
            ],
            "policy": [self._policy.spec()],
            "compression": [self._comp.spec()],
            "optimizer": self._rule.describe(),
            "bucket layout": [lay.describe() for lay in self._layouts],
            "device type": [self._params[0].device.type],
            "hyperparameters": [describe_group(i, g) for i, g in enumerate(self.param_groups)],
            "max_grad_norm": [repr(self._max_grad_norm)],
            "grad_edits": [self._grad_edits],
            "elastic": [repr(self._elastic)],
        }

    @torch.no_grad()
    def _broadcast_initial(self) -> None:
        """Same starting point everywhere (as DDP): rank 0's parameters, bucket by bucket."""
        src = dist.get_global_rank(self._group, 0) if self._group is not None else 0
        for lay in self._layouts:
            ps = [self._params[p] for p in lay.params]
            flat = torch.cat([p.detach().reshape(-1) for p in ps])
            host = flat.cpu()  # gloo: host memory (a no-op copy on the CPU)
            dist.broadcast(host, src=src, group=self._control)
            flat.copy_(host)
            for p, o, n in zip(ps, lay.offsets, lay.numels):
                p.copy_(flat[o : o + n].view_as(p))

    # -- torch.optim.Optimizer interface ---------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Push this step's gradients, wait as the policy says (at most ``timeout``), install fresh
        parameters. Returns the closure's loss when a closure is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for hook in list(self._optimizer_step_pre_hooks.values()):
            hook(self, (), {})
        # Set by torch.amp.GradScaler.step (see _step_supports_amp_scaling): the scale the gradients still
        # carry (None once unscale_ ran) and whether this rank found an inf or NaN.
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        self._follow_membership()
        self.engine.step(
            grad_scale=None if grad_scale is None else float(grad_scale),
            found_inf=found_inf is not None and float(found_inf) > 0,
        )
        self._follow_membership()
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, (), {})
        return loss

    def _follow_membership(self) -> None:
        """Elastic: ranks left; the survivors move to the next membership epoch (session/membership.py)."""
        while self._engine is not None and getattr(self._engine, "lost", None) and not self._engine.closed:
            self._next_epoch()

    def _next_epoch(self) -> None:
        """One membership change. One that fails (this rank was dropped, the store or a member is gone)
        is final: it raised to the caller, the old engine is stopped, and close() stops what is left
        without starting another change (which would read the stopped engine's shards)."""
        if self._epoch_failure is not None:
            raise self._epoch_failure
        try:
            self._epochs.append(change_epoch(self))
        except BaseException as e:
            self._epoch_failure = e
            _abandon(self._engine, None, f"its membership change failed ({type(e).__name__}: {e})")
            raise

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        raise RuntimeError(
            "pyasync fixes the parameters when the DistributedOptimizer is created; add the "
            "param group to the torch optimizer before wrapping it"
        )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients over several backward() calls without pushing; the buckets are pushed by
        the next backward outside the context or by step()."""
        with self.engine.no_sync():
            yield

    # -- pyasync ------------------------------------------------------------------------------------
    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def compressor(self):
        return self._comp

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def bucket_layouts(self):
        """Bucket and shard layouts (engine.shards.BucketLayout), for inspection."""
        return self._layouts

    def barrier(self) -> None:
        """A barrier of the optimizer's ranks that is safe under every policy: call it (on every rank,
        between steps) instead of ``torch.distributed.barrier()`` where ranks wait for each other in
        the middle of training, e.g. around evaluation.

        Note [Barriers and quorums]
            Under Quorum(k < n) a plain barrier can leave a slow rank waiting (until the timeout): a
            late push of it is answered with the newest version, its next push then opens a round of
            that version that needs k pushes, and the other ranks, already in the barrier, push
            nothing. So each rank first tells every owner it is paused (a PAUSE message after its last
            push); an owner's aggregate rounds then stop waiting for paused ranks, as for closed ones,
            and the stranded round is applied with the pushes that are in. Then the ranks meet
            (``monitored_barrier`` on the optimizer's own group: a rank that does not arrive within
            the timeout is named; a dead one raises PeerFailure), send
            RESUME, wait until their own owner has processed every rank's RESUME, and meet again, so
            no push of the next step reaches an owner that still counts its sender as paused. Under
            BSP no round can be open at a barrier (a step returns only when every rank's push of that
            clock is applied), and SSP/ASP do not aggregate, so there it is a plain barrier plus a
            few messages. save_checkpoint does the same.
        """
        eng = self.engine
        eng.pause()
        try:
            self._meet("barrier()")
        finally:
            eng.resume()
        self._meet("barrier()")
        eng.check()

    def _meet(self, what: str) -> None:
        """A barrier of the optimizer's ranks on its own group, bounded by the timeout; a peer that died
        is named (PeerFailure)."""
        if self._world == 1:
            return
        try:
            dist.monitored_barrier(group=self._control, timeout=self._timeout, wait_all_ranks=True)
        except Exception as e:
            err = collective_failure(e, self.engine.transport, what)
            self.engine._sticky(err)
            raise err from e

    def stats(self) -> Stats:
        """This rank's counters (see pyasync.Stats); the current membership epoch's, with the clock
        counted from the start and every membership change (``epochs``)."""
        st = self.engine.stats()
        st.clock += self._clock0
        st.epoch = self._epoch
        st.members = list(self._globals)
        st.epochs = [c.as_dict() for c in self._epochs]
        st.pushes_lost = sum(c.pushes_lost for c in self._epochs)
        st.pushes_resent = sum(c.pushes_resent for c in self._epochs)
        return st

    def close(self) -> None:
        """Drain, keep serving slower ranks until every rank has closed, apply every outstanding push,
        install the final parameters (equal on every rank) and stop the threads. Idempotent."""
        if self._engine is None:
            return
        try:
            if self._epoch_failure is not None:  # step() raised it already; what is left was stopped
                return
            self._follow_membership()
            self._engine.close()
            while getattr(self._engine, "drained", False):  # a rank left during close(): change epoch
                self._next_epoch()
                self._engine.close()
        finally:
            if self._engine.closed and self._control is not None:
                self._finalizer.detach()
                control, self._control = self._control, None
                self._engine.control = None  # no reference may keep the group's threads and sockets alive
                _destroy(control)

    @property
    def closed(self) -> bool:
        return self._engine is None or self._engine.closed

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        # Already failing: still try to finish together, but never hide the original error.
        try:
            self.close()
        except Exception as e:
            warnings.warn(
                f"pyasync: close() after {exc_type.__name__} failed too: {e}", RuntimeWarning, stacklevel=2
            )

    @property
    def engine(self) -> Engine | CollectiveEngine:
        """The engine behind this optimizer (pyasync/engine/p2p/engine.py): its narrow API (``snapshot``,
        ``load``, ``drain``, ``pause``/``resume``, ``clock``) is what pyasync.checkpoint uses."""
        if self._engine is None:
            raise RuntimeError("the DistributedOptimizer was not fully constructed")
        return self._engine

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The process group the optimizer trains over (None: the default group)."""
        return self._group

    @property
    def collective_group(self) -> dist.ProcessGroup | None:
        """The optimizer's own gloo group of the same ranks (None with one rank): its collectives
        (barrier, checkpoints, BSP's clipping) run there, bounded by ``timeout``, never mixing with the
        user's."""
        return self._control

    @property
    def timeout(self) -> datetime.timedelta:
        """The longest any wait of the optimizer may take."""
        return self._timeout

    @property
    def named_params(self) -> list[tuple[str, torch.Tensor]]:
        """(name, parameter) of the trained parameters, each once, in the engine's order."""
        return list(zip(self._names, self._params))

    def describe(self) -> dict[str, Any]:
        """What must match between a saving and a loading optimizer (JSON-able): parameters, buckets
        (with their shard bounds) and the update rule."""
        return {
            "parameters": [
                {"name": n, "shape": list(p.shape), "dtype": str(p.dtype).replace("torch.", "")}
                for n, p in self.named_params
            ],
            "buckets": [
                {
                    "params": list(lay.params),
                    "numel": lay.numel,
                    "shard_bounds": [s.begin for s in lay.shards] + [lay.numel],
                }
                for lay in self._layouts
            ],
            "optimizer": list(self._rule.describe()),
        }

    @property
    def fused_rule(self) -> bool:
        """True when the owners apply SGD / Adam / AdamW with the fused kernels (re-shardable state)."""
        return self._rule.fused

    # -- state ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's shard: master values, optimizer state, residuals and clocks (tensors only, plus
        plain numbers and strings), for pyasync's checkpoints. Call between steps."""
        eng = self.engine
        shards = eng.shards.snapshot()
        return {
            "format": 1,
            "rank": self._rank,
            "world_size": self._world,
            "policy": self._policy.spec(),
            "compression": self._comp.spec(),
            "clock": torch.tensor(eng.clock, dtype=torch.int64),
            "shards": {str(b): v for b, v in sorted(shards.items())},
            "residuals": self._comp.state_dict(),
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what state_dict() of the same rank returned (same world size, model and layout)."""
        eng = self.engine
        if not isinstance(state_dict, dict) or "shards" not in state_dict:
            raise TypeError("state_dict must be a dict returned by DistributedOptimizer.state_dict()")
        if state_dict.get("world_size") != self._world or state_dict.get("rank") != self._rank:
            raise ValueError(
                f"state_dict is for rank {state_dict.get('rank')} of {state_dict.get('world_size')}, "
                f"this is rank {self._rank} of {self._world}"
            )
        shards = state_dict["shards"]
        owned = {str(b) for b, lay in enumerate(self._layouts) if lay.shards[self._rank].numel > 0}
        if set(shards) != owned:
            raise ValueError(
                f"state_dict holds shards of buckets {sorted(shards)}, this rank owns {sorted(owned)}"
            )

        eng.shards.load({int(b): d for b, d in shards.items()})
        if "residuals" in state_dict:
            self._comp.load_state_dict(state_dict["residuals"])
        for g, saved in zip(self.param_groups, state_dict.get("param_groups", [])):
            for k, v in saved.items():
                g[k] = v

    def __repr__(self) -> str:
        return (
            f"DistributedOptimizer({type(self.optimizer).__name__}, policy={self._policy.spec()!r}, "
            f"compression={self._comp.spec()!r}, rank={self._rank}/{self._world})"
        )
