"""Hostile payloads for pyasync.ops.codecs.decode and pyasync.ops.apply (sgd_apply / adam_apply).

Payloads are built from random tensors (a real encode of a random gradient, or random codes), then
mutated: wrong or huge n, bogus codec/block/k, tensors of the wrong dtype, size, layout or device,
missing tensors, top-k indices out of range / unsorted / duplicated, aliasing state tensors, and
nonsense hyperparameters. Property: the wrapper either raises ValueError/TypeError with a message, or
computes exactly what the pure-torch reference (pyasync.reference) computes for the same arguments.
Never another exception, a crash (under scripts/sanitize.sh: never an out-of-bounds access) or an
allocation sized by an unchecked field (a claimed n of 2^40 would need 4 TiB: it must be refused).

Hypothesis runs derandomized with no deadline, so CI sees the same examples on every run.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pyasync.ops import apply as ops_apply
from pyasync.ops import codecs as ops_codecs
from pyasync.ops._common import CODEC_IDS, Payload
from pyasync.reference import apply as ref_apply
from pyasync.reference import codecs as ref_codecs

FUZZ = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
ALLOWED = (ValueError, TypeError)
CODECS = sorted(CODEC_IDS)
NASTY_INTS = [0, 1, -1, 2, 7, 8, 9, 255, 2**20, 2**20 + 1, 2**31 - 1, 2**31, 2**40, 2**62, -(2**63)]
NASTY_VALUES = NASTY_INTS + [True, False, None, 1.5, float("nan"), "3", -0.0]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def base_payload(codec: str, n: int, block: int, seed: int, raw: bool) -> Payload:
    """A well-formed payload of n elements: a real encode of a random gradient (with a few non-finite
    values), or (raw=True) random code bytes and scales straight from a generator."""
    g = gen(seed)
    k = max(1, n // 3) if codec == "topk" else 0
    if not raw or codec == "topk":
        grad = torch.randn(n, generator=g) * 10
        if n > 2 and seed % 5 == 0:
            grad[seed % n] = float("inf")
        return ops_codecs.encode(codec, grad, block=block, k=k)
    p = ops_codecs.empty_payload(codec, n, block=block, k=k)
    p.codes.view(torch.uint8).copy_(torch.randint(0, 256, (p.codes.numel() * p.codes.element_size(),),
                                                  dtype=torch.uint8, generator=g))
    if p.scales is not None:
        p.scales.copy_(torch.randn(p.scales.numel(), generator=g).abs() * 4)
    return p


def mutate(p: Payload, what: str, value, seed: int) -> Payload:
    """A shallow copy of p with one thing broken."""
    q = replace(p)
    g = gen(seed)
    if what in ("n", "codec", "block", "k", "finite"):
        setattr(q, what, value)
    elif what in ("codes", "scales", "indices"):
        t = getattr(p, what)
        base = t if t is not None else torch.zeros(3)
        if value == "none":
            new = None
        elif value == "float64":
            new = base.double()
        elif value == "int64":
            new = base.long()
        elif value == "shorter":
            new = base[: max(0, base.numel() - 1)].clone()
        elif value == "longer":
            new = torch.cat([base, base[:1] if base.numel() else torch.zeros(1, dtype=base.dtype)])
        elif value == "strided":
            new = torch.stack([base, base], dim=1).reshape(-1)[::2]  # same values, stride 2
        elif value == "meta":
            new = torch.empty(base.shape, dtype=base.dtype, device="meta")
        elif value == "list":  # not a tensor at all
            new = base.tolist()
        else:  # "random": random values of the right dtype/size (indices: anything in int32)
            if base.dtype.is_floating_point:
                new = torch.randn(base.numel(), generator=g).to(base.dtype)
            else:
                info = torch.iinfo(base.dtype)
                m = p.n if isinstance(p.n, int) and p.n > 0 else 1
                lo, hi = (info.min, info.max) if base.dtype != torch.int32 else (-m - 3, 2 * m + 3)
                new = torch.randint(lo, hi, (base.numel(),), generator=g).to(base.dtype)
        setattr(q, what, new)
    return q


TENSOR_MUTATIONS = ["none", "float64", "int64", "shorter", "longer", "strided", "meta", "list", "random"]
mutations = st.one_of(
    st.tuples(st.just("valid"), st.none()),
    st.tuples(st.sampled_from(["n", "block", "k"]), st.sampled_from(NASTY_VALUES)),
    st.tuples(st.just("n"), st.integers(-3, 400)),
    st.tuples(st.just("codec"), st.sampled_from(CODECS + ["int4", "", None, 3, b"int8"])),
    st.tuples(st.just("finite"), st.booleans()),
    st.tuples(st.sampled_from(["codes", "scales", "indices"]), st.sampled_from(TENSOR_MUTATIONS)),
)
payload_args = st.fixed_dictionaries({
    "codec": st.sampled_from(CODECS),
    "n": st.one_of(st.integers(1, 70), st.sampled_from([255, 257, 300])),
    "block": st.one_of(st.integers(1, 40), st.sampled_from([64, 256])),
    "seed": st.integers(0, 2**31 - 1),
    "raw": st.booleans(),
    "mutation": mutations,
})


def build(args: dict) -> Payload:
    p = base_payload(args["codec"], args["n"], args["block"], args["seed"], args["raw"])
    what, value = args["mutation"]
    return p if what == "valid" else mutate(p, what, value, args["seed"] + 1)


def allowed_error(e: BaseException) -> None:
    assert isinstance(e, ALLOWED), f"{type(e).__name__}: {e}"
    assert str(e), "an error must say what is wrong"
    event(f"refused: {type(e).__name__}")


# ---------------------------------------------------------------------------------------------------
# decode


@FUZZ
@given(args=payload_args, alpha=st.one_of(st.floats(-4, 4), st.sampled_from([0.0, float("nan"), True, "1"])),
       accumulate=st.one_of(st.booleans(), st.just(1)), out_kind=st.sampled_from(["none", "ok", "bad"]))
def test_decode_hostile_payloads(args, alpha, accumulate, out_kind):
    p = build(args)
    out = None
    n_ok = isinstance(p.n, int) and not isinstance(p.n, bool) and 0 <= p.n <= 4096
    if out_kind == "ok" and n_ok:
        out = torch.randn(p.n, generator=gen(args["seed"] + 2))
    elif out_kind == "bad":
        out = torch.zeros(3, dtype=torch.float64)
    out_before = None if out is None else out.clone()
    try:
        got = ops_codecs.decode(p, out=out, alpha=alpha, accumulate=accumulate)
    except Exception as e:
        allowed_error(e)
        if out_before is not None:  # refused before the kernel ran: out is untouched
            assert torch.equal(out, out_before)
        return
    event("accepted")
    # Accepted: same answer as the reference on the same (now known well-formed) payload.
    want_out = None if out_before is None else out_before.clone()
    want = ref_codecs.decode(p, out=want_out, alpha=alpha, accumulate=accumulate)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("n", [2**31, 2**40, 2**62], ids=["2^31", "2^40", "2^62"])
def test_decode_refuses_a_huge_claimed_n_without_allocating(codec, n):
    """n is only a claim: the tensors hold far fewer elements, so check_payload refuses it before
    decode allocates `out` (torch.empty(2^40) would need 4 TiB and fail with a RuntimeError)."""
    p = base_payload(codec, 64, 16, 3, raw=False)
    p = replace(p, n=n)
    with pytest.raises(ValueError, match=r"payload\.(codes|k)"):
        ops_codecs.decode(p)


@pytest.mark.parametrize("bad, match", [
    ([5, 3, 9], "strictly ascending"),
    ([1, 1, 9], "strictly ascending"),
    ([-1, 3, 9], r"lie in \[0, n=10\)"),
    ([1, 3, 10], r"lie in \[0, n=10\)"),
    ([1, 3, 2**31 - 1], r"lie in \[0, n=10\)"),
    ([-(2**31), 3, 9], r"lie in \[0, n=10\)"),
])
def test_decode_rejects_bad_topk_indices(bad, match):
    p = Payload(codec="topk", n=10, codes=torch.ones(3), indices=torch.tensor(bad, dtype=torch.int32), k=3)
    out = torch.full((10,), 7.0)
    with pytest.raises(ValueError, match=match):
        ops_codecs.decode(p, out=out, accumulate=True)
    assert torch.equal(out, torch.full((10,), 7.0)), "a rejected payload must not write to out"


@FUZZ
@given(n=st.integers(1, 200), seed=st.integers(0, 2**31 - 1), k_frac=st.floats(0.01, 1.0))
def test_decode_random_topk_indices(n, seed, k_frac):
    """Random int32 indices (some in range, some not, sorted or not): an error, or the exact scatter."""
    g = gen(seed)
    k = max(1, min(n, int(k_frac * n)))
    idx = torch.randint(-2, n + 2, (k,), generator=g, dtype=torch.int64)
    if seed % 2:
        idx = idx.sort().values
    idx = idx.to(torch.int32)
    vals = torch.randn(k, generator=g)
    p = Payload(codec="topk", n=n, codes=vals, indices=idx, k=k)
    try:
        got = ops_codecs.decode(p)
    except Exception as e:
        allowed_error(e)
        ok = bool((idx >= 0).all() and (idx < n).all() and (k == 1 or (idx[1:] > idx[:-1]).all()))
        assert not ok, f"valid indices rejected: {e}"
        return
    event("accepted")
    assert bool((idx[1:] > idx[:-1]).all()) and int(idx.min()) >= 0 and int(idx.max()) < n
    want = torch.zeros(n)
    want[idx.long()] = vals
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------
# apply


def _hyper(kind: str, seed: int, nasty_name: str | None, nasty_value) -> dict:
    g = gen(seed)
    u = torch.rand(4, generator=g).tolist()
    if kind == "sgd":
        momentum = [0.0, 0.9][seed % 2]
        h = {"lr": 0.01 + u[0], "momentum": momentum, "dampening": 0.0 if seed % 3 else 0.1,
             "nesterov": bool(seed % 3 == 0 and momentum > 0), "weight_decay": u[1] * 0.1,
             "maximize": bool(seed % 7 == 0), "first_step": bool(seed % 4 == 0)}
    else:
        h = {"lr": 0.01 + u[0] * 0.1, "beta1": 0.8 + 0.19 * u[1], "beta2": 0.9 + 0.099 * u[2],
             "eps": 1e-8, "weight_decay": u[3] * 0.1, "decoupled_weight_decay": bool(seed % 2),
             "maximize": bool(seed % 5 == 0), "step": 1 + seed % 9}
    if nasty_name is not None and nasty_name in h:
        h[nasty_name] = nasty_value
    return h


def _state(kind: str, n: int, seed: int, alias: str | None, param: torch.Tensor) -> dict:
    g = gen(seed)
    if kind == "sgd":
        st_ = {"momentum_buffer": torch.randn(n, generator=g)}
    else:
        st_ = {"exp_avg": torch.randn(n, generator=g) * 0.1, "exp_avg_sq": torch.rand(n, generator=g) * 0.01}
    if alias == "param":
        st_[next(iter(st_))] = param  # a state tensor that IS the parameter
    elif alias == "each_other" and kind == "adam":
        st_["exp_avg_sq"] = st_["exp_avg"]
    elif alias == "wrong_size":
        k0 = next(iter(st_))
        st_[k0] = torch.zeros(n + 1)
    elif alias == "missing" and kind == "sgd":
        st_["momentum_buffer"] = None
    elif alias == "two_d":
        k0 = next(iter(st_))
        st_[k0] = st_[k0].reshape(1, n)
    return st_


HYPER_NAMES = ["lr", "momentum", "dampening", "nesterov", "weight_decay", "maximize", "first_step", "beta1",
               "beta2", "eps", "decoupled_weight_decay", "step"]


@FUZZ
@given(
    args=payload_args,
    kind=st.sampled_from(["sgd", "adam"]),
    with_dense=st.booleans(),
    grad_scale=st.one_of(st.floats(-2, 2), st.sampled_from([float("inf"), float("nan"), True])),
    nasty=st.one_of(st.none(), st.tuples(st.sampled_from(HYPER_NAMES),
                                         st.sampled_from([-1.0, 0.0, 1.0, 2.0, float("nan"), float("inf"),
                                                          True, 0, 1, "0.1", None]))),
    alias=st.sampled_from([None, None, None, "param", "each_other", "wrong_size", "missing", "two_d"]),
)
def test_apply_hostile_payloads_and_arguments(args, kind, with_dense, grad_scale, nasty, alias):
    p = build(args)
    n = args["n"]
    seed = args["seed"]
    param = torch.randn(n, generator=gen(seed + 3))
    dense = torch.randn(n, generator=gen(seed + 4)) if with_dense else None
    hyper = _hyper(kind, seed, *(nasty or (None, None)))
    state = _state(kind, n, seed, alias, param)
    fn = ops_apply.sgd_apply if kind == "sgd" else ops_apply.adam_apply
    ref = ref_apply.sgd_apply if kind == "sgd" else ref_apply.adam_apply
    # The reference gets deep copies taken before the kernel runs (the kernel writes in place).
    ref_param = param.clone()
    ref_state = {k: (None if v is None else v.clone()) for k, v in state.items()}
    if alias == "param":
        ref_state[next(iter(ref_state))] = ref_param
    if alias == "each_other" and kind == "adam":
        ref_state["exp_avg_sq"] = ref_state["exp_avg"]
    ref_payload = copy.copy(p)
    try:
        fn(param, payload=p, grad_scale=grad_scale, dense=dense, dense_scale=0.5, **hyper, **state)
    except Exception as e:
        allowed_error(e)
        return
    event("accepted")
    ref(ref_param, payload=ref_payload, grad_scale=grad_scale, dense=dense, dense_scale=0.5, **hyper,
        **ref_state)
    torch.testing.assert_close(param, ref_param, rtol=2e-5, atol=1e-6, equal_nan=True)
    for name in state:
        torch.testing.assert_close(state[name], ref_state[name], rtol=2e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("codec", CODECS)
def test_apply_refuses_a_payload_for_another_size(codec):
    p = base_payload(codec, 40, 8, 1, raw=False)
    param = torch.zeros(41)
    with pytest.raises(ValueError, match="holds 40 elements but 41 were expected"):
        ops_apply.sgd_apply(param, payload=p, lr=0.1)
    assert torch.equal(param, torch.zeros(41))


@pytest.mark.parametrize("codec", CODECS)
def test_apply_refuses_a_huge_claimed_n(codec):
    p = replace(base_payload(codec, 40, 8, 1, raw=False), n=2**40)
    with pytest.raises(ValueError):
        ops_apply.adam_apply(torch.zeros(40), payload=p, lr=0.1, step=1, exp_avg=torch.zeros(40),
                             exp_avg_sq=torch.zeros(40))


@pytest.mark.cuda
@pytest.mark.parametrize("accumulate", [False, True])
def test_cuda_decode_skips_out_of_range_topk_indices(accumulate):
    """On CUDA the wrapper does not read the indices back (no host sync): the kernel must skip those
    outside [0, n) instead of writing outside `out` (run under compute-sanitizer to see the difference)."""
    n = 1000
    idx = torch.tensor([-(2**31), -1, 0, 17, 999, 1000, 4096, 2**31 - 1], dtype=torch.int32)
    vals = torch.arange(1, idx.numel() + 1, dtype=torch.float32)
    p = Payload(codec="topk", n=n, codes=vals.cuda(), indices=idx.cuda(), k=idx.numel())
    guard = torch.full((3 * n,), 5.0, device="cuda")  # out is the middle third: writes outside show up
    out = guard[n : 2 * n]
    ops_codecs.decode(p, out=out, accumulate=accumulate)
    torch.cuda.synchronize()
    base = 5.0 if accumulate else 0.0
    want = torch.full((n,), base)
    for i, v in zip(idx.tolist(), vals.tolist()):
        if 0 <= i < n:
            want[i] += v
    torch.testing.assert_close(out.cpu(), want, rtol=0, atol=0)
    assert bool((guard[:n] == 5.0).all()) and bool((guard[2 * n :] == 5.0).all())
