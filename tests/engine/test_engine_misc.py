"""Unused, frozen and tied parameters, bf16 parameters, no_sync, NaN gradients, state_dict, bad
arguments, and mismatched models across ranks (gloo, CPU)."""

import copy
import datetime
import io

import pytest
import torch
from _dist import multiproc, run_workers

TIMEOUT = datetime.timedelta(seconds=30)


class Net(torch.nn.Module):
    """A tied input/output matrix, a branch only rank 0 uses, a branch nobody uses, a frozen layer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Linear(6, 5, bias=False)
        self.mid = torch.nn.Linear(5, 5)
        self.rank0_only = torch.nn.Linear(5, 5)
        self.never = torch.nn.Linear(5, 5)
        self.frozen = torch.nn.Linear(5, 5)
        self.frozen.requires_grad_(False)

    def forward(self, x, use_branch):
        h = torch.tanh(self.mid(self.emb(x)))
        if use_branch:
            h = h + self.rank0_only(h)
        h = self.frozen(h)
        return h @ self.emb.weight  # tied: emb.weight used twice


def _sgd(m):
    # The frozen layer is in the optimizer too: it must be left alone.
    return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)


def _features(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import pyasync

    out = {}
    # 1. Unused / frozen / tied parameters under BSP equal DDP(find_unused_parameters=True).
    torch.manual_seed(
        0
    )  # frozen parameters are left alone (never broadcast): build the same model everywhere
    model = Net()
    ref = DDP(copy.deepcopy(model), find_unused_parameters=True)
    opt = pyasync.DistributedOptimizer(
        _sgd(model),
        policy="bsp",
        bucket_cap_mb=200 / 2**20,
        timeout=TIMEOUT,
        named_parameters=model.named_parameters(),
    )
    ref_opt = _sgd(ref.module)
    never0 = [p.detach().clone() for p in model.never.parameters()]
    frozen0 = [p.detach().clone() for p in model.frozen.parameters()]
    g = torch.Generator().manual_seed(100 + rank)
    worst = 0.0
    for _ in range(12):
        x = torch.randn(4, 6, generator=g)
        for o, m in ((opt, model), (ref_opt, ref)):
            o.zero_grad()
            m(x, rank == 0).pow(2).mean().backward()
            o.step()
        worst = max(
            worst,
            max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.module.parameters())),
        )
    out["ddp_worst"] = worst
    out["never_unchanged"] = all(torch.equal(a, b) for a, b in zip(never0, model.never.parameters()))
    out["frozen_unchanged"] = all(torch.equal(a, b) for a, b in zip(frozen0, model.frozen.parameters()))
    torch.manual_seed(0)
    out["branch_moved"] = (model.rank0_only.weight - Net().rank0_only.weight).abs().max().item() > 0
    out["n_params"] = sum(len(lay.params) for lay in opt.bucket_layouts)  # tied counted once, frozen excluded
    with opt:  # context manager closes; closing twice is fine
        pass
    opt.close()
    try:
        opt.step()
    except RuntimeError as e:
        out["step_after_close"] = str(e)

    # 2. no_sync accumulation, a late gradient, and a NaN gradient (counted, skipped, not applied).
    p = torch.nn.Parameter(torch.zeros(6))
    opt = pyasync.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), policy="bsp", timeout=TIMEOUT)
    with opt.no_sync():
        (-p.sum()).backward()
        (-p.sum()).backward()
    (-p.sum()).backward()  # the bucket goes out here, with the accumulated 3 * -1
    opt.step()
    out["no_sync"] = p.detach().clone()  # mean over ranks of 3 -> +3
    opt.zero_grad()
    before = p.detach().clone()
    (-p.sum()).backward()
    (-p.sum()).backward()  # a second backward after the hooks handed the bucket over: pushed as the sum
    opt.step()
    out["two_backwards"] = p.detach() - before  # the mean of 2 per rank: +2
    out["before_nan"] = p.detach().clone()
    opt.zero_grad()
    loss = -p.sum() * (float("nan") if rank == 1 else 1.0)
    loss.backward()
    opt.step()
    out["after_nan"] = p.detach().clone()
    out["nonfinite"] = opt.stats().nonfinite_skipped

    # 3. state_dict round trip into a fresh optimizer (this rank's shard, tensors only).
    sd = opt.state_dict()
    out["sd_ok"] = all(isinstance(v["master"], torch.Tensor) for v in sd["shards"].values())
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)  # nothing but tensors and plain containers/numbers/strings
    opt.close()
    q = torch.nn.Parameter(torch.full((6,), 7.0))
    opt2 = pyasync.DistributedOptimizer(torch.optim.SGD([q], lr=1.0), policy="bsp", timeout=TIMEOUT)
    opt2.load_state_dict(sd)
    sd2 = opt2.state_dict()
    out["sd_equal"] = all(
        torch.equal(sd["shards"][k]["master"], sd2["shards"][k]["master"]) for k in sd["shards"]
    )
    opt2.close()

    # 4. bf16 parameters: fp32 masters, installed as bf16; replicas equal an fp32-master reference.
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8).to(torch.bfloat16)
    master = [p.detach().float().clone() for p in lin.parameters()]
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD(lin.parameters(), lr=0.1), policy="bsp", timeout=TIMEOUT
    )
    g = torch.Generator().manual_seed(rank)
    for _ in range(5):
        x = torch.randn(4, 8, generator=g).to(torch.bfloat16)
        opt.zero_grad()
        lin(x).float().pow(2).mean().backward()
        grads = [p.grad.float() for p in lin.parameters()]
        for gr in grads:
            torch.distributed.all_reduce(gr)
        for m_, gr in zip(master, grads):
            m_.add_(gr / world, alpha=-0.1)
        opt.step()
    out["bf16_dtype"] = lin.weight.dtype
    out["bf16_err"] = max(
        (p.float() - m_.to(torch.bfloat16).float()).abs().max().item()
        for p, m_ in zip(lin.parameters(), master)
    )
    opt.close()

    # 5b. sparse gradients (nn.Embedding(sparse=True)) are densified: same result as dense ones.
    weights = []
    for sparse in (True, False):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 3, sparse=sparse)
        opt = pyasync.DistributedOptimizer(
            torch.optim.SGD(emb.parameters(), lr=0.5), policy="bsp", timeout=TIMEOUT
        )
        for t in range(3):
            opt.zero_grad()
            emb(torch.tensor([rank, t + 4])).pow(2).sum().backward()
            opt.step()
        opt.close()
        weights.append(emb.weight.detach().clone())
    out["sparse_equal"] = torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[0] * 0)

    # 5. bad arguments that need a process group.
    errs = {}
    for name, make in {
        "quorum_k": lambda: pyasync.DistributedOptimizer(
            torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1), policy=pyasync.Quorum(world + 1)
        ),
        "lbfgs": lambda: pyasync.DistributedOptimizer(
            torch.optim.LBFGS([torch.nn.Parameter(torch.zeros(2))])
        ),
        "nothing": lambda: pyasync.DistributedOptimizer(torch.optim.SGD([torch.zeros(2)], lr=1)),
        "int_params": lambda: pyasync.DistributedOptimizer(
            torch.optim.SGD(
                [torch.nn.Parameter(torch.zeros(2)), torch.zeros(2, dtype=torch.float64, requires_grad=True)],
                lr=1,
            )
        ),
    }.items():
        try:
            make()
            errs[name] = None
        except (TypeError, ValueError) as e:
            errs[name] = f"{type(e).__name__}: {e}"
    out["errors"] = errs
    return out


@multiproc
def test_features():
    res = run_workers(_features, 2, timeout=150)
    for r, o in enumerate(res):
        assert o["ddp_worst"] < 2e-5, (
            f"rank {r}: unused/tied/frozen model differs from DDP by {o['ddp_worst']}"
        )
        assert o["never_unchanged"] and o["frozen_unchanged"] and o["branch_moved"]
        assert o["n_params"] == 7  # emb.weight once + mid, rank0_only, never (2 each); frozen excluded
        assert "after close()" in o["step_after_close"]
        assert torch.equal(o["no_sync"], torch.full((6,), 3.0))
        assert torch.equal(o["two_backwards"], torch.full((6,), 2.0))
        assert o["sd_ok"] and o["sd_equal"]
        assert o["sparse_equal"]
        assert o["bf16_dtype"] == torch.bfloat16 and o["bf16_err"] <= 1e-2
        e = o["errors"]
        assert "Quorum k=3 exceeds" in e["quorum_k"]
        assert "LBFGS" in e["lbfgs"]
        assert "requires_grad=True" in e["nothing"]
        assert "float64" in e["int_params"]
    # The NaN push of rank 1 was skipped (counted on the owner) and nothing became NaN.
    after = res[0]["after_nan"]
    assert torch.isfinite(after).all() and all(torch.equal(after, o["after_nan"]) for o in res)
    assert sum(o["nonfinite"] for o in res) >= 1
    # BSP: rank 0's push (+1 / n each) applied, rank 1's NaN push counts as zeros in the mean.
    assert torch.equal(after, res[0]["before_nan"] + 0.5)


def _mismatch(rank, world):
    import pyasync
    from pyasync.session.agree import AgreementError

    def attempt(**kw):
        shape = kw.pop("shape", (4, 3))
        extra = kw.pop("extra", False)
        frozen = kw.pop("frozen", False)
        ps = [torch.nn.Parameter(torch.zeros(shape)), torch.nn.Parameter(torch.zeros(5))]
        ps[0].requires_grad_(not frozen)
        if extra:
            ps.append(torch.nn.Parameter(torch.zeros(1)))
        try:
            o = pyasync.DistributedOptimizer(torch.optim.SGD(ps, lr=0.1), timeout=TIMEOUT, **kw)
        except AgreementError as e:
            return str(e)
        o.close()
        return None

    last = rank == world - 1
    return {
        "shape": attempt(shape=(4, 4) if last else (4, 3)),
        "extra": attempt(extra=last),
        "frozen": attempt(frozen=last),
        "policy": attempt(policy="ssp:1" if last else "ssp:2"),
        "compression": attempt(compression="int8" if last else None),
        "layout": attempt(bucket_cap_mb=25 if last else 20 / 2**20),
        "same": attempt(),
    }


@multiproc
def test_mismatched_ranks_fail_with_the_same_clear_error_everywhere():
    res = run_workers(_mismatch, 3, timeout=90)
    for key, needle in [
        ("shape", "shape=(4, 4)"),
        ("extra", "(nothing)"),
        ("frozen", "requires_grad=False"),
        ("policy", "ssp:1"),
        ("compression", "int8"),
        ("layout", "bucket layout"),
    ]:
        msgs = {r[key] for r in res}
        assert len(msgs) == 1, f"{key}: ranks raised different errors {msgs}"
        msg = msgs.pop()
        assert msg is not None and needle in msg and "rank 2" in msg, msg
    assert all(r["same"] is None for r in res)


def test_bad_arguments_without_processes():
    import pyasync

    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        pyasync.DistributedOptimizer("sgd")
    with pytest.raises(ValueError, match="unknown policy"):
        pyasync.DistributedOptimizer(sgd, policy="fast")
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        pyasync.DistributedOptimizer(sgd, bucket_cap_mb=0)
    with pytest.raises(TypeError, match="timeout"):
        pyasync.DistributedOptimizer(sgd, timeout=5)
    with pytest.raises(ValueError, match="compression"):
        pyasync.DistributedOptimizer(sgd, compression="zip")
    with pytest.raises(ValueError, match="num_appliers"):
        pyasync.DistributedOptimizer(sgd, num_appliers=0)
    if not torch.distributed.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            pyasync.DistributedOptimizer(sgd)


def _absent_rank(rank, world, released, policy="bsp:p2p"):
    import pyasync

    p = torch.nn.Parameter(torch.zeros(4 * world))
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD([p], lr=1.0), policy=policy, timeout=datetime.timedelta(seconds=3)
    )
    msg = None
    if rank == 1:
        assert released.wait(60)  # absent until rank 0 has seen its timeout
    opt.zero_grad()
    (-p.sum()).backward()
    if rank == 0:
        try:
            opt.step()  # rank 1 has not pushed: BSP cannot complete clock 0
        except TimeoutError as e:
            msg = str(e)
        released.set()
    else:
        opt.step()
    opt.close()  # both still finish together, with equal parameters
    return msg, p.detach().clone()


@multiproc
def test_a_missing_rank_gives_a_timeout_naming_it():
    import torch.multiprocessing as mp

    released = mp.get_context("spawn").Event()
    res = run_workers(_absent_rank, 2, args=(released,), timeout=90)
    msg = res[0][0]
    assert msg is not None and "waiting for pushes from worker ranks [1]" in msg and "step 0" in msg, msg
    assert torch.equal(res[0][1], res[1][1]) and torch.equal(res[0][1], torch.ones(8))


def _cuda_run(rank, world):
    import pyasync

    torch.cuda.set_device(rank % torch.cuda.device_count())
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4).cuda()
    opt = pyasync.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), policy="ssp:1", compression="int8", timeout=TIMEOUT
    )
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(8, 16, device="cuda")).pow(2).mean().backward()
        opt.step()
    opt.close()
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.cuda
@multiproc
def test_cuda_parameters_through_gloo_with_host_staging():
    res = run_workers(_cuda_run, 2, timeout=120)
    assert all(torch.equal(a, b) for a, b in zip(res[0], res[1]))


def _corrupt_header(rank, world, sent):
    import pyasync
    from pyasync.engine import wire
    from pyasync.engine.core.clock import EngineError

    p = torch.nn.Parameter(torch.zeros(4 * world))
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD([p], lr=1.0), policy="asp", timeout=datetime.timedelta(seconds=5)
    )
    if rank == 1:
        bad = wire.encode_header(
            wire.Header(
                kind=wire.PUSH, sender=1, clock=0, version=0, bucket=0, shard=0, codec=7, numel=4, nbytes=16
            )
        )
        opt._engine.transport.send(bad.view(torch.uint8), 0, "push").wait(datetime.timedelta(seconds=5))
        sent.set()
        msg = None
    else:
        assert sent.wait(60)
        msg = None
        for _ in range(100):  # the receiver thread reports the bad header; every later call raises it
            try:
                opt.zero_grad()
                (-p.sum()).backward()
                opt.step()
            except EngineError as e:
                msg = str(e)
                break
    try:
        opt.close()
    except (EngineError, TimeoutError, pyasync.PeerFailure) as e:
        msg = msg or f"{type(e).__name__}: {e}"
    return msg


@multiproc
def test_corrupt_header_is_a_clear_error_naming_the_sender():
    import torch.multiprocessing as mp

    sent = mp.get_context("spawn").Event()
    res = run_workers(_corrupt_header, 2, args=(sent,), timeout=90)
    assert "owner receiver thread" in res[0] and "rank 1" in res[0] and "codec" in res[0], res[0]
    # The peer cannot finish with a failed rank, and must not hang: the failed rank stops its engine
    # (close() after a failure), so the peer sees its connections end without a goodbye: PeerFailure
    # naming rank 0 (or, had it not stopped, the timeout naming the rank that never closed).
    assert res[1] is not None, "the peer of a failed rank finished as if nothing happened"
    assert (
        "PeerFailure" in res[1] and "rank 0 failed" in res[1]
    ) or "not seen worker ranks [0] close" in res[1], res[1]


def _subgroup(rank, world):
    import torch.distributed as dist

    import pyasync

    group = dist.new_group([0, 2])  # rank 1 trains nothing
    if rank == 1:
        return None
    torch.manual_seed(rank)  # different starting points: group rank 0's values are broadcast
    p = torch.nn.Parameter(torch.randn(6))
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD([p], lr=0.5), policy="ssp:0", process_group=group, timeout=TIMEOUT
    )
    for _ in range(4):
        opt.zero_grad()
        (p * (rank + 1)).sum().backward()  # gradient 1 on rank 0, 3 on rank 2
        opt.step()
    opt.close()
    return p.detach().clone(), opt.rank, opt.world_size


@multiproc
def test_a_process_group_of_some_ranks():
    res = run_workers(_subgroup, 3, timeout=90)
    torch.manual_seed(0)
    p0 = torch.randn(6)
    assert res[1] is None and (res[0][1], res[0][2]) == (0, 2) and (res[2][1], res[2][2]) == (1, 2)
    assert torch.equal(res[0][0], res[2][0])
    assert torch.allclose(res[0][0], p0 - 0.5 * 4 * (1 + 3) / 2)  # 4 steps of the mean gradient 2


def _late_for_a_collective(rank, world, released):
    import pyasync

    p = torch.nn.Parameter(torch.zeros(4 * world))
    opt = pyasync.DistributedOptimizer(
        torch.optim.SGD([p], lr=1.0), policy="bsp", timeout=datetime.timedelta(seconds=3)
    )
    opt.zero_grad()
    (-p.sum()).backward()
    opt.step()  # step 0 together
    if rank == 1:
        assert released.wait(60)  # rank 1 skips step 1 until rank 0 has given up on it
        return None
    (-p.sum()).backward()
    try:
        opt.step()
        msg = None
    except pyasync.PeerFailure as e:
        msg = (e.ranks, str(e))
    released.set()
    try:
        opt.step()  # the failure stays: every later call raises it
        again = None
    except pyasync.PeerFailure as e:
        again = e.ranks
    opt.close()
    return msg, again


@multiproc
def test_bsp_on_collectives_names_a_rank_that_does_not_come():
    import torch.multiprocessing as mp

    released = mp.get_context("spawn").Event()
    (msg, again), _ = run_workers(_late_for_a_collective, 2, args=(released,), timeout=120)
    assert msg is not None and msg[0] == (1,) and "did not reach step 1" in msg[1], msg
    assert again == (1,)
