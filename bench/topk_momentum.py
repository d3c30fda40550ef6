"""Why top-k fails with momentum: a one-process model of BSP with top-k on the ``seq`` workload.

    python bench/topk_momentum.py --out bench/results/topk_momentum/topk_momentum.json
    python bench/topk_momentum.py --variants dense,topk,dgc --ratios 0.01 --seeds 0 --steps 64   # quick
    python bench/topk_momentum.py --variants dgc --ratios 0.01 --warmup 64 --out ...   # DGC's warm-up

Four workers compute their gradients at the same weights (BSP, exact replies, no timing), each sends
top-k of every quarter of the flat gradient (the four owners' shards) through its own
:class:`pyasync.compression.TopK`, and the mean of what was sent updates the model, as the owners do.
Variants (see Note [Momentum correction for top-k] in csrc/include/pyasync/math/topk.h):

    dense        uncompressed momentum SGD (the reference)
    topk         top-k of the gradient with error feedback; the owner's momentum (TopK dgc="off")
    dgc          momentum correction with factor masking (DGC; TopK's default under SGD momentum at 1%)
    dgc-nomask   momentum correction without factor masking (TopK mask=False)
    dgc-auto     momentum correction, masking by TopK's default rule (mask="auto": where the kept
                 fraction < 1 - momentum); the same as dgc at 1%, and what a warm-up should use
    sgd-dense    no momentum at lr / (1 - mu): momentum SGD's steady-state step, without the momentum
    sgd-topk     top-k of the gradient with error feedback at that lr, no momentum anywhere

Each record gives the final test token accuracy and two measured quantities of the top-k runs:
``age_p50``/``age_p90``, the steps since an element was last sent by its worker, over every value sent,
weighted by |value| (how late error feedback delivers the gradient's mass), and ``owed``, the norm of
what the workers still owe at the end (residuals) over the norm of what they sent. One core, ~10 s per
run; nothing here depends on timing.

``--warmup W`` models DGC's sparsity warm-up (Lin et al. 2018, section 3.3): the kept fraction falls
geometrically from ``--warmup-from`` (0.25, DGC's first) to the ratio over the first W steps (under
``dgc-auto`` factor masking follows TopK's "auto" rule at each step's fraction). The library has no
such schedule (its wire agrees on one k per shard); this measures whether one would pay first.
``mean_ratio`` is the kept fraction averaged over the run's sends.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time

import _path  # noqa: F401  (puts the repository on sys.path)
import torch
import torch.nn.functional as F
from harness.seqtask import load_sort_split, make_seq_model

from pyasync.compression import TopK

VARIANTS = ("dense", "topk", "dgc", "dgc-nomask", "dgc-auto", "sgd-dense", "sgd-topk")
_MASK = {"dgc": True, "dgc-nomask": False, "dgc-auto": "auto"}
WORKERS, BATCH, LR, MU = 4, 64, 0.03, 0.9  # the seq workload's (bench/harness/workload.py MODELS["seq"])


def _compressor(variant: str, ratio: float, mu: float) -> TopK | None:
    if variant in ("dense", "sgd-dense"):
        return None
    dgc = "off" if variant in ("topk", "sgd-topk") else "on"
    comp = TopK(ratio=ratio, dgc=dgc, mask=_MASK.get(variant, True))
    comp.bind_momentum(mu)
    return comp


def warm_ratio(ratio: float, t: int, warmup: int, start: float) -> float:
    """The kept fraction at step ``t`` (1-based) of a sparsity warm-up of ``warmup`` steps from ``start``."""
    if warmup <= 0 or t > warmup or start <= ratio:
        return ratio
    return start * (ratio / start) ** ((t - 1) / warmup)


def run(variant: str, ratio: float, seed: int, steps: int, warmup: int = 0, warm_from: float = 0.25) -> dict:
    """One run; returns its record. ``warmup``: steps of sparsity warm-up from ``warm_from`` (0: none)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    plain = variant.startswith("sgd-")
    lr, mu = (LR / (1.0 - MU), 0.0) if plain else (LR, MU)
    data = load_sort_split(seed)
    net = make_seq_model(64, seed, data.x_train.shape[1])
    params = list(net.parameters())
    n = sum(p.numel() for p in params)
    shards = [(n * r // WORKERS, n * (r + 1) // WORKERS) for r in range(WORKERS)]
    comps = [_compressor(variant, ratio, mu) for _ in range(WORKERS)]
    owner_momentum = mu if comps[0] is None or comps[0].momentum is None else 0.0
    buf = torch.zeros(n)
    last_sent = torch.zeros(WORKERS, n, dtype=torch.int64)
    ages, weights = [], []
    sent_sq, kept = 0.0, []
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    for t in range(1, steps + 1):
        mean = torch.zeros(n)
        r_t = warm_ratio(ratio, t, warmup, warm_from)
        for c in comps:  # the warm-up: the compressor reads its fraction at every encode
            if c is not None and r_t != c.topk_ratio:
                c.set_ratio(r_t)  # mask="auto" resolved again at this step's fraction
        if comps[0] is not None:
            kept.append(r_t)
        for w in range(WORKERS):
            idx = torch.randint(0, data.x_train.shape[0], (BATCH,), generator=gen)
            net.zero_grad()
            F.cross_entropy(net(data.x_train[idx]), data.y_train[idx]).backward()
            g = torch.cat([p.grad.reshape(-1) for p in params])
            if comps[w] is None:
                mean += g
                continue
            for r, (a, z) in enumerate(shards):
                pay = comps[w].compress(g[a:z].contiguous(), key=r)
                i = pay.indices.long() + a
                mean.index_add_(0, i, pay.codes)
                ages.append((t - last_sent[w, i]).float())
                weights.append(pay.codes.abs())
                last_sent[w, i] = t
                sent_sq += float(pay.codes.double().square().sum())
        mean /= WORKERS
        with torch.no_grad():
            buf = owner_momentum * buf + mean if owner_momentum else mean
            off = 0
            for p in params:
                p -= lr * buf[off : off + p.numel()].view_as(p)
                off += p.numel()
    with torch.no_grad():
        acc = float((net(data.x_test).argmax(1) == data.y_test).float().mean())
    rec = {"variant": variant, "ratio": ratio if comps[0] is not None else 1.0, "seed": seed, "steps": steps,
           "lr": round(lr, 6), "momentum": mu, "final_acc": round(acc, 4),
           "wall_s": round(time.perf_counter() - t0, 1)}
    if warmup:
        rec.update(warmup=warmup, warm_from=warm_from, mean_ratio=round(sum(kept) / len(kept), 4))
    if ages:
        a, wt = torch.cat(ages), torch.cat(weights)
        order = torch.argsort(a)
        cum = torch.cumsum(wt[order], 0) / wt.sum()
        rec["age_p50"] = float(a[order][int(torch.searchsorted(cum, torch.tensor(0.5)))])
        rec["age_p90"] = float(a[order][int(torch.searchsorted(cum, torch.tensor(0.9)))])
        owed = sum(float(c.residual(r).double().square().sum()) for c in comps for r in range(WORKERS))
        rec["owed"] = round(math.sqrt(owed / sent_sq), 4)
    return rec


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--ratios", default="0.01,0.25", help="top-k ratios (comma-separated)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=256, help="steps of every worker (seq's budget: 256)")
    ap.add_argument("--warmup", type=int, default=0, help="steps of DGC's sparsity warm-up (0: none)")
    ap.add_argument("--warmup-from", type=float, default=0.25, help="the warm-up's first kept fraction")
    ap.add_argument("--out", help="JSON list of records")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = []
    for variant in args.variants.split(","):
        ratios = [1.0] if variant.endswith("dense") else [float(x) for x in args.ratios.split(",")]
        for ratio in ratios:
            for seed in (int(s) for s in args.seeds.split(",")):
                rec = run(variant, ratio, seed, args.steps, args.warmup, args.warmup_from)
                print(json.dumps(rec), flush=True)
                out.append(rec)
    if args.out:
        cmd = "python bench/topk_momentum.py " + " ".join(argv if argv is not None else sys.argv[1:])
        meta = {"command": cmd, "machine": platform.machine(), "torch": torch.__version__}
        with open(args.out, "w") as f:
            json.dump([{**r, **meta} for r in out], f, indent=1)
    return out


if __name__ == "__main__":
    main()
