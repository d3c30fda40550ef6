"""Gradient compressors with error feedback: the ``compression=`` argument of DistributedOptimizer.

    NoCompression()                      fp32, 4 bytes / element
    FP16(error_feedback=True)            2 bytes / element
    BF16(error_feedback=True)            2 bytes / element
    Int8(block=256, error_feedback=True) 1 byte / element + a 4-byte scale per block
    Sign(block=256, error_feedback=True) 1 bit / element + a 4-byte scale per block
    TopK(ratio=0.01, error_feedback=True) the ceil(ratio * n) largest |v|: 8 bytes each
                                         (dgc="auto": momentum correction under SGD momentum)

A lossy compressor with error feedback keeps, per slot ``key`` (the engine uses ``(bucket, shard)``),
the residual ``e`` of what it could not send, and encodes ``v = g + e`` the next time, so that

    decompress(compress(g + e_old)) + e_new == g + e_old        (up to float rounding)

and over many steps the sum of what was sent equals the sum of the gradients minus the last residual.
Residuals are double-buffered: an encode writes the spare buffer, and the buffers swap only when the
payload is finite. A step with a NaN/Inf gradient gives ``payload.finite == False`` (the caller drops
the payload) and leaves the residual exactly as it was.

The kernels are in :mod:`pyasync.ops.codecs`; their pure-torch specification is
:mod:`pyasync.reference.codecs`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable
from typing import Any

import torch

from pyasync._validate import check_bool, check_int, check_real
from pyasync.ops import codecs as _codecs
from pyasync.ops._common import Payload

__all__ = [
    "BF16",
    "FP16",
    "Compressor",
    "Int8",
    "NoCompression",
    "Sign",
    "TopK",
    "from_spec",
]


def _check_block(v: object) -> int:
    return check_int("block", v, lo=1, hi=_codecs.MAX_BLOCK, what="elements per scale")


def _check_ratio(v: object) -> float:
    v = check_real("ratio", v)
    if not 0.0 < v <= 1.0:
        raise ValueError(f"ratio must be in (0, 1] (the fraction of elements kept), got {v!r}")
    return v


class Compressor:
    """Base class: encodes fp32 tensors into :class:`~pyasync.ops._common.Payload` objects, keeping
    one error-feedback residual per key. Subclasses set ``name`` (the codec) and the codec arguments."""

    name: str = "none"
    lossy: bool = True
    # The workers' momentum under top-k's momentum correction (TopK.bind_momentum); None: the owners
    # take the optimizer's momentum, and the compressor keeps no velocities.
    momentum: float | None = None

    def __init__(self, error_feedback: bool = True, replies: bool = True) -> None:
        if type(self) is Compressor:
            raise TypeError("Compressor is a base class; use NoCompression, FP16, BF16, Int8, Sign or TopK")
        self.error_feedback = check_bool("error_feedback", error_feedback) and self.lossy
        # Replies coded with this codec too (the change from what each worker holds;
        # engine/core/replies.py and engine/collective/gather.py); False: replies carry exact fp32
        # values, only pushes are compressed.
        self.replies = check_bool("replies", replies) and self.lossy
        # key -> [current residual, spare buffer]; see the module docstring.
        self._residuals: dict[Hashable, list[torch.Tensor]] = {}
        self._undoable: set[Hashable] = set()  # keys whose last compress swapped (see undo)

    # -- codec arguments -------------------------------------------------------------------------
    def _args(self) -> dict[str, Any]:
        """Codec-specific spec arguments, in canonical order (before ef)."""
        return {}

    def _encode_kwargs(self, n: int) -> dict[str, int]:
        """block / k for ops.codecs.encode on n elements."""
        return {}

    # -- public API ------------------------------------------------------------------------------
    def spec(self) -> str:
        """Canonical description, e.g. ``"int8(block=256,ef=1)"``; ranks compare it, and
        :func:`from_spec` turns it back into an equal compressor."""
        if not self.lossy:
            return self.name
        args = [f"{k}={v!r}" for k, v in self._args().items()] + [f"ef={int(self.error_feedback)}"]
        if not self.replies:
            args.append("replies=0")
        return f"{self.name}({','.join(args)})"

    def wire_params(self, n: int) -> tuple[str, int, int]:
        """(codec, block, k) of the payloads this compressor makes for ``n`` >= 1 elements: what the
        wire announces and checks (block: elements per scale for int8/sign, else 0; k: top-k's kept
        elements, else 0)."""
        kw = self._encode_kwargs(n)
        return self.name, kw.get("block", 0), kw.get("k", 0)

    def wire_bytes(self, n: int) -> int:
        """Bytes of the payload tensors for n elements (headers aside)."""
        return _codecs.payload_nbytes(self.name, n, **self._encode_kwargs(n))

    def ratio(self, n: int | None = None) -> float:
        """Compressed bytes / fp32 bytes: for n elements, or for large n when n is None."""
        if n is None:
            n = 1 << 24
        return self.wire_bytes(n) / (4.0 * n)

    def compress(self, tensor: torch.Tensor, key: Hashable = None, out: Payload | None = None) -> Payload:
        """Encode `tensor` (contiguous fp32, any shape; n elements) plus the residual of slot `key`.

        The residual of `key` is created on first use (zeros, the tensor's size and device); a later
        call with a different element count for the same key is an error. Returns the payload (a new
        one, or `out` filled in place: a payload of this codec, n, block and k, e.g. views into a
        send buffer); ``payload.finite`` is False when the tensor held NaN/Inf (drop it: the residual
        is unchanged).
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != torch.float32:
            raise TypeError(f"tensor must be float32, got {tensor.dtype}; convert it with .float() first")
        if not tensor.is_contiguous():
            raise ValueError("tensor must be contiguous; call .contiguous() first")
        flat = tensor.view(-1)
        n = flat.numel()
        kwargs = self._encode_kwargs(n) if n > 0 else {}
        if n == 0 and self.name == "topk":
            raise ValueError("TopK cannot compress an empty tensor (it keeps at least one element)")
        if not self.error_feedback:
            return _codecs.encode(self.name, flat, out=out, **kwargs)
        cur, spare = self._slot(key, flat)
        self._undoable.discard(key)
        payload = self._encode_with_residual(flat, cur, spare, key, out, kwargs)
        if payload.finite:
            self._residuals[key] = [spare, cur]
            self._undoable.add(key)
        return payload

    def _encode_with_residual(self, flat, cur, spare, key, out, kwargs) -> Payload:
        """Encode ``flat + cur`` writing the new residual into ``spare`` (the slot's buffers swap after)."""
        return _codecs.encode(self.name, flat, residual_in=cur, residual_out=spare, out=out, **kwargs)

    def encode_once(self, tensor: torch.Tensor, out: Payload | None = None) -> Payload:
        """Encode ``tensor`` (contiguous fp32) with this codec and no residual of its own: for callers
        whose error feeds back by construction (BSP's compressed replies encode master - replica)."""
        if tensor.dtype != torch.float32 or not tensor.is_contiguous():
            raise TypeError("encode_once needs a contiguous float32 tensor")
        flat = tensor.view(-1)
        return _codecs.encode(self.name, flat, out=out, **self._encode_kwargs(flat.numel()))

    def undo(self, key: Hashable = None) -> None:
        """Take back the last ``compress`` of slot ``key``: its residual is again what it was before
        (the previous residual is still the spare buffer). For a payload that is never sent, e.g. one
        encoded early and superseded by an edit of the gradient. A no-op when that compress kept the
        residual (a non-finite payload) or was already undone; call it before the next compress of
        ``key``."""
        if key in self._undoable:
            self._undoable.discard(key)
            cur, prev = self._residuals[key]
            self._residuals[key] = [prev, cur]

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 values a payload stands for: a new 1-D tensor, or written into `out` (contiguous
        fp32 with payload.n elements, on the payload's device)."""
        if isinstance(payload, Payload) and payload.codec != self.name:
            raise ValueError(f"payload has codec {payload.codec!r} but this compressor is {self.spec()!r}")
        return _codecs.decode(payload, out=out)

    def residual(self, key: Hashable = None) -> torch.Tensor | None:
        """The current residual of slot `key` (a live buffer: do not modify), or None."""
        slot = self._residuals.get(key)
        return None if slot is None else slot[0]

    def state_dict(self) -> dict[Hashable, torch.Tensor]:
        """The residuals by key (copies), for checkpoints."""
        return {k: v[0].detach().clone() for k, v in self._residuals.items()}

    def load_state_dict(self, state_dict: dict) -> None:
        """Replace every residual by those of `state_dict` (from :meth:`state_dict`)."""
        loaded = _load_slots(state_dict, "residual")
        if not self.error_feedback and any(v[0].numel() for v in loaded.values()):
            raise ValueError(f"{self.spec()} keeps no residuals but state_dict holds some")
        self._residuals = loaded
        self._undoable.clear()

    def reset(self) -> None:
        """Forget every residual (they start again from zero)."""
        self._residuals.clear()
        self._undoable.clear()

    # -- helpers ---------------------------------------------------------------------------------
    def _slot(self, key: Hashable, flat: torch.Tensor) -> list[torch.Tensor]:
        return _slot_in(self._residuals, key, flat, "error-feedback")

    def __repr__(self) -> str:
        return f"{type(self).__name__}<{self.spec()}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Compressor) and other.spec() == self.spec()

    def __hash__(self) -> int:
        return hash(self.spec())


class NoCompression(Compressor):
    """Raw fp32 (lossless; still flags NaN/Inf)."""

    name = "none"
    lossy = False

    def __init__(self) -> None:
        super().__init__(error_feedback=False, replies=False)


class FP16(Compressor):
    """IEEE fp16 cast, round to nearest even (values past 65504 flag the payload as non-finite)."""

    name = "fp16"


class BF16(Compressor):
    """bfloat16 cast, round to nearest even."""

    name = "bf16"


class _Blockwise(Compressor):
    """A codec with one fp32 scale per `block` elements (int8, sign)."""

    def __init__(self, block: int = 256, error_feedback: bool = True, replies: bool = True) -> None:
        self.block = _check_block(block)
        super().__init__(error_feedback=error_feedback, replies=replies)

    def _args(self) -> dict[str, Any]:
        return {"block": self.block}

    def _encode_kwargs(self, n: int) -> dict[str, int]:
        return {"block": self.block}


class Int8(_Blockwise):
    """Blockwise absmax int8: codes in [-127, 127] and one fp32 scale per `block` elements."""

    name = "int8"


class Sign(_Blockwise):
    """1 bit per element (the sign) and one fp32 scale (mean |v|) per `block` elements."""

    name = "sign"


class TopK(Compressor):
    """The ``k = min(n, max(1, ceil(ratio * n)))`` elements of largest |v|, as int32 indices + fp32
    values. ``topk_ratio`` is the kept fraction; :meth:`ratio` is the byte ratio as for every codec.

    ``dgc``: momentum correction with factor masking (Deep Gradient Compression; Note [Momentum
    correction for top-k] in csrc/include/pyasync/math/topk.h). Each worker takes the momentum step
    on its own gradient before compressing, error feedback sums the velocity, and the velocity of
    what was sent is zeroed; the owners then step with momentum 0. "auto" (the default): on when the
    optimizer is SGD with momentum (the engine calls :meth:`bind_momentum`), off otherwise; "on":
    the same, but an optimizer without SGD momentum is an error; "off": top-k of the gradient, with
    the owners' momentum. ``mask``: factor masking, "auto" (the default) where ``ratio`` < 1 -
    momentum (an element is sent less often than the momentum remembers), True or False. Measured
    in docs/benchmarks.md ("Top-k with momentum")."""

    name = "topk"

    def __init__(
        self, ratio: float = 0.01, error_feedback: bool = True, replies: bool = True,
        dgc: str | bool = "auto", mask: str | bool = "auto",
    ) -> None:
        self.topk_ratio = _check_ratio(ratio)
        if isinstance(dgc, bool):
            dgc = "on" if dgc else "off"
        if dgc not in ("auto", "on", "off"):
            raise ValueError(
                f"dgc must be 'auto', 'on' or 'off' (momentum correction for top-k), got {dgc!r}")
        if dgc == "on" and not error_feedback:
            raise ValueError(
                "dgc='on' needs error_feedback=True: the velocity's unsent part is carried as a residual")
        self.dgc = dgc
        if mask not in ("auto", True, False):
            raise ValueError(
                f"mask must be 'auto', True or False (factor masking of top-k's velocity), got {mask!r}")
        self.mask = mask if mask == "auto" else bool(mask)  # factor masking (dgc only): bind_momentum
        self.masking = False  # what "auto" resolved to once bound
        self.momentum = None  # bound by bind_momentum
        self.nesterov = False
        self._source: Callable[[], float] | None = None
        self._velocities: dict[Hashable, list[torch.Tensor]] = {}  # key -> [current, spare], as residuals
        super().__init__(error_feedback=error_feedback, replies=replies)

    def _args(self) -> dict[str, Any]:
        args: dict[str, Any] = {"ratio": self.topk_ratio}
        if self.dgc != "auto":
            args["dgc"] = int(self.dgc == "on")
        if self.mask != "auto":
            args["mask"] = int(self.mask)
        return args

    def _encode_kwargs(self, n: int) -> dict[str, int]:
        return {"k": _codecs.topk_count(n, self.topk_ratio)}

    def bind_momentum(
        self, momentum: float, nesterov: bool = False, source: Callable[[], float] | None = None
    ) -> None:
        """Take the SGD momentum of the optimizer being wrapped (0 for one without): the velocity step
        runs from now on when ``dgc`` is "auto" or "on" and ``momentum`` > 0. ``source``: called at
        every compress for the momentum to use then (the engine passes the param groups', so a
        momentum scheduler acts); None: ``momentum`` throughout. Called by the engine before the
        first step; every worker binds the same value."""
        momentum = check_real("momentum", momentum, lo=0.0, hi=1.0)
        if self.dgc == "on" and momentum == 0.0:
            raise ValueError(
                "TopK(dgc='on') needs SGD with momentum > 0 (the correction moves the momentum onto the "
                "workers); use dgc='auto' to turn it off by itself for other optimizers, or dgc='off'")
        on = self.dgc != "off" and momentum > 0.0 and self.error_feedback
        self.momentum = momentum if on else None
        self.nesterov = bool(nesterov) if on else False
        self._source = source if on else None
        self._resolve_masking()
        self._velocities.clear()

    def set_ratio(self, ratio: float) -> None:
        """Change the kept fraction from the next encode on (a sparsity schedule, as DGC's warm-up),
        resolving mask="auto" again at the new fraction. Every worker must make the same change at
        the same step."""
        self.topk_ratio = _check_ratio(ratio)
        self._resolve_masking()

    def _resolve_masking(self) -> None:
        # Note [Momentum correction for top-k]: masking costs each send the velocity's tail, so it
        # pays only where an element is sent less often than once per 1 / (1 - momentum) steps.
        if self.momentum is None:
            self.masking = False
            return
        rare = self.topk_ratio < 1.0 - self.momentum
        self.masking = self.mask is True or (self.mask == "auto" and rare)

    def _encode_with_residual(self, flat, cur, spare, key, out, kwargs) -> Payload:
        if self.momentum is None:
            return _codecs.encode(self.name, flat, residual_in=cur, residual_out=spare, out=out, **kwargs)
        u_cur, u_new = _slot_in(self._velocities, key, flat, "velocity")
        x_buf = torch.empty_like(flat) if self.nesterov else None
        mu = self.momentum if self._source is None else self._source()
        x = _codecs.dgc_velocity(flat, u_cur, u_new, momentum=mu, nesterov=self.nesterov, x_out=x_buf)
        payload = _codecs.encode(self.name, x, residual_in=cur, residual_out=spare, out=out,
                                 mask_out=u_new if self.masking else None, **kwargs)
        if payload.finite:
            self._velocities[key] = [u_new, u_cur]
        return payload

    def undo(self, key: Hashable = None) -> None:
        if key in self._undoable and key in self._velocities:
            cur, prev = self._velocities[key]
            self._velocities[key] = [prev, cur]
        super().undo(key)

    def velocity(self, key: Hashable = None) -> torch.Tensor | None:
        """The current velocity of slot `key` under momentum correction (a live buffer), or None."""
        slot = self._velocities.get(key)
        return None if slot is None else slot[0]

    def velocity_state_dict(self) -> dict[Hashable, torch.Tensor]:
        """The velocities by key (copies), for checkpoints; empty without momentum correction."""
        return {k: v[0].detach().clone() for k, v in self._velocities.items()}

    def load_velocity_state_dict(self, state_dict: dict) -> None:
        """Replace every velocity by those of `state_dict` (from :meth:`velocity_state_dict`)."""
        self._velocities = _load_slots(state_dict, "velocity")
        if self._velocities and self.momentum is None:
            raise ValueError(f"{self.spec()} runs no momentum correction but the state holds velocities")

    def reset(self) -> None:
        self._velocities.clear()
        super().reset()

_CLASSES: dict[str, type] = {"none": NoCompression, "fp16": FP16, "bf16": BF16, "int8": Int8, "sign": Sign,
                             "topk": TopK}
_SHORT_ARG = {"int8": "block", "sign": "block", "topk": "ratio"}  # the X of "name:X"
_EXTRA_ARGS = {"topk": {"dgc", "mask"}}  # spec() arguments besides the short one, ef and replies
_SPEC_RE = re.compile(r"^([a-z0-9]+)\((.*)\)$")
_SPEC_HELP = (
    "use a Compressor, None, or one of 'none', 'fp16', 'bf16', 'int8', 'int8:BLOCK', 'sign', "
    "'sign:BLOCK', 'topk', 'topk:RATIO', each optionally followed by ':ef=0', ':replies=0' or (topk) "
    "':dgc=0|1', or a spec() string such as 'int8(block=256,ef=1)' "
    "('replies=0': exact fp32 replies, only the pushes compressed; 'dgc=0|1' for topk: momentum "
    "correction off or required)"
)


def _slot_in(slots: dict, key: Hashable, flat: torch.Tensor, what: str) -> list[torch.Tensor]:
    """The double-buffered slot ([current, spare]) of ``key`` for ``flat``: zeros on first use, moved to
    flat's device when it was loaded elsewhere; a different element count is an error."""
    slot = slots.get(key)
    n = flat.numel()
    if slot is None:
        slot = [torch.zeros(n, dtype=torch.float32, device=flat.device),
                torch.empty(n, dtype=torch.float32, device=flat.device)]
        slots[key] = slot
    elif slot[0].numel() != n:
        raise ValueError(
            f"{what} slot {key!r} holds {slot[0].numel()} elements but the tensor has {n}: use a "
            "distinct key per tensor slice, or reset() the compressor when the model changes"
        )
    elif slot[0].device != flat.device:  # e.g. loaded from a CPU checkpoint, now training on a GPU
        slot = [slot[0].to(flat.device), torch.empty(n, dtype=torch.float32, device=flat.device)]
        slots[key] = slot
    return slot


def _load_slots(state_dict: object, what: str) -> dict[Hashable, list[torch.Tensor]]:
    """Double-buffered slots ([current, spare]) from a state dict of float32 tensors by key."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict of {what} tensors, got {type(state_dict).__name__}")
    loaded: dict[Hashable, list[torch.Tensor]] = {}
    for k, v in state_dict.items():
        if not isinstance(v, torch.Tensor) or v.dtype != torch.float32:
            got = getattr(v, "dtype", type(v).__name__)
            raise TypeError(f"state_dict[{k!r}] must be a float32 tensor, got {got}")
        cur = v.detach().reshape(-1).clone()
        loaded[k] = [cur, torch.empty_like(cur)]
    return loaded


def _parse_value(name: str, key: str, text: str) -> int | float | bool:
    try:
        if key == "ratio":
            return float(text)
        if key == "block":
            return int(text)
        if key in ("ef", "replies", "mask") and text in ("0", "1"):
            return text == "1"
        if key == "dgc" and text in ("0", "1", "on", "off", "auto"):
            return {"0": "off", "1": "on"}.get(text, text)
    except ValueError:
        pass
    raise ValueError(f"compression spec for {name!r}: bad value {text!r} for {key!r}; {_SPEC_HELP}")


def from_spec(x: Compressor | str | None) -> Compressor:
    """A compressor from a Compressor (returned as is), None (NoCompression) or a string."""
    if x is None:
        return NoCompression()
    if isinstance(x, Compressor):
        return x
    if not isinstance(x, str):
        raise TypeError(
            f"compression must be a Compressor, None or a str, got {type(x).__name__}; {_SPEC_HELP}")
    s = x.strip().lower()
    kwargs: dict[str, Any] = {}
    m = _SPEC_RE.match(s)
    if m:
        name, body = m.group(1), m.group(2)
        if name not in _CLASSES:
            raise ValueError(f"unknown compression {x!r}; {_SPEC_HELP}")
        short = {_SHORT_ARG[name]} if name in _SHORT_ARG else set()
        allowed = set() if name == "none" else short | {"ef", "replies"} | _EXTRA_ARGS.get(name, set())
        for part in filter(None, body.split(",")):
            key, eq, val = part.partition("=")
            key = key.strip()
            if not eq or key not in allowed or key in kwargs:
                raise ValueError(f"compression spec {x!r}: unexpected argument {part!r}; {_SPEC_HELP}")
            kwargs[key] = _parse_value(name, key, val.strip())
    else:  # name[:X][:key=value]...
        name, *parts = s.split(":")
        if name not in _CLASSES:
            raise ValueError(f"unknown compression {x!r}; {_SPEC_HELP}")
        if parts and "=" not in parts[0]:
            if name not in _SHORT_ARG:
                raise ValueError(f"compression {name!r} takes no argument, got {x!r}; {_SPEC_HELP}")
            kwargs[_SHORT_ARG[name]] = _parse_value(name, _SHORT_ARG[name], parts.pop(0).strip())
        allowed = set() if name == "none" else {"ef", "replies"} | _EXTRA_ARGS.get(name, set())
        for part in parts:
            key, eq, val = part.partition("=")
            key = key.strip()
            if not eq or key not in allowed or key in kwargs:
                raise ValueError(f"compression spec {x!r}: unexpected argument {part!r}; {_SPEC_HELP}")
            kwargs[key] = _parse_value(name, key, val.strip())
    if "ef" in kwargs:
        kwargs["error_feedback"] = kwargs.pop("ef")
    return _CLASSES[name](**kwargs)
