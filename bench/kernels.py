"""Microbenchmarks of pyasync's kernels against eager torch, torch.compile and a plain copy.

    python bench/kernels.py --out results.json                 # CPU, 1M and 25M elements
    python bench/kernels.py --quick                            # 1M only, few repeats (a dry run)
    python bench/kernels.py --device cuda --ops encode,decode --sizes 1M,25M,100M

Writes a JSON list with one record per (op, size) and prints a table. The fields and the bytes model
of every op are described in bench/README.md; the harness (timing, copy bandwidth, machine info) is
bench/common.py.
"""

from __future__ import annotations

import argparse
import fnmatch
import gc
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import _path  # noqa: F401  (first: sys.path, see bench/_path.py)
import common as bc
import torch

CODECS = ("none", "fp16", "bf16", "int8", "sign", "topk")
OPTIMS = ("sgd", "adam", "adamw")
GRAD_SCALE = 0.25  # 1/n for 4 workers: the scale folded into flatten and apply
ALPHA = 1.0  # decode scale

Fn = Callable[[], Any]


# ------------------------------------------------------------------------------------------------
# Cases


@dataclass
class Candidate:
    """One implementation of an op, ready to call: `fn` runs it once, `outputs` returns the tensors
    its last call produced (to check the kernel against the reference before timing)."""

    fn: Fn
    outputs: Callable[[], list[torch.Tensor]]


@dataclass
class Baseline:
    """What torch offers for the same job, timed in the same rounds as the kernel: the record gets
    ``<name>_ms`` and ``speedup_vs_<name>`` (its time over the kernel's). `check`, called once before
    timing with the kernel's and the baseline's outputs after one call each, returns record fields
    that say whether both computed the same thing."""

    name: str  # e.g. "torch_topk", "torch_fused_adam"
    build: Callable[[], Candidate]  # fresh state, ready to call
    check: Callable[[list[torch.Tensor], list[torch.Tensor]], dict[str, Any]] | None = None
    info: dict[str, Any] = field(default_factory=dict)  # fields copied into the record


@dataclass
class Case:
    """One op at one size: how to build each implementation and what it must move."""

    op: str  # record name, e.g. "encode:int8", "apply:adamw:int8"
    kind: str  # flatten | unflatten | encode | decode | apply
    pyasync: Callable[[], Candidate]  # the kernel under test
    reference: Callable[[Callable], Candidate]  # builds the reference around a (compiled or eager) fn
    ref_fn: Callable  # the eager reference function (the one torch.compile wraps)
    bytes: int  # bytes read + written, see bench/README.md
    bytes_model: str  # the same, as a formula
    exact: bool  # outputs must match the reference bit for bit
    extra: dict[str, Any] = field(default_factory=dict)  # fields copied into the record
    baseline: Baseline | None = None  # a torch implementation timed side by side (top-k, Adam)


class Ctx:
    """Inputs of one size: deterministic random tensors on one device."""

    def __init__(self, n: int, device: torch.device, seed: int, block: int, topk_ratio: float):
        self.n = n
        self.device = device
        self.seed = seed
        self.block = block
        self.topk_ratio = topk_ratio

    def randn(self, n: int, salt: int, scale: float = 1.0) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + salt)
        t = torch.randn(n, generator=g, dtype=torch.float32)
        if scale != 1.0:
            t.mul_(scale)
        return t.to(self.device)

    def flag(self) -> torch.Tensor:
        return torch.zeros(1, dtype=torch.int32, device=self.device)


def model_like_sizes(n: int) -> list[int]:
    """Element counts of a transformer-like parameter list summing to exactly `n` (the last one cut
    short): per layer qkv weight and bias (3d*d, 3d), output projection (d*d, d), a norm (d, d), MLP
    (4d*d, 4d, 4d*d, d) and a norm (d, d), with the width d (a power of two >= 16) chosen so that
    about 4 or more layers fit."""
    d = 16
    while 12 * (2 * d) ** 2 * 4 <= n:
        d *= 2
    layer = [3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d, d, d]
    sizes: list[int] = []
    total = 0
    while total < n:
        for s in layer:
            s = min(s, n - total)
            if s == 0:
                break
            sizes.append(s)
            total += s
    return sizes


def _offsets(sizes: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def _payload_tensors(p) -> list[torch.Tensor]:
    return [t for t in (p.codes, p.scales, p.indices) if t is not None]


def case_flatten(ctx: Ctx) -> Case:
    from pyasync.ops import bucketing as ops
    from pyasync.reference import bucketing as ref

    n, dev = ctx.n, ctx.device
    sizes = model_like_sizes(n)
    offsets = _offsets(sizes)
    flat = ctx.randn(n, 1)
    tensors = [t.clone() for t in flat.split(sizes)]  # separate allocations, like real parameters
    del flat

    def pyasync() -> Candidate:
        out, flag = torch.empty(n, device=dev), ctx.flag()
        return Candidate(
            lambda: ops.flatten(tensors, out, offsets, scale=GRAD_SCALE, nonfinite=flag), lambda: [out, flag]
        )

    def reference(f: Callable) -> Candidate:
        out, flag = torch.empty(n, device=dev), ctx.flag()
        return Candidate(
            lambda: f(tensors, out, offsets, scale=GRAD_SCALE, nonfinite=flag), lambda: [out, flag]
        )

    return Case(
        "flatten", "flatten", pyasync, reference, ref.flatten, 8 * n,
        "read 4n (fp32 tensors) + write 4n (fp32 bucket)", exact=True, extra={"tensors": len(sizes)},
    )


def case_unflatten(ctx: Ctx) -> Case:
    from pyasync.ops import bucketing as ops
    from pyasync.reference import bucketing as ref

    n, dev = ctx.n, ctx.device
    total = n + n // 4 + 1
    sizes = model_like_sizes(total)
    offsets = _offsets(sizes)
    begin = n // 8 + 3  # a shard slice cutting through tensors at both ends
    src = ctx.randn(n, 2)
    touched = sum(1 for o, s in zip(offsets, sizes) if o < begin + n and o + s > begin)

    def dests() -> list[torch.Tensor]:
        return [torch.zeros(s, device=dev) for s in sizes]

    def pyasync() -> Candidate:
        ts = dests()
        return Candidate(lambda: ops.unflatten(src, ts, offsets, begin=begin), lambda: ts)

    def reference(f: Callable) -> Candidate:
        ts = dests()
        return Candidate(lambda: f(src, ts, offsets, begin=begin), lambda: ts)

    return Case(
        "unflatten", "unflatten", pyasync, reference, ref.unflatten, 8 * n,
        "read 4n (fp32 slice) + write 4n (the covered parts of the fp32 tensors)", exact=True,
        extra={"tensors": touched},
    )


def _topk_k(ctx: Ctx) -> int:
    from pyasync.ops import codecs as ops

    return ops.topk_count(ctx.n, ctx.topk_ratio)


def _payload_model(codec: str, ctx: Ctx, k: int) -> tuple[int, str]:
    """(bytes, formula) of a payload of ctx.n elements."""
    from pyasync.ops import codecs as ops

    nbytes = ops.payload_nbytes(codec, ctx.n, block=ctx.block, k=k)
    formula = {
        "none": "4n",
        "fp16": "2n",
        "bf16": "2n",
        "int8": "n + 4*ceil(n/block)",
        "sign": "ceil(n/8) + 4*ceil(n/block)",
        "topk": "8k",
    }[codec]
    return nbytes, formula


def topk_index_sets(mine: torch.Tensor, theirs: torch.Tensor, v: torch.Tensor) -> dict[str, Any]:
    """Compare two top-k index sets of the same ``v``. Equal sets, or sets that differ only in
    elements whose |v| equals the k-th largest |v| (ties, which torch.topk breaks in no stated order
    and pyasync by lowest index), count as the same selection."""
    a = mine.long().sort().values
    b = theirs.long().sort().values
    same = a.shape == b.shape and bool(torch.equal(a, b))
    only_mine = a[~torch.isin(a, b)]
    only_theirs = b[~torch.isin(b, a)]
    up_to_ties = same
    if not same and a.shape == b.shape and only_mine.numel() == only_theirs.numel():
        mag = v.abs()
        threshold = mag[b].min()
        up_to_ties = bool((mag[only_mine] == threshold).all()) and bool((mag[only_theirs] == threshold).all())
    return {
        "topk_same_index_set": same,
        "topk_same_index_set_up_to_ties": up_to_ties,
        "topk_index_differences": int(only_mine.numel()),
    }


def case_encode(ctx: Ctx, codec: str) -> Case:
    from pyasync.ops import codecs as ops
    from pyasync.reference import codecs as ref

    n, dev, block = ctx.n, ctx.device, ctx.block
    k = _topk_k(ctx) if codec == "topk" else 0
    grad = ctx.randn(n, 3)
    residual0 = ctx.randn(n, 4, scale=0.1)
    pbytes, pformula = _payload_model(codec, ctx, k)

    def pyasync() -> Candidate:
        r = residual0.clone()
        p = ops.empty_payload(codec, n, device=dev, block=block, k=k)
        flag = ctx.flag()
        return Candidate(
            lambda: ops.encode(
                codec, grad, residual_in=r, residual_out=r, block=block, k=k, out=p, nonfinite=flag
            ),
            lambda: [*_payload_tensors(p), r],
        )

    def reference(f: Callable) -> Candidate:
        st: dict[str, Any] = {"r": residual0.clone(), "p": None}

        def fn() -> None:
            st["p"], st["r"] = f(codec, grad, residual=st["r"], block=block, k=k)

        return Candidate(fn, lambda: [*_payload_tensors(st["p"]), st["r"]])

    baseline = None
    if codec == "topk":
        v = grad + residual0  # what the kernel's first call selects from

        def build_topk() -> Candidate:
            st: dict[str, Any] = {}

            def fn() -> None:
                st["r"] = torch.topk(v.abs(), k)

            return Candidate(fn, lambda: [st["r"].indices])

        baseline = Baseline(
            "torch_topk", build_topk,
            check=lambda mine, theirs: topk_index_sets(mine[1], theirs[0], v),
            info={"torch_topk_call": "torch.topk(v.abs(), k)"},
        )

    return Case(
        f"encode:{codec}", "encode", pyasync, reference, ref.encode, 12 * n + pbytes,
        f"read 4n grad + 4n residual; write 4n residual + payload {pformula}",
        exact=codec != "sign",  # sign: the per-block mean |v| may round differently
        extra={"codec": codec, "payload_bytes": pbytes, "k": k or None,
               "block": block if codec in ("int8", "sign") else None},
        baseline=baseline,
    )


def case_encode_dgc(ctx: Ctx) -> Case:
    """Momentum-corrected top-k, one worker step: the velocity kernel, then the top-k encode that masks
    the sent velocity (TopK under SGD momentum), against pyasync.reference.topk.dgc_encode."""
    from pyasync.ops import codecs as ops
    from pyasync.reference import topk as ref

    n, dev, mu = ctx.n, ctx.device, 0.9
    k = _topk_k(ctx)
    grad = ctx.randn(n, 3)
    u0 = ctx.randn(n, 5)
    residual0 = ctx.randn(n, 4, scale=0.1)
    pbytes, pformula = _payload_model("topk", ctx, k)

    def pyasync() -> Candidate:
        u, u_new, r, r_new = u0.clone(), torch.empty_like(u0), residual0.clone(), torch.empty_like(residual0)
        p = ops.empty_payload("topk", n, device=dev, k=k)
        flag = ctx.flag()

        def fn() -> None:
            x = ops.dgc_velocity(grad, u, u_new, momentum=mu)
            ops.encode("topk", x, residual_in=r, residual_out=r_new, k=k, out=p, nonfinite=flag,
                       mask_out=u_new)

        return Candidate(fn, lambda: [*_payload_tensors(p), u_new, r_new])

    def reference(f: Callable) -> Candidate:
        st: dict[str, Any] = {}

        def fn() -> None:
            st["p"], st["u"], st["r"] = f(grad, u0, residual0, k, mu)

        return Candidate(fn, lambda: [*_payload_tensors(st["p"]), st["u"], st["r"]])

    return Case(
        "encode:topk+dgc", "encode", pyasync, reference, ref.dgc_encode, 24 * n + pbytes,
        f"velocity: read 4n grad + 4n u, write 4n u; encode: read 4n u + 4n residual, write 4n residual "
        f"+ payload {pformula} (+ the masked velocity, O(k))",
        exact=True,
        extra={"codec": "topk", "payload_bytes": pbytes, "k": k, "momentum": mu},
    )


def _encoded(ctx: Ctx, codec: str, k: int, salt: int):
    """A payload of ctx.n elements, encoded by pyasync from a random gradient."""
    from pyasync.ops import codecs as ops

    return ops.encode(codec, ctx.randn(ctx.n, salt), block=ctx.block, k=k)


def case_decode(ctx: Ctx, codec: str) -> Case:
    from pyasync.ops import codecs as ops
    from pyasync.reference import codecs as ref

    n, dev = ctx.n, ctx.device
    k = _topk_k(ctx) if codec == "topk" else 0
    payload = _encoded(ctx, codec, k, 5)
    pbytes, pformula = _payload_model(codec, ctx, k)

    def pyasync() -> Candidate:
        out = torch.empty(n, device=dev)
        return Candidate(lambda: ops.decode(payload, out=out, alpha=ALPHA), lambda: [out])

    def reference(f: Callable) -> Candidate:
        out = torch.empty(n, device=dev)
        return Candidate(lambda: f(payload, out=out, alpha=ALPHA), lambda: [out])

    model = f"read payload {pformula}; write 4n out"
    if codec == "topk":
        model += " (zeros, then the k values scattered into the same lines)"
    return Case(
        f"decode:{codec}", "decode", pyasync, reference, ref.decode, pbytes + 4 * n, model, exact=False,
        extra={"codec": codec, "payload_bytes": pbytes, "k": k or None,
               "block": ctx.block if codec in ("int8", "sign") else None},
    )


def case_apply(ctx: Ctx, optim: str, codec: str) -> Case:
    from pyasync.ops import apply as ops
    from pyasync.reference import apply as ref

    n, dev = ctx.n, ctx.device
    k = _topk_k(ctx) if codec == "topk" else 0
    payload = _encoded(ctx, codec, k, 6)
    pbytes, pformula = _payload_model(codec, ctx, k)
    param0 = ctx.randn(n, 7)
    if optim == "sgd":
        kwargs: dict[str, Any] = {"lr": 0.01, "momentum": 0.9, "first_step": False}
        state0 = {"momentum_buffer": ctx.randn(n, 8, scale=0.01)}
        name, state_bytes, state_model = "sgd_apply", 8 * n, "momentum buffer 4n read + 4n written"
    else:
        kwargs = {
            "lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "step": 10,
            "weight_decay": 0.01 if optim == "adamw" else 0.0, "decoupled_weight_decay": optim == "adamw",
        }
        state0 = {"exp_avg": ctx.randn(n, 8, scale=0.01), "exp_avg_sq": ctx.randn(n, 9, scale=0.01).square_()}
        name, state_bytes, state_model = "adam_apply", 16 * n, "exp_avg + exp_avg_sq 8n read + 8n written"

    def make(f: Callable, scratch: bool) -> Candidate:
        param = param0.clone()
        state = {key: t.clone() for key, t in state0.items()}
        extra = {"scratch": torch.empty(n, device=dev)} if scratch and codec == "topk" else {}
        return Candidate(
            lambda: f(param, payload=payload, grad_scale=GRAD_SCALE, **kwargs, **state, **extra),
            lambda: [param, *state.values()],
        )

    total = 8 * n + state_bytes + pbytes
    model = f"param 4n read + 4n written; {state_model}; read payload {pformula}"
    if codec == "topk":
        total += 8 * n + 4 * k
        model += "; top-k is scattered into a dense fp32 scratch first: 4n zeroed + 4k scattered + 4n read"
    baseline = fused_adam_baseline(ctx, optim, payload, param0, state0, kwargs) if optim != "sgd" else None
    return Case(
        f"apply:{optim}:{codec}", "apply", lambda: make(getattr(ops, name), True),
        lambda f: make(f, False), getattr(ref, name), total, model, exact=False,
        extra={"codec": codec, "optim": optim, "payload_bytes": pbytes, "k": k or None,
               "block": ctx.block if codec in ("int8", "sign") else None},
        baseline=baseline,
    )


def fused_adam_baseline(ctx: Ctx, optim: str, payload, param0: torch.Tensor, state0: dict[str, torch.Tensor],
                        kwargs: dict[str, Any]) -> Baseline | None:
    """Decode (pyasync's kernel, into a dense fp32 gradient), then torch's fused Adam/AdamW on it: what
    an owner would run without the fused apply. Calls ``torch._fused_adam_`` / ``torch._fused_adamw_``
    directly, the kernels behind ``torch.optim.Adam(fused=True)`` without its Python step (so the
    fastest torch can do; the step count stays at ``step``, as in the kernel). None where this torch
    has no such op."""
    from pyasync.ops import codecs as codec_ops

    api = "_fused_adamw_" if optim == "adamw" else "_fused_adam_"
    fused = getattr(torch, api, None)
    if fused is None:
        return None
    n, dev = ctx.n, ctx.device
    hyper = {
        "lr": kwargs["lr"], "beta1": kwargs["beta1"], "beta2": kwargs["beta2"], "eps": kwargs["eps"],
        "weight_decay": kwargs["weight_decay"], "amsgrad": False, "maximize": False,
    }

    def build() -> Candidate:
        param = param0.clone()
        exp_avg, exp_avg_sq = state0["exp_avg"].clone(), state0["exp_avg_sq"].clone()
        grad = torch.empty(n, device=dev)
        step = torch.tensor(float(kwargs["step"]), device=dev)  # torch.optim increments it before the op

        def fn() -> None:
            codec_ops.decode(payload, out=grad, alpha=GRAD_SCALE)
            fused([param], [grad], [exp_avg], [exp_avg_sq], [], [step], **hyper)

        return Candidate(fn, lambda: [param, exp_avg, exp_avg_sq])

    def check(mine: list[torch.Tensor], theirs: list[torch.Tensor]) -> dict[str, Any]:
        ok, err = _compare(mine, theirs, exact=False)
        return {f"torch_fused_{optim}_matches": ok, f"torch_fused_{optim}_max_abs_err": err}

    return Baseline(f"torch_fused_{optim}", build, check=check,
                    info={f"torch_fused_{optim}_call": f"pyasync decode, then torch.{api}"})


def all_cases() -> list[tuple[str, Callable[[Ctx], Case]]]:
    """(op name, builder) for every op, in run order."""
    cases: list[tuple[str, Callable[[Ctx], Case]]] = [
        ("flatten", case_flatten),
        ("unflatten", case_unflatten),
    ]
    cases += [(f"encode:{c}", lambda ctx, c=c: case_encode(ctx, c)) for c in CODECS]
    cases += [("encode:topk+dgc", case_encode_dgc)]
    cases += [(f"decode:{c}", lambda ctx, c=c: case_decode(ctx, c)) for c in CODECS]
    cases += [(f"apply:{o}:{c}", lambda ctx, o=o, c=c: case_apply(ctx, o, c)) for o in OPTIMS for c in CODECS]
    return cases


def select_cases(patterns: str | None) -> list[tuple[str, Callable[[Ctx], Case]]]:
    """Cases whose name equals, starts with (at a ':' boundary) or glob-matches one of the
    comma-separated `patterns` (None: all). Unknown patterns are a ValueError listing the names."""
    cases = all_cases()
    if not patterns:
        return cases
    pats = [p.strip() for p in patterns.split(",") if p.strip()]

    def hit(name: str, p: str) -> bool:
        return name == p or name.startswith(p + ":") or fnmatch.fnmatchcase(name, p)

    for p in pats:
        if not any(hit(name, p) for name, _ in cases):
            names = ", ".join(name for name, _ in cases)
            raise ValueError(f"--ops: {p!r} matches no op; ops are: {names} (prefixes and globs work too)")
    return [(name, b) for name, b in cases if any(hit(name, p) for p in pats)]


# ------------------------------------------------------------------------------------------------
# Running one case


def _compare(a: list[torch.Tensor], b: list[torch.Tensor], exact: bool) -> tuple[bool, float]:
    """(match, largest absolute difference) of two output lists; floats within rtol 1e-4 / atol 1e-5
    of the reference unless `exact`."""
    if len(a) != len(b):
        return False, float("inf")
    ok, worst = True, 0.0
    for x, y in zip(a, b):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False, float("inf")
        if x.numel() == 0:
            continue
        if x.is_floating_point():
            d = (x.float() - y.float()).abs()
            worst = max(worst, float(d.nan_to_num(nan=float("inf")).max()))
            close = torch.equal(x, y) if exact else torch.allclose(x, y, rtol=1e-4, atol=1e-5, equal_nan=True)
            ok &= bool(close)
        else:
            eq = bool(torch.equal(x, y))
            ok &= eq
            if not eq:
                worst = max(worst, float((x.long() - y.long()).abs().max()))
    return ok, worst


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def _compile(case: Case, device: torch.device) -> tuple[Candidate | None, dict[str, Any]]:
    """The reference under torch.compile (a fresh compile for this shape) and its first call;
    (None, {"compile_error": reason}) when compiling or running it fails."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    try:
        cand = case.reference(torch.compile(case.ref_fn, dynamic=False))
        t0 = time.perf_counter()
        cand.fn()
        bc.synchronize(device)
        return cand, {"compile_s": round(time.perf_counter() - t0, 2)}
    except Exception as e:
        torch._dynamo.reset()
        return None, {"compile_error": _first_line(e)}


def _compile_stats() -> dict[str, Any]:
    from torch._dynamo.utils import counters

    return {
        "compile_graphs": int(counters["stats"]["unique_graphs"]),
        "compile_graph_breaks": int(sum(counters["graph_break"].values())),
    }


def run_case(case: Case, ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    """Check the kernel against the eager reference, then time kernel, references and copy."""
    dev = ctx.device
    rec: dict[str, Any] = {"op": case.op, "kind": case.kind, "codec": None, "optim": None}
    rec.update(case.extra)
    rec.update({"numel": ctx.n, "device": dev.type, "threads": args.threads, "dtype": "float32"})

    kernel = case.pyasync()
    eager = case.reference(case.ref_fn)
    kernel.fn()
    eager.fn()
    bc.synchronize(dev)
    ok, err = _compare(kernel.outputs(), eager.outputs(), case.exact)
    rec["matches_reference"] = ok
    rec["max_abs_err"] = err
    base = None
    if case.baseline is not None:
        rec.update(case.baseline.info)
        base = case.baseline.build()
        base.fn()
        bc.synchronize(dev)
        if case.baseline.check is not None:
            rec.update(case.baseline.check(kernel.outputs(), base.outputs()))

    if args.no_compile:
        compiled, cinfo = None, {"compile_error": "disabled (--no-compile)"}
    else:
        compiled, cinfo = _compile(case, dev)
    copy_fn, copy_bytes = bc.copy_candidate(case.bytes, dev)
    fns: dict[str, Fn] = {"kernel": kernel.fn, "eager": eager.fn, "copy": copy_fn}
    if compiled is not None:
        fns["compiled"] = compiled.fn
    if base is not None:
        fns[case.baseline.name] = base.fn
    timings = bc.time_candidates(fns, device=dev, repeats=args.repeats, warmup=args.warmup,
                                 min_sample_s=args.min_sample_s, budget_s=args.budget_s)
    if compiled is not None:
        cinfo.update(_compile_stats())

    t = timings["kernel"]
    ms = t.median_ms
    copy_gbps = bc.gbps(copy_bytes, timings["copy"].median_ms)
    rec.update({
        "ms": ms, "ms_min": t.min_ms, "ms_iqr": t.iqr_ms, "repeats": len(t.samples_ms), "inner": t.inner,
        "samples": {name: len(tm.samples_ms) for name, tm in timings.items()},
        "bytes": case.bytes, "bytes_model": case.bytes_model,
        "gbps": bc.gbps(case.bytes, ms), "copy_gbps": copy_gbps, "copy_bytes": copy_bytes,
    })
    rec["copy_fraction"] = rec["gbps"] / copy_gbps
    rec["eager_ms"] = timings["eager"].median_ms
    rec["speedup_vs_eager"] = rec["eager_ms"] / ms
    rec["compile_ms"] = timings["compiled"].median_ms if compiled is not None else None
    rec["speedup_vs_compile"] = rec["compile_ms"] / ms if compiled is not None else None
    rec.update(dict.fromkeys(("compile_s", "compile_error", "compile_graphs", "compile_graph_breaks")))
    rec.update(cinfo)
    if base is not None:
        name = case.baseline.name
        rec[f"{name}_ms"] = timings[name].median_ms
        rec[f"speedup_vs_{name}"] = rec[f"{name}_ms"] / ms
    if dev.type == "cuda" and not args.no_device_time:
        busy = bc.device_busy(kernel.fn, dev, calls=args.device_time_calls)
        rec["device_ms"] = busy.ms
        rec["device_gbps"] = bc.gbps(case.bytes, busy.ms) if busy.ms else None
        rec["device_copy_fraction"] = rec["device_gbps"] / copy_gbps if rec["device_gbps"] else None
        rec["device_kernels"] = busy.kernels
        if busy.error:
            rec["device_time_error"] = busy.error
    return rec


# ------------------------------------------------------------------------------------------------
# Command line

TABLE = [
    ("op", "op"), ("numel", "numel"), ("ms", "ms"), ("ms_min", "min ms"), ("gbps", "GB/s"),
    ("copy_gbps", "copy GB/s"),
    ("copy_fraction", "of copy"), ("speedup_vs_eager", "x eager"), ("speedup_vs_compile", "x compile"),
    ("speedup_vs_torch_topk", "x topk"), ("speedup_vs_torch_fused_adam", "x fused adam"),
    ("matches_reference", "ok"),
]
DEVICE_COLUMNS = [("device_ms", "GPU busy ms"), ("device_copy_fraction", "busy of copy")]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the JSON list of records here (default: only print the table)")
    p.add_argument("--sizes", help="comma-separated element counts, K/M/G = 1e3/1e6/1e9 (default: 1M,25M)")
    p.add_argument("--ops", help="comma-separated ops, prefixes or globs, e.g. 'flatten,encode,apply:adam*' "
                                 "(default: all)")
    p.add_argument("--repeats", type=int, help="timed samples per candidate (default: 15; --quick: 5)")
    p.add_argument("--warmup", type=int, help="untimed calls per candidate first (default: 2; --quick: 1)")
    p.add_argument("--min-sample-ms", type=float, default=None,
                   help="shortest sample, ms; faster calls are repeated inside one sample "
                        "(default: 20 CPU, 2 CUDA)")
    p.add_argument("--budget-s", type=float, default=10.0,
                   help="sampling time cap per candidate and op, seconds; slower candidates (the references) "
                        "stop after at least 3 samples once they reach it (default 10; 0: no cap)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=int,
                   help="CPU threads for pyasync and torch alike (default: pyasync's default)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile reference")
    p.add_argument("--no-device-time", action="store_true",
                   help="CUDA: skip the profiler pass that measures the kernels' GPU busy time")
    p.add_argument("--device-time-calls", type=int, default=10,
                   help="CUDA: calls profiled for the GPU busy time (default 10)")
    p.add_argument("--quick", action="store_true", help="a dry run: 1M elements, 5 repeats, 1 warm-up call")
    p.add_argument("--block", type=int, default=256, help="int8/sign block (elements, default 256)")
    p.add_argument("--topk-ratio", type=float, default=0.01, help="top-k kept fraction (default 0.01)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", action="store_true", help="show torch.compile's warnings (graph breaks)")
    args = p.parse_args(argv)
    try:
        sizes = args.sizes or ("1M" if args.quick else "1M,25M")
        args.sizes = [bc.parse_size(s) for s in sizes.split(",") if s.strip()]
        if not args.sizes:
            raise ValueError("--sizes is empty")
        args.cases = select_cases(args.ops)
    except ValueError as e:
        p.error(str(e))
    args.repeats = args.repeats if args.repeats is not None else (5 if args.quick else 15)
    args.warmup = args.warmup if args.warmup is not None else 1 if args.quick else 2
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    if args.min_sample_ms is None:
        args.min_sample_ms = 2.0 if args.device == "cuda" else 20.0
    args.min_sample_s = args.min_sample_ms / 1e3
    if args.budget_s < 0:
        p.error("--budget-s must be >= 0 (0: no cap)")
    args.budget_s = args.budget_s or None
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA GPU")
    if not 0.0 < args.topk_ratio <= 1.0:
        p.error("--topk-ratio must be in (0, 1]")
    if args.device_time_calls < 1:
        p.error("--device-time-calls must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from pyasync import _ext

    try:
        _ext.C()
    except ImportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not _ext.has_cuda():
        print("error: --device cuda needs a pyasync build with CUDA kernels (PYASYNC_WITH_CUDA=ON)",
              file=sys.stderr)
        return 2
    if not args.verbose:
        # torch.compile warns at every graph break of the references (data-dependent Python
        # branches); the count is recorded in compile_graph_breaks instead.
        torch._logging.set_logs(dynamo=logging.ERROR)
    args.threads = bc.set_threads(args.threads)
    device = torch.device(args.device)
    machine = bc.machine_info(args.device)
    command = bc.command_line()
    records: list[dict[str, Any]] = []
    failed = 0
    for n in args.sizes:
        ctx = Ctx(n, device, args.seed, args.block, args.topk_ratio)
        for name, build in args.cases:
            t0 = time.perf_counter()
            try:
                rec = run_case(build(ctx), ctx, args)
            except Exception as e:
                failed += 1
                rec = {"op": name, "numel": n, "device": device.type, "threads": args.threads, "ms": None,
                       "error": _first_line(e)}
            rec["loadavg_1m"] = bc.loadavg()
            rec["machine"], rec["command"] = machine, command
            records.append(rec)
            bc.write_results(args.out, records)
            status = rec.get("error") or f"{rec['ms']:.3f} ms, {rec['copy_fraction']:.2f} of copy"
            print(f"[{time.perf_counter() - t0:6.1f} s] {name} n={n}: {status}", file=sys.stderr, flush=True)
            gc.collect()
    print()
    print(f"pyasync kernels on {machine['gpu']['name'] if machine['gpu'] else machine['cpu_model']}, "
          f"{args.threads} threads, torch {machine['torch']}, commit {str(machine['git']['commit'])[:12]}")
    print(bc.format_table(records, TABLE + (DEVICE_COLUMNS if device.type == "cuda" else [])))
    if failed:
        print(f"\n{failed} op(s) failed; see the 'error' field", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
