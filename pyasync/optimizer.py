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
    assign_buckets,
    check_clipping_owners,
    check_elastic,
    check_grad_edits,
    check_options,
    trainable_params,
)
from pyasync.engine.collective.engine import CollectiveEngine
from pyasync.engine.core.rule import UpdateRule
from pyasync.engine.core.stats import Stats
from pyasync.engine.p2p.engine import Engine
from pyasync.local import LocalSteps, SpeedBoard, outer_optimizer
from pyasync.policy import Local, Policy, parse_policy
from pyasync.session import groups
from pyasync.session.bootstrap import handshake, public_items, tell_peers
from pyasync.session.epoch import Epoch, Setup, abandon, release_control, start_epoch, stop_engine
from pyasync.session.joining import Requests, decide_fate, joining, publish
from pyasync.session.meet import collective_failure, global_ranks, solo_key, store
from pyasync.session.membership import EpochChange, change_epoch, join_epoch
from pyasync.transport.base import Transport

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["DistributedOptimizer"]

#: torch optimizer -> (a weak reference to) the DistributedOptimizer that wraps it: a torch optimizer is
#: wrapped by one open DistributedOptimizer at a time.
_WRAPPERS: weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.ref] = weakref.WeakKeyDictionary()


def _check_wrappable(optimizer: Any) -> None:
    """A torch optimizer that no open DistributedOptimizer wraps, or a clear error."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, DistributedOptimizer):
        raise TypeError("optimizer is already a DistributedOptimizer; wrap the plain torch optimizer once")
    ref = _WRAPPERS.get(optimizer)
    other = ref() if ref is not None else None
    if other is not None and not other.closed:
        raise TypeError(
            f"this {type(optimizer).__name__} is already wrapped by an open DistributedOptimizer "
            f"({other!r}); "
            "wrap a torch optimizer once (or close() the first wrapper before wrapping it again)"
        )


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap a torch optimizer for asynchronous data-parallel training.

    Args:
        optimizer: any torch.optim optimizer (SGD, Adam and AdamW use fused kernels; others run a
            private instance of their class on each owned shard). Its param_groups are shared.
        policy: BSP() (default), SSP(s), ASP(), Quorum(k), Local(H) (local steps, pyasync/local.py), or a
            string "bsp", "asp", "ssp:2", "quorum:3", "local:16", "local:16:async" (see pyasync.policy).
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
        self._epoch: Epoch | None = None  # the current membership epoch (session/epoch.py)
        try:
            _check_wrappable(optimizer)
            policy = parse_policy(policy)
            comp = _compression.from_spec(compression)
            check_options(
                bucket_cap_mb, timeout, num_appliers, on_nonfinite, transport, process_group, max_grad_norm
            )
            clip = None if max_grad_norm is None else float(max_grad_norm)
            # Local steps: the engine runs the outer policy and optimizer (Note [Local steps], local.py)
            local = policy if isinstance(policy, Local) else None
            outer = local.outer(elastic is True) if local else policy
            rule_optimizer = outer_optimizer(local, optimizer.param_groups) if local else optimizer
            engine_clip = None if local else clip
            grad_edits = check_grad_edits(grad_edits, outer, engine_clip)
            elastic = check_elastic(elastic, outer, engine_clip, rule_optimizer, transport)
            self._epochs: list[EpochChange] = []  # every membership change (session/membership.py)
            self._epoch_failure: BaseException | None = None  # a membership change that failed (raised)
            rank = dist.get_rank(process_group)
            if rank < 0:
                raise ValueError("this rank is not a member of process_group")
            world = dist.get_world_size(process_group)
            members = global_ranks(process_group)
            if not (elastic and joining()):  # a joiner's policy is checked against the members it joins
                outer.validate(world)

            # Shared with the wrapped optimizer (lr schedulers work on either).
            self.optimizer = optimizer
            self.defaults = optimizer.defaults
            self.param_groups = optimizer.param_groups
            self.state = optimizer.state
            self._init_hooks()

            params, groups, names = trainable_params(self.param_groups, named_parameters)
            assign = assign_buckets(params, bucket_cap_mb)
            rule = UpdateRule(rule_optimizer)
            rule.bind_worker_momentum(comp)
            rule.bind_gap(bool(getattr(outer, "gap", False)))  # Note [Gap-aware penalty]
            self._setup = Setup(
                params=params,
                names=names,
                groups=groups,
                assign=assign,
                param_groups=self.param_groups,
                rule=rule,
                compressor=comp,
                timeout=timeout,
                factory=transport,
                on_nonfinite=on_nonfinite,
                num_appliers=num_appliers,
                max_grad_norm=engine_clip,
                grad_edits=grad_edits,
                elastic=elastic,
                policy=outer,
            )
            layouts = self._setup.layouts(world)
            check_clipping_owners(engine_clip, outer, world, layouts)
        except Exception as e:
            tell_peers(process_group, timeout, e)
            raise

        # Meet the other ranks, then the optimizer's own group, transport, agreement and rank 0's values
        # (session/bootstrap.py; Note [Failing together at construction]); then epoch 0's engine. A worker
        # started to join a running elastic job is admitted by its members instead (session/joining.py).
        self._requests: Requests | None = None  # elastic: the join requests the members look for
        if elastic and joining():
            self._epoch = self._join(policy)
        else:
            self._epoch = self._first_epoch(process_group, policy, outer, members, rank, layouts)
        self._guard()
        #: Local steps' worker side (pyasync/local.py), None under every other policy.
        self.local_steps = LocalSteps(local, self._setup.params, clip, self._board(local)) if local else None
        self._unhook()
        _WRAPPERS[optimizer] = weakref.ref(self)

    def _first_epoch(self, process_group, policy: Policy, outer: Policy, members, rank, layouts) -> Epoch:
        """Epoch 0 over ``process_group``: the handshake with more than one rank, then the engine; an elastic
        job is then open to joiners."""
        control, tp, key = None, None, ""
        world = len(members)
        if world > 1:
            control, tp, key = handshake(self._setup, process_group, policy, layouts)
        elif self._setup.elastic:
            key = solo_key()  # one worker: others may still join it
        epoch = start_epoch(
            self._setup,
            number=0,
            group=process_group,
            control=control,
            members=members,
            rank=rank,
            layouts=layouts,
            policy=outer,
            clock0=0,
            key=key,
            transport=tp,
        )
        self._epoch = epoch
        if self._setup.elastic:
            self._open_to_joiners(policy, members, rank)
        return epoch

    def _join(self, policy: Policy) -> Epoch:
        """This process joins the running elastic job on its store (Note [Joining a running job]). Under
        local steps its LocalSteps, made after this, anchors at the replica it received (Note [Joining
        under local steps] in pyasync/local.py)."""
        epoch, change = join_epoch(self._setup, public_items(self._setup, policy))
        self._epochs.append(change)
        self._requests = Requests(store(), epoch.key)
        epoch.engine.admit_at_close = self._admit_at_close
        return epoch

    def _open_to_joiners(self, policy: Policy, members: list[int], rank: int) -> None:
        """Elastic (one rank or more): rank 0 writes what a joiner needs to find and check this job, and
        every member looks for join requests (Note [Joining a running job])."""
        st, ep = store(), self._epoch
        if st is None or not ep.key:
            return
        if rank == 0:
            publish(st, ep.key, members, public_items(self._setup, policy))
        self._requests = Requests(st, ep.key)
        ep.engine.admit_at_close = self._admit_at_close

    def _admit_at_close(self) -> bool:
        """close() has every final: the members decide once, through the store, whether a joiner that asked
        is admitted before they close (Note [Joining a running job])."""
        ep, req = self._epoch, self._requests
        if req is None:
            return False
        try:
            return decide_fate(req.st, ep.key, ep.number, grow=False)
        except Exception as e:
            self._stop_looking(e)
            return False

    def _stop_looking(self, e: BaseException) -> None:
        """The store failed while this member looked for joiners: it stops looking (once, with a warning)
        and trains on; a membership change that needs the store names it then (Note [A bounded store])."""
        self._requests = None
        self._epoch.engine.admit_at_close = None
        warnings.warn(
            f"pyasync: the job's store failed while this worker looked for joiners ({type(e).__name__}: "
            f"{e}); it admits no more joiners",
            RuntimeWarning,
            stacklevel=3,
        )

    def _init_hooks(self) -> None:
        """The hook registries torch.optim.Optimizer's own __init__ would make (it is not called)."""
        self._optimizer_step_pre_hooks: dict = OrderedDict()
        self._optimizer_step_post_hooks: dict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: dict = OrderedDict()
        self._optimizer_state_dict_post_hooks: dict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: dict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: dict = OrderedDict()

    def _board(self, local: Local) -> SpeedBoard | None:
        """Local(adaptive=True): the workers' speeds, in the store under this epoch's prefix (Note
        [Dynamic local steps] in pyasync/local.py); None with one worker or no store."""
        ep = self._epoch
        st = store() if local.adaptive and ep.world > 1 else None
        return SpeedBoard(st, f"{ep.key}/e{ep.number}/speed", ep.rank, ep.world) if st is not None else None

    def _unhook(self) -> None:
        """Local steps: the engine reads ``.grad`` only at the outer steps (Note [Local steps]), so the
        current epoch's engine keeps no backward hooks."""
        if self.local_steps is not None:
            self._epoch.engine.capture.remove()

    def _guard(self) -> None:
        """A rank that exits without close(): stop the current epoch's threads, so peers see it leave (a
        PeerFailure there) and the interpreter's exit never meets a thread inside a socket call; then
        destroy its own group (session/epoch.py's ``abandon``)."""
        self._finalizer = weakref.finalize(self, abandon, self._epoch)

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
        scale = None if grad_scale is None else float(grad_scale)
        inf = found_inf is not None and float(found_inf) > 0
        if self.local_steps is None:
            self.engine.step(grad_scale=scale, found_inf=inf)
        elif self.local_steps.inner_step(self.optimizer, scale, inf, self.engine.finish):
            self.local_steps.outer_step(lambda: self.engine.step())
        self._follow_membership()
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, (), {})
        return loss

    def _follow_membership(self) -> None:
        """Elastic: ranks left, or a worker asked to join; the members move to the next membership epoch
        (session/membership.py)."""
        while self._epoch is not None and not self._epoch.engine.closed and (
            self._epoch.engine.lost or self._join_asked()
        ):
            self._next_epoch()

    def _join_asked(self) -> bool:
        """A join request waits (looked for at most every POLL_S seconds); this member claims the change
        for it (Note [Joining a running job]: the members in close() then take part)."""
        ep, req = self._epoch, self._requests
        try:
            if req is None or not req.due(ep.members):
                return False
            grow = decide_fate(req.st, ep.key, ep.number, grow=True)
        except Exception as e:  # the store's host is gone or stopped (Note [A bounded store])
            self._stop_looking(e)
            return False
        if not grow:
            raise RuntimeError(  # the members decide "end" only once every member has closed
                f"pyasync: epoch {ep.number} was decided to end while this member still trains"
            )
        return True

    def _next_epoch(self) -> None:
        """One membership change. One that fails (this rank was dropped, the store or a member is gone)
        is final: it raised to the caller, the old engine is stopped, and close() stops what is left
        without starting another change (which would read the stopped engine's shards)."""
        if self._epoch_failure is not None:
            raise self._epoch_failure
        old = self._epoch
        local = self.local_steps
        progress = local.park() if local is not None else None  # Note [Local steps]
        try:
            nxt, change = change_epoch(old, self._setup, self._requests)
        except BaseException as e:
            self._epoch_failure = e
            stop_engine(old.engine, f"its membership change failed ({type(e).__name__}: {e})")
            raise
        self._finalizer.detach()
        self._epoch = nxt
        nxt.engine.admit_at_close = self._admit_at_close if self._requests is not None else None
        self._guard()
        self._unhook()
        if local is not None:
            local.unpark(progress)
            local.board = self._board(local.policy)
        release_control(old)  # the old epoch's own group (its engine has stopped)
        self._epochs.append(change)

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
        """The policy (under local steps the Local one; the engine runs ``Local.outer()``)."""
        return self.local_steps.policy if self.local_steps is not None else self._epoch.policy

    @property
    def compressor(self):
        return self._setup.compressor

    @property
    def rank(self) -> int:
        return self._epoch.rank

    @property
    def world_size(self) -> int:
        return self._epoch.world

    @property
    def bucket_layouts(self):
        """Bucket and shard layouts (engine.shards.BucketLayout), for inspection."""
        return self._epoch.layouts

    @property
    def epoch(self) -> Epoch:
        """The current membership epoch (session/epoch.py): its members, layouts, policy, engine and
        groups. pyasync.checkpoint records its saves there (``last_checkpoint``)."""
        if self._epoch is None:
            raise RuntimeError("the DistributedOptimizer was not fully constructed")
        return self._epoch

    # Read by tests and benchmarks that look inside (the engine, the members' global ranks, the trained
    # parameters in the engine's order).
    @property
    def _engine(self) -> Engine | CollectiveEngine | None:
        return None if self._epoch is None else self._epoch.engine

    @property
    def _globals(self) -> list[int]:
        return self._epoch.members

    @property
    def _params(self) -> list[torch.Tensor]:
        return self._setup.params

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
        if self._epoch.world == 1:
            return
        try:
            groups.barrier(self._epoch.control, self._setup.timeout)
        except Exception as e:
            err = collective_failure(e, self.engine.transport, what)
            self.engine.record_failure(err)
            raise err from e

    def stats(self) -> Stats:
        """This rank's counters (see pyasync.Stats); the current membership epoch's, with the clock
        counted from the start and every membership change (``epochs``)."""
        ep = self.epoch
        st = self.engine.stats()
        st.clock += ep.clock0
        st.epoch = ep.number
        st.members = list(ep.members)
        st.epochs = [c.as_dict() for c in self._epochs]
        st.pushes_lost = sum(c.pushes_lost for c in self._epochs)
        st.pushes_resent = sum(c.pushes_resent for c in self._epochs)
        return st

    def close(self) -> None:
        """Drain, keep serving slower ranks until every rank has closed, apply every outstanding push,
        install the final parameters (equal on every rank) and stop the threads. Idempotent."""
        if self._epoch is None:
            return
        try:
            if self._epoch_failure is not None:  # step() raised it already; what is left was stopped
                return
            self._follow_membership()
            self._epoch.engine.close()
            while self._epoch.engine.drained:  # a rank left during close(): change epoch
                self._next_epoch()
                self._epoch.engine.close()
        finally:
            if self._epoch.engine.closed and self._epoch.control is not None:
                self._finalizer.detach()
                release_control(self._epoch)  # no reference may keep the group's threads and sockets alive

    @property
    def closed(self) -> bool:
        return self._epoch is None or self._epoch.engine.closed

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
        if self._epoch is None:
            raise RuntimeError("the DistributedOptimizer was not fully constructed")
        return self._epoch.engine

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The process group the optimizer trains over (None: the default group)."""
        return self._epoch.group

    @property
    def collective_group(self) -> dist.ProcessGroup | None:
        """The optimizer's own gloo group of the same ranks (None with one rank): its collectives
        (barrier, checkpoints, BSP's clipping) run there, bounded by ``timeout``, never mixing with the
        user's."""
        return self._epoch.control

    @property
    def timeout(self) -> datetime.timedelta:
        """The longest any wait of the optimizer may take."""
        return self._setup.timeout

    @property
    def named_params(self) -> list[tuple[str, torch.Tensor]]:
        """(name, parameter) of the trained parameters, each once, in the engine's order."""
        return list(zip(self._setup.names, self._setup.params))

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
                for lay in self._epoch.layouts
            ],
            "optimizer": list(self._setup.rule.describe()),
        }

    @property
    def fused_rule(self) -> bool:
        """True when the owners apply SGD / Adam / AdamW with the fused kernels (re-shardable state)."""
        return self._setup.rule.fused

    # -- state ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's shard: master values, optimizer state, residuals and clocks (tensors only, plus
        plain numbers and strings), for pyasync's checkpoints. Call between steps."""
        eng = self.engine
        ep, comp = self._epoch, self._setup.compressor
        shards = eng.shards.snapshot()
        sd = {
            "format": 1,
            "rank": ep.rank,
            "world_size": ep.world,
            "policy": ep.policy.spec(),
            "compression": comp.spec(),
            "clock": torch.tensor(eng.clock, dtype=torch.int64),
            "shards": {str(b): v for b, v in sorted(shards.items())},
            "residuals": comp.state_dict(),
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
        }
        if comp.momentum is not None:  # momentum-corrected top-k: the workers' velocities
            sd["velocities"] = comp.velocity_state_dict()
        if self.local_steps is not None:  # Note [Checkpoints under local steps] in pyasync/local.py
            sd["local"] = self.local_steps.state_dict(self.optimizer)
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what state_dict() of the same rank returned (same world size, model and layout)."""
        eng = self.engine
        ep = self._epoch
        if not isinstance(state_dict, dict) or "shards" not in state_dict:
            raise TypeError("state_dict must be a dict returned by DistributedOptimizer.state_dict()")
        if state_dict.get("world_size") != ep.world or state_dict.get("rank") != ep.rank:
            raise ValueError(
                f"state_dict is for rank {state_dict.get('rank')} of {state_dict.get('world_size')}, "
                f"this is rank {ep.rank} of {ep.world}"
            )
        shards = state_dict["shards"]
        owned = {str(b) for b, lay in enumerate(ep.layouts) if lay.shards[ep.rank].numel > 0}
        if set(shards) != owned:
            raise ValueError(
                f"state_dict holds shards of buckets {sorted(shards)}, this rank owns {sorted(owned)}"
            )
        comp = self._setup.compressor
        corrected = comp.momentum is not None
        if state_dict.get("velocities") and not corrected:
            raise ValueError(f"state_dict holds top-k velocities but compression={comp.spec()!r} keeps none")

        eng.shards.load({int(b): d for b, d in shards.items()})
        if "residuals" in state_dict:
            comp.load_state_dict(state_dict["residuals"])
        if corrected:
            comp.load_velocity_state_dict(state_dict.get("velocities", {}))
        for g, saved in zip(self.param_groups, state_dict.get("param_groups", [])):
            for k, v in saved.items():
                g[k] = v

    def load_local_state(self, state_dict: dict) -> None:
        """Under local steps: restore this worker's replica, anchor, step counts and inner optimizer state
        from ``state_dict["local"]`` (what state_dict() saved; Note [Checkpoints under local steps] in
        pyasync/local.py). Call after the global values are installed in the parameters, as
        load_checkpoint does; a no-op under every other policy."""
        if self.local_steps is None:
            return
        if "local" not in state_dict:
            raise ValueError(
                f"state_dict holds no local-steps state (saved under another policy), this optimizer runs "
                f"{self.policy.spec()!r}"
            )
        self.local_steps.load_state_dict(state_dict["local"], self.optimizer)

    def __repr__(self) -> str:
        return (
            f"DistributedOptimizer({type(self.optimizer).__name__}, policy={self.policy.spec()!r}, "
            f"compression={self._setup.compressor.spec()!r}, rank={self._epoch.rank}/{self._epoch.world})"
        )
