"""Gradient capture: post-accumulate-grad hooks count ready parameters per bucket; the last one hands the
bucket to the push thread at once, so flattening and compression overlap the rest of backward.

Note [What step() pushes]
    The gradient pushed for a step is exactly what ``.grad`` holds when ``step()`` is called. The push
    thread encodes a bucket early, while backward goes on, but nothing is sent until ``step()``
    confirms the encode: for every parameter of the bucket, ``.grad`` must still be the very tensor
    the hook saw (a reassigned or deleted ``.grad`` is another object) with the same version counter
    (every in-place change, ``mul_``, ``zero_``, ``clip_grad_norm_``, ``GradScaler.unscale_``, a second
    ``backward()`` accumulating into it, bumps it). A bucket that changed is encoded again from what
    ``.grad`` holds then, after the early encode's error-feedback residual is taken back
    (``Compressor.undo``), so nothing is applied twice and nothing is lost. Detection, not guessing: an
    edit is never raced, only seen. What escapes the version counter: writes through ``.data``
    (a tensor with a version counter of its own) or through the raw storage (``numpy()``, ``data_ptr``).
    The price when nothing changed is one identity and version check per parameter in ``step()``; the
    price of an edit is encoding the edited buckets again, in ``step()``, where it no longer overlaps
    backward. Several ``backward()`` calls per step simply count as edits (``no_sync()`` spares the
    early encodes).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

from pyasync.engine.core.shards import BucketLayout

__all__ = ["Capture", "check_grads", "dense", "forbid_error", "grad_problem", "grad_stamp"]


def grad_problem(p: torch.Tensor, g: torch.Tensor | None, name: str) -> Exception | None:
    """The error for a gradient the engine cannot push (named after its parameter), or None."""
    if g is None:
        return None
    if g.shape != p.shape:
        return ValueError(
            f"the gradient of parameter {name} has shape {tuple(g.shape)}, but the parameter has shape "
            f"{tuple(p.shape)}; assign a gradient of the parameter's shape, or None"
        )
    if g.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return TypeError(
            f"the gradient of parameter {name} has dtype {g.dtype}; pyasync pushes float32, float16 and "
            "bfloat16 gradients"
        )
    if g.device != p.device:
        return ValueError(f"the gradient of parameter {name} is on {g.device}, the parameter on {p.device}")
    return None


def check_grads(params: list[torch.Tensor], names: list[str]) -> None:
    """A clear error, naming the parameter, for a gradient the engine cannot push (before anything is
    sent: the optimizer stays usable)."""
    for i, p in enumerate(params):
        err = grad_problem(p, p.grad, names[i])
        if err is not None:
            raise err


def forbid_error(names: list[str], layouts: list[BucketLayout], buckets: list[int], what: str) -> Exception:
    """What step() raises under grad_edits="forbid" when ``buckets`` changed after backward() (or a
    GradScaler is in use): the engine already ``what`` (sent them, reduced them) while backward ran."""
    shown = sorted({names[p] for b in buckets for p in layouts[b].params})[:8]
    return RuntimeError(
        f"pyasync: gradients changed after backward() (parameters {shown}) or a GradScaler is in use, but "
        f"grad_edits='forbid' {what} while backward ran; the step is lost. Use grad_edits='detect' (the "
        "default) to edit gradients between backward() and step()"
    )


def dense(g: torch.Tensor) -> torch.Tensor:
    """A contiguous dense copy of a sparse or strided gradient (flatten needs contiguous tensors)."""
    if g.layout != torch.strided:
        g = g.to_dense()
    return g if g.is_contiguous() else g.contiguous()


def grad_stamp(g: torch.Tensor | None) -> tuple[object, int]:
    """What identifies the state of a ``.grad``: the object and its version counter."""
    return (g, -1 if g is None else g._version)


class Capture:
    """The hooks of one engine. ``hand_over(b)`` is called (with ``cond`` held) when bucket b is ready."""

    def __init__(
        self,
        params: list[torch.Tensor],
        layouts: list[BucketLayout],
        cond: threading.Condition,
        hand_over: Callable[[int], None],
    ) -> None:
        self.params = params
        self.layouts = layouts
        self.cond = cond
        self.hand_over = hand_over
        self.slot: dict[int, tuple[int, int]] = {}  # param index -> (bucket, slot)
        for b, lay in enumerate(layouts):
            for slot, p in enumerate(lay.params):
                self.slot[p] = (b, slot)
        self.ready: dict[int, set[int]] = {b: set() for b in range(len(layouts))}
        self.stamps: dict[int, list[tuple[object, int]]] = {}  # bucket -> stamps when handed over
        self.no_sync = False
        self.enabled = True
        self.hooks = [params[i].register_post_accumulate_grad_hook(self._hook(i)) for i in self.slot]

    def _hook(self, i: int):
        def hook(p: torch.Tensor) -> None:
            self._grad_ready(i)

        return hook

    def _grad_ready(self, i: int) -> None:
        if self.no_sync or not self.enabled:
            return
        b, slot = self.slot[i]
        with self.cond:
            if b in self.stamps:
                return  # a later backward into a bucket handed over: step() sees the version change
            self.ready[b].add(slot)
            if len(self.ready[b]) == len(self.layouts[b].params):
                self._hand(b)

    def _hand(self, b: int) -> None:
        # A gradient the engine cannot push (wrong shape or dtype, e.g. through .data) is not handed
        # over: step() names it, and the bucket is handed over once it is right (a later backward, or
        # flush() in step()).
        if any(grad_problem(self.params[p], self.params[p].grad, "") for p in self.layouts[b].params):
            return
        self.stamps[b] = [grad_stamp(self.params[p].grad) for p in self.layouts[b].params]
        self.hand_over(b)

    def flush(self) -> None:
        """Hand over every bucket not handed over yet (caller holds cond)."""
        for b in range(len(self.layouts)):
            if b not in self.stamps:
                self._hand(b)

    def changed(self) -> list[int]:
        """Buckets whose gradients are no longer what the hooks saw (Note [What step() pushes])."""
        out = []
        for b, stamps in self.stamps.items():
            for p, (g0, v0) in zip(self.layouts[b].params, stamps):
                g = self.params[p].grad
                if g is not g0 or (g is not None and g._version != v0):
                    out.append(b)
                    break
        return sorted(out)

    def next_clock(self) -> None:
        """The step is over (or abandoned): every bucket may be handed over again (caller holds cond)."""
        self.stamps = {}
        for b in self.ready:
            self.ready[b] = set()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """``opt.no_sync()``: gradients accumulate, nothing is handed over."""
        prev = self.no_sync
        self.no_sync = True
        try:
            yield
        finally:
            self.no_sync = prev

    def remove(self) -> None:
        self.enabled = False
        for h in self.hooks:
            h.remove()
        self.hooks = []
