"""The update rule an owner applies to its fp32 shard: fused SGD / Adam / AdamW kernels
(pyasync.ops.apply), or a private instance of any other torch optimizer class.

Hyperparameters are read at every update from the param_groups shared with the wrapped optimizer, so
lr schedulers and per-group settings act on exactly the elements of their group. A shard is cut into
*runs*: maximal stretches of consecutive segments with the same group, the same step count and a
gradient (see shards.Segment); each run is one kernel call.
"""

from __future__ import annotations

import math

import torch

from pyasync.ops import apply as ops_apply
from pyasync.ops import codecs as ops_codecs
from pyasync.ops._common import Payload
from pyasync.optim import DelayedNesterov

__all__ = ["GAP_BETA", "GAP_WARMUP", "ShardState", "UpdateRule", "lookahead_floor"]

#: The gap-aware penalty (Note [Gap-aware penalty] in pyasync/policy.py) measures each element's gap in
#: units of its running mean step, a mean of decay GAP_BETA per update (about the last 100), and starts
#: once that mean has seen GAP_WARMUP updates of the shard (from the start, or from a restore).
GAP_BETA = 0.99
GAP_WARMUP = 20


def lookahead_floor(mu: float, memory: float) -> int:
    """The fewest updates a look-ahead spans at ``memory`` times the memory 1 / (1 - mu) of a momentum
    ``mu`` per update (rounded up; 0 without momentum or without a floor): Note [Look-ahead replies]
    in pyasync/policy.py."""
    if memory <= 0 or not 0 < mu < 1:
        return 0
    return math.ceil(memory / (1.0 - mu) - 1e-9)


def _reach(mu: float, k: int) -> float:
    """mu + mu^2 + ... + mu^k, in closed form (the floor can span thousands of updates)."""
    if k <= 0 or mu == 0.0:
        return 0.0
    return float(k) if mu == 1.0 else mu * (1.0 - mu**k) / (1.0 - mu)


class ShardState:
    """The optimizer state of one shard an owner keeps (touched only by that shard's applier thread).
    The round's bookkeeping (versions, clocks, the aggregate's pushers) is the round machine's
    (engine/core/round.py)."""

    def __init__(self, layout) -> None:
        self.layout = layout  # shards.ShardLayout
        self.bucket = layout.bucket
        self.master: torch.Tensor | None = None  # fp32 values of the shard (numel,)
        self.state1: torch.Tensor | None = None  # SGD momentum / Adam exp_avg
        self.state2: torch.Tensor | None = None  # Adam exp_avg_sq
        self.gap_step: torch.Tensor | None = None  # the gap-aware penalty's running mean |step|
        self.gap_updates = 0  # updates gap_step has seen here (from the start or a restore)
        self.steps = [0] * len(layout.segments)  # optimizer steps taken by each segment
        self.scratch: torch.Tensor | None = None  # decode / top-k scratch
        self.generic = None  # private torch optimizer (generic rule)
        self.generic_views: list[tuple[int, torch.Tensor]] = []
        self.generic_groups: list[int] = []

    def scratch_buf(self) -> torch.Tensor:
        if self.scratch is None:
            self.scratch = torch.empty_like(self.master)
        return self.scratch


class UpdateRule:
    """Applies one optimizer update to a shard from an encoded payload or a dense fp32 gradient."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.groups = optimizer.param_groups  # shared, read at every update
        t = type(optimizer)
        if t is torch.optim.SGD:
            self.kind = "sgd"
        elif t is DelayedNesterov:
            self.kind = "delayed_nesterov"
        elif t in (torch.optim.Adam, torch.optim.AdamW) and not any(
            g.get("amsgrad", False) for g in self.groups
        ):
            self.kind = "adam"
            self.decoupled = t is torch.optim.AdamW or any(
                g.get("decoupled_weight_decay", False) for g in self.groups
            )
        elif t is torch.optim.LBFGS:
            raise TypeError(
                "LBFGS needs a closure re-evaluating the loss several times per step; it cannot "
                "be made asynchronous. Use SGD, Adam, AdamW or another first-order optimizer"
            )
        else:
            self.kind = "generic"
        # > 0: the workers take SGD's momentum step before a momentum-corrected top-k (Note [Momentum
        # correction for top-k] in csrc/include/pyasync/math/topk.h); the owners then step with
        # momentum 0 and keep no momentum buffer. Set by bind_worker_momentum.
        self.worker_momentum = 0.0
        self.gap = False  # the gap-aware penalty is on (bind_gap); its state is "gap_step"

    @property
    def fused(self) -> bool:
        return self.kind != "generic"

    def bind_worker_momentum(self, compressor) -> None:
        """Give a top-k compressor the optimizer's SGD momentum (``compressor.bind_momentum``) and, when
        it takes the momentum step on the workers, stop taking it here. Momentum correction needs one
        momentum, dampening 0 and one Nesterov setting in every param group: otherwise ``dgc="auto"``
        leaves it off and ``dgc="on"`` is an error."""
        bind = getattr(compressor, "bind_momentum", None)
        if bind is None:
            return
        momenta = {float(g.get("momentum", 0.0)) for g in self.groups} if self.kind == "sgd" else {0.0}
        nesterov = {bool(g.get("nesterov", False)) for g in self.groups}
        damped = any(float(g.get("dampening", 0.0)) != 0.0 for g in self.groups)
        if len(momenta) > 1 or len(nesterov) > 1 or damped:
            if compressor.dgc == "on":
                raise ValueError(
                    "TopK(dgc='on') needs one SGD momentum, one nesterov setting and dampening 0 in every "
                    f"param group; got momenta {sorted(momenta)}, nesterov {sorted(nesterov)}, dampening "
                    f"{'!= 0' if damped else '0'}. Use TopK(dgc='off') for per-group momentum")
            momenta = {0.0}
        bind(momenta.pop(), nesterov.pop() if len(nesterov) == 1 else False, source=self.current_momentum)
        self.worker_momentum = compressor.momentum or 0.0

    def bind_gap(self, on: bool) -> None:
        """Keep the gap-aware penalty's state and apply it to the pushes handed a ``gap_held`` (Note
        [Gap-aware penalty] in pyasync/policy.py); SGD, Adam and AdamW only. Called before any state."""
        if on and self.kind not in ("sgd", "adam"):
            raise ValueError(
                f"the gap-aware penalty (gap=on) needs torch.optim.SGD, Adam or AdamW; the optimizer is "
                f"{type(self.optimizer).__name__}. Drop gap=on, or use one of those optimizers")
        self.gap = bool(on)

    def current_momentum(self) -> float:
        """The SGD momentum the param groups hold now (a scheduler may change it, e.g. OneCycleLR's
        cycle_momentum): what momentum-corrected top-k steps the workers' velocities with."""
        momenta = {float(g.get("momentum", 0.0)) for g in self.groups}
        if len(momenta) != 1:
            raise ValueError(
                f"momentum-corrected top-k needs one SGD momentum in every param group, but they now hold "
                f"{sorted(momenta)} (a scheduler changed them?); set them together, or use TopK(dgc='off')")
        return momenta.pop()

    def _momentum(self, grp: dict) -> float:
        """The momentum the owner's SGD step uses for group ``grp`` (0 when the workers take it)."""
        return 0.0 if self.worker_momentum else float(grp.get("momentum", 0.0))

    def state_names(self) -> list[str]:
        """Names of the fused rule's per-element state tensors (besides the per-segment "steps")."""
        if self.kind in ("adam", "delayed_nesterov"):
            names = ["state1", "state2"]
        elif self.kind == "sgd" and any(self._momentum(g) != 0.0 for g in self.groups):
            names = ["state1"]
        else:
            names = []
        return names + ["gap_step"] if self.gap else names

    def describe(self) -> list[str]:
        return [
            f"optimizer {type(self.optimizer).__module__}.{type(self.optimizer).__qualname__} ({self.kind})",
            f"param_groups {len(self.groups)}",
        ]

    # ------------------------------------------------------------------------------------------
    def new_state(self, layout, master: torch.Tensor) -> ShardState:
        """Fresh optimizer state for a shard of ``layout`` starting from the fp32 values ``master``."""
        s = ShardState(layout)
        s.master = master
        self.init_state(s)
        return s

    def init_state(self, s: ShardState) -> None:
        if self.kind in ("adam", "delayed_nesterov"):
            s.state1 = torch.zeros_like(s.master)
            s.state2 = torch.zeros_like(s.master)
        elif self.kind == "sgd":
            if any(self._momentum(g) != 0.0 for g in self.groups):
                s.state1 = torch.zeros_like(s.master)
        else:
            self._generic_init(s)
        if self.gap:
            s.gap_step = torch.zeros_like(s.master)

    def _generic_init(self, s: ShardState) -> None:
        segs = s.layout.segments
        order = sorted({seg.group for seg in segs})
        pgroups = []
        s.generic_views = []
        for g in order:
            views = []
            for i, seg in enumerate(segs):
                if seg.group == g:
                    v = s.master[seg.begin : seg.end]
                    views.append(v)
                    s.generic_views.append((i, v))
            pgroups.append({"params": views, **{k: v for k, v in self.groups[g].items() if k != "params"}})
        s.generic_groups = order
        if not pgroups:
            return
        cls = type(self.optimizer)
        try:
            s.generic = cls(pgroups, **dict(self.optimizer.defaults))
        except TypeError:
            s.generic = cls(pgroups)

    # ------------------------------------------------------------------------------------------
    def runs(self, s: ShardState, seg_mask: list[bool]) -> list[tuple[int, int, int, int, list[int]]]:
        """[(begin, end, group, steps, segment indices)] of the masked-in segments."""
        out: list[tuple[int, int, int, int, list[int]]] = []
        for i, seg in enumerate(s.layout.segments):
            if not seg_mask[i] or seg.end <= seg.begin:
                continue
            if out and out[-1][1] == seg.begin and out[-1][2] == seg.group and out[-1][3] == s.steps[i]:
                a, _, g, st, idx = out[-1]
                out[-1] = (a, seg.end, g, st, idx + [i])
            else:
                out.append((seg.begin, seg.end, seg.group, s.steps[i], [i]))
        return out

    def apply(
        self,
        s: ShardState,
        *,
        payload: Payload | None = None,
        grad_scale: float = 1.0,
        dense: torch.Tensor | None = None,
        seg_mask: list[bool],
        lr_factor: float = 1.0,
        momentum_shift: float = 0.0,
        round_of: int = 1,
        dc_lambda: float = 0.0,
        dc_held: torch.Tensor | None = None,
        gap_held: torch.Tensor | None = None,
    ) -> None:
        """One update of shard ``s`` from ``grad_scale * decode(payload)`` or ``dense``, on the segments
        whose ``seg_mask`` entry is True (the others are not touched, not even by weight decay).
        ``round_of`` > 1: this update is one of a round of that many that together stand for one step
        of the optimizer (Note [Moments per round] in pyasync/policy.py): SGD's momentum becomes its
        ``round_of``-th root, with the gradient and the weight decay scaled to keep each gradient's
        total displacement; Adam's betas become their ``round_of``-th roots; delayed Nesterov (local
        steps) moves its momentum once per ``round_of`` updates.
        ``momentum_shift`` is then taken off the momentum (SGD) or beta1 (Adam), down to 0 (Note
        [Momentum correction]). ``dc_lambda`` > 0 with ``dc_held`` (what the pushing worker held of the
        shard): delay compensation in the fused kernels (Note [Delay compensation] in
        pyasync/policy.py). ``gap_held`` (the same, under :meth:`bind_gap`): the gradient is divided by
        the gap-aware penalty first (Note [Gap-aware penalty]). The generic rule ignores all four.
        The payload is trusted: the engine's own encoder made it, or the wire validated it."""
        n = s.master.numel()
        runs = self.runs(s, seg_mask)
        if not runs:
            return
        whole = len(runs) == 1 and runs[0][0] == 0 and runs[0][1] == n
        gap = self.gap and s.gap_step is not None
        if gap and gap_held is not None:
            dense = self._gap_penalty(s, runs, payload, grad_scale, dense, gap_held)
            payload, grad_scale = None, 1.0
        before = [s.master[a:z].clone() for a, z, *_ in runs] if gap else None
        if payload is not None and (not whole or not self.fused):
            dense = ops_codecs.decode(payload, out=s.scratch_buf(), alpha=float(grad_scale), validate=False)
            payload, grad_scale = None, 1.0
        if not self.fused:
            self._generic_apply(s, dense, seg_mask, lr_factor)
            return
        for a, z, g, steps, idx in runs:
            grp = self.groups[g]
            p = payload if whole else None
            d = dense[a:z] if dense is not None else None
            scratch = s.scratch_buf()[a:z] if p is not None and p.codec == "topk" else None
            dc = {"dc_lambda": float(dc_lambda), "dc_held": dc_held[a:z]} if dc_held is not None else {}
            if self.kind == "delayed_nesterov":
                self._delayed_nesterov(s, a, z, grp, p, d, grad_scale, lr_factor, steps, round_of, scratch)
            elif self.kind == "sgd":
                momentum = self._momentum(grp)
                if momentum != 0.0 and s.state1 is None:
                    s.state1 = torch.zeros_like(s.master)
                used, f = momentum, 1.0
                if round_of > 1 and 0.0 < momentum < 1.0:
                    used = momentum ** (1.0 / round_of)
                    f = (1.0 - used) / (1.0 - momentum)  # a gradient's displacement: f / (1 - used)
                used = max(0.0, used - momentum_shift) if momentum_shift else used
                wd = float(grp.get("weight_decay", 0.0)) * (f / round_of if round_of > 1 else 1.0)
                if self.worker_momentum:  # the decay a momentum buffer would carry: wd / (1 - mu)
                    wd /= 1.0 - float(grp.get("momentum", 0.0))
                ops_apply.sgd_apply(
                    s.master[a:z],
                    payload=p,
                    grad_scale=float(grad_scale) * f,
                    dense=d,
                    dense_scale=f,
                    lr=float(grp["lr"]) * lr_factor,
                    momentum=used,
                    dampening=float(grp.get("dampening", 0.0)),
                    nesterov=bool(grp.get("nesterov", False)) and used != 0.0,
                    weight_decay=wd,
                    maximize=bool(grp.get("maximize", False)),
                    momentum_buffer=s.state1[a:z] if used != 0.0 else None,
                    first_step=steps == 0,
                    scratch=scratch,
                    validate=False,  # the engine's own tensors; payloads are checked where they come in
                    **dc,
                )
            else:
                shift = momentum_shift
                self._adam(s, a, z, grp, p, d, grad_scale, lr_factor, steps, round_of, shift, scratch, dc)
            for i in idx:
                s.steps[i] += 1
        if before is not None:  # the running mean |step| of each element updated
            for (a, z, *_), w0 in zip(runs, before):
                step = w0.sub_(s.master[a:z]).abs_()
                s.gap_step[a:z].mul_(GAP_BETA).add_(step, alpha=1.0 - GAP_BETA)
            s.gap_updates += 1

    @staticmethod
    def _gap_penalty(s, runs, payload, grad_scale, dense, held) -> torch.Tensor:
        """The push's gradient (``grad_scale`` x ``payload`` decoded, or a copy of ``dense``) divided on
        the runs, once past the warm-up, by max(1, |master - held| / gap_step) (Note [Gap-aware
        penalty])."""
        if payload is not None:
            g = ops_codecs.decode(payload, out=s.scratch_buf(), alpha=float(grad_scale), validate=False)
        else:
            g = dense.clone()
        if s.gap_updates < GAP_WARMUP:
            return g
        for a, z, *_ in runs:
            ratio = (s.master[a:z] - held[a:z]).abs_().div_(s.gap_step[a:z].clamp_min(1e-12))
            g[a:z].div_(ratio.clamp_min_(1.0))
        return g

    def _adam(self, s, a, z, grp, payload, dense, grad_scale, lr_factor, steps, round_of, shift, scratch, dc):
        """One Adam / AdamW update of elements [a, z) of shard ``s`` (the arguments of :meth:`apply`)."""
        beta1, beta2 = float(grp["betas"][0]), float(grp["betas"][1])
        if round_of > 1:
            beta1, beta2 = beta1 ** (1.0 / round_of), beta2 ** (1.0 / round_of)
        beta1 = max(0.0, beta1 - shift) if shift else beta1
        ops_apply.adam_apply(
            s.master[a:z],
            payload=payload,
            grad_scale=float(grad_scale),
            dense=dense,
            dense_scale=1.0,
            lr=float(grp["lr"]) * lr_factor,
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(grp["eps"]),
            weight_decay=float(grp.get("weight_decay", 0.0)),
            decoupled_weight_decay=bool(self.decoupled or grp.get("decoupled_weight_decay", False)),
            maximize=bool(grp.get("maximize", False)),
            step=steps + 1,
            exp_avg=s.state1[a:z],
            exp_avg_sq=s.state2[a:z],
            scratch=scratch,
            validate=False,
            **dc,
        )

    def _delayed_nesterov(
        self, s, a, z, grp, payload, dense, grad_scale, lr_factor, steps, round_of, scratch
    ) -> None:
        """One arrival of the delayed Nesterov outer step on elements [a, z) of shard ``s``: a round of
        ``round_of`` pushes (n under local:H:async) moves the momentum once (Note [Delayed Nesterov] in
        csrc/include/pyasync/math/optim.h)."""
        ops_apply.delayed_nesterov_apply(
            s.master[a:z],
            payload=payload,
            grad_scale=float(grad_scale),
            dense=dense,
            lr=float(grp["lr"]) * lr_factor,
            momentum=float(grp["momentum"]),
            close_round=(steps + 1) % max(1, round_of) == 0,
            momentum_buffer=s.state1[a:z],
            accumulator=s.state2[a:z],
            scratch=scratch,
            validate=False,
        )

    def lookahead(
        self, s: ShardState, k: int, n: int, round_of: int = 1, memory: float = 0.0
    ) -> torch.Tensor:
        """Where shard ``s``'s master will be after ``k`` more updates with zero gradients (a new tensor):
        SGD: w - lr * (mu + ... + mu^k) * buf; Adam/AdamW: w - lr/n * (b1 + ... + b1^k) * m_hat /
        (sqrt(v_hat) + eps), each update a push's lr/n (Note [Look-ahead replies] in pyasync/policy.py).
        ``round_of`` > 1: the updates advance the moments per round (:meth:`apply`), so mu and b1 are
        their ``round_of``-th roots. ``memory`` > 0: k is at least ``memory`` times the momentum's
        memory 1 / (1 - mu) in updates, per param group (:func:`lookahead_floor`). The master itself
        (cloned) where there is no momentum state to carry it."""
        out = s.master.clone()
        if (k <= 0 and memory <= 0) or s.state1 is None or self.kind not in ("sgd", "adam"):
            return out
        for i, seg in enumerate(s.layout.segments):
            if seg.end <= seg.begin or s.steps[i] == 0:
                continue
            grp, a, z = self.groups[seg.group], seg.begin, seg.end
            sign = 1.0 if grp.get("maximize", False) else -1.0
            if self.kind == "sgd":
                mu = float(grp.get("momentum", 0.0)) ** (1.0 / round_of)
                reach = _reach(mu, max(k, lookahead_floor(mu, memory)))
                out[a:z].add_(s.state1[a:z], alpha=sign * float(grp["lr"]) * reach)
            else:
                b1, b2 = (float(b) ** (1.0 / round_of) for b in grp["betas"])
                reach = _reach(b1, max(k, lookahead_floor(b1, memory)))
                step_size, bc2_sqrt = ops_apply.adam_scalars(float(grp["lr"]) / n, b1, b2, s.steps[i])
                denom = (s.state2[a:z].sqrt() / bc2_sqrt).add_(float(grp["eps"]))
                out[a:z].addcdiv_(s.state1[a:z], denom, value=sign * step_size * reach)
        return out

    def _generic_apply(
        self, s: ShardState, dense: torch.Tensor, seg_mask: list[bool], lr_factor: float
    ) -> None:
        if s.generic is None:
            return
        for pg, g in zip(s.generic.param_groups, s.generic_groups):
            for k, v in self.groups[g].items():
                if k != "params":
                    pg[k] = v
            if lr_factor != 1.0:
                pg["lr"] = float(pg["lr"]) * lr_factor
        segs = s.layout.segments
        for i, v in s.generic_views:
            v.grad = dense[segs[i].begin : segs[i].end] if seg_mask[i] else None
        with torch.no_grad():
            s.generic.step()
        for i, v in s.generic_views:
            v.grad = None
            if seg_mask[i]:
                s.steps[i] += 1

    # ------------------------------------------------------------------------------------------
    def state_tensors(self, s: ShardState) -> dict[str, torch.Tensor]:
        """The shard's optimizer state as named tensors (for state_dict)."""
        out = {"steps": torch.tensor(s.steps, dtype=torch.int64)}
        if s.state1 is not None:
            out["state1"] = s.state1
        if s.state2 is not None:
            out["state2"] = s.state2
        if s.gap_step is not None:
            out["gap_step"] = s.gap_step
        if s.generic is not None:
            for _j, (i, v) in enumerate(s.generic_views):
                for k, t in s.generic.state.get(v, {}).items():
                    if isinstance(t, torch.Tensor):
                        out[f"generic.{i}.{k}"] = t
        return out

    def load_state_tensors(self, s: ShardState, d: dict[str, torch.Tensor], where: str) -> None:
        steps = d.get("steps")
        if steps is None or steps.numel() != len(s.steps):
            raise ValueError(f"{where}: 'steps' must hold {len(s.steps)} entries")
        for name, attr in (("state1", "state1"), ("state2", "state2"), ("gap_step", "gap_step")):
            t = d.get(name)
            if t is not None:
                if t.numel() != s.master.numel():
                    raise ValueError(
                        f"{where}: {name!r} has {t.numel()} elements, expected {s.master.numel()}"
                    )
                if getattr(s, attr) is None:
                    setattr(s, attr, torch.zeros_like(s.master))
                getattr(s, attr).copy_(t.reshape(-1))
        s.steps = [int(x) for x in steps.tolist()]
        if s.generic is not None:
            for i, v in s.generic_views:
                st = {k.split(".", 2)[2]: t for k, t in d.items() if k.startswith(f"generic.{i}.")}
                if st:
                    s.generic.state[v] = {k: t.clone() for k, t in st.items()}
