"""The demo's data and model: scikit-learn's digits, split and sharded with a fixed seed, and an MLP.

Note [Work budget]
    ``epochs`` fixes the total work, not each worker's: the cluster computes ``epochs *
    steps_per_epoch * workers`` gradient steps of ``batch_size`` samples, where ``steps_per_epoch =
    (n_train // workers) // batch_size``. Every rank claims each step from a shared counter in the
    rendezvous store before computing it. Synchronous systems (DDP, BSP) must take equal numbers of
    steps, so each rank takes exactly ``epochs * steps_per_epoch``; asynchronous policies (SSP, ASP,
    Quorum) stop when the counter is spent, so fast workers take more steps than a straggler, which is
    the point of them. The counter round trip is paid by every system alike. A rank draws its batches
    from its own shard only, reshuffled each pass with a seed of (seed, rank, pass).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class Digits:
    """A classification data set split once with a fixed seed (the standardised digits, or any other set
    of the same shape: float features, int64 labels 0..9)."""

    x_train: torch.Tensor  # (n_train, features) float32 (digits: standardised with the training statistics)
    y_train: torch.Tensor  # (n_train,) int64 class labels 0..9
    x_test: torch.Tensor  # (n_test, features) float32
    y_test: torch.Tensor  # (n_test,) int64


@functools.lru_cache(maxsize=4)
def load_digits_split(seed: int = 0, test_fraction: float = 0.2) -> Digits:
    """scikit-learn's ``load_digits`` (1797 8x8 images shipped with scikit-learn), stratified split.

    Features are standardised with the training set's per-pixel mean and standard deviation (pixels
    that are constant in the training set keep scale 1).
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y)
    x_tr = torch.as_tensor(x_tr, dtype=torch.float32)
    x_te = torch.as_tensor(x_te, dtype=torch.float32)
    mean = x_tr.mean(0)
    std = x_tr.std(0)
    std = torch.where(std > 0, std, torch.ones_like(std))
    return Digits(
        (x_tr - mean) / std,
        torch.as_tensor(y_tr, dtype=torch.int64),
        (x_te - mean) / std,
        torch.as_tensor(y_te, dtype=torch.int64),
    )


def shard_indices(n: int, rank: int, world: int, seed: int) -> torch.Tensor:
    """Indices of ``rank``'s shard: a seeded permutation of ``range(n)`` dealt round-robin to ranks.

    Shards are disjoint and together cover every index; sizes differ by at most one.
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in 0..{world - 1}, got {rank}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return perm[rank::world]


def steps_per_epoch(n_train: int, workers: int, batch_size: int) -> int:
    """Steps one rank takes per pass over its shard (full batches of the smallest shard)."""
    steps = (n_train // workers) // batch_size
    if steps < 1:
        raise ValueError(
            f"batch_size={batch_size} is larger than a shard ({n_train // workers} samples with "
            f"{workers} workers): use a smaller batch size or fewer workers"
        )
    return steps


def budget_steps(n_train: int, workers: int, batch_size: int, epochs: int) -> int:
    """Gradient steps of the whole cluster in a run of ``epochs`` (see Note [Work budget])."""
    return epochs * steps_per_epoch(n_train, workers, batch_size) * workers


def batches(
    x: torch.Tensor, y: torch.Tensor, steps: int, batch_size: int, seed: int, rank: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless batches from one shard: ``steps`` per pass, reshuffled each pass from (seed, rank, pass)."""
    n_pass = 0
    while True:
        g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + n_pass)
        perm = torch.randperm(len(x), generator=g)
        for s in range(steps):
            idx = perm[s * batch_size : (s + 1) * batch_size]
            yield x[idx], y[idx]
        n_pass += 1


def make_model(hidden: int, seed: int, features: int = 64) -> nn.Module:
    """The MLP features -> hidden -> hidden -> 10 (ReLU), initialised from ``seed`` (same on every rank)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)
    )


def flat_params(model: nn.Module) -> torch.Tensor:
    """A copy of ``model``'s parameters as one flat tensor."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of ``x`` that ``model`` classifies as ``y``."""
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())
