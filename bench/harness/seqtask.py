"""The ``seq`` workload: a small transformer that learns to sort sequences of digits, trained with SGD and
momentum 0.9, where stale gradients cost accuracy (docs/benchmarks.md, "What staleness costs").

Note [Why staleness hurts here]
    The digits and teacher MLPs converge under every policy: their loss surfaces are smooth and the
    benchmark trains them with plain SGD. This workload is chosen to be sensitive. A pre-norm transformer
    on a sorting task trained with SGD at momentum 0.9 is near the edge of stability at its learning rate:
    a synchronous run (DDP, BSP) reaches ~0.99 token accuracy, but an update computed on parameters a few
    versions old, fed into a momentum buffer, overshoots (asynchrony behaves like extra momentum on top of
    the explicit one, Mitliagkas et al. 2016, "Asynchrony begets momentum"). Under ASP with n workers each
    push is applied as its own update with the gradient divided by n, so a push is about n - 1 versions
    stale with equal workers and more behind a straggler. ``asp:inverse`` divides each update by its
    staleness, which damps the overshoot and also slows progress.

    Labels are per token: the model returns logits of shape (batch, vocab, length), so the training
    loop's ``F.cross_entropy(net(x), y)`` is the mean over tokens and ``accuracy`` (argmax over dim 1) is
    the fraction of tokens in the right place.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from pyasync.demo.data import Digits

#: Length of a sequence and size of the alphabet (the symbols 0..9).
SEQ_LENGTH = 12
VOCAB = 10


@functools.lru_cache(maxsize=4)
def load_sort_split(
    seed: int = 0, n_train: int = 8192, n_test: int = 2048, length: int = SEQ_LENGTH, vocab: int = VOCAB
) -> Digits:
    """Sequences of ``length`` symbols drawn uniformly from ``0..vocab-1``; the label of a sequence is the
    same symbols sorted ascending (one class per position). Deterministic for a given seed; nothing is
    downloaded. ``x`` and ``y`` are int64 of shape (n, length)."""
    if n_train < 1 or n_test < 1 or length < 2 or vocab < 2:
        raise ValueError(
            f"need n_train, n_test >= 1, length >= 2 and vocab >= 2, got {n_train}, {n_test}, {length}, "
            f"{vocab}"
        )
    g = torch.Generator().manual_seed(seed * 1_000_003 + 104_729)
    x = torch.randint(0, vocab, (n_train + n_test, length), generator=g)
    y = x.sort(dim=1).values
    return Digits(x[:n_train], y[:n_train], x[n_train:], y[n_train:])


class SortTransformer(nn.Module):
    """Token and learned position embeddings (width ``hidden``), ``layers`` pre-norm transformer encoder
    layers (``heads`` heads, feed-forward 2 x hidden, no dropout, no mask) and a linear read-out per
    position. ``forward`` maps int64 tokens (batch, length) to logits (batch, vocab, length)."""

    def __init__(self, hidden: int, length: int, vocab: int = VOCAB, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden must be a multiple of heads={heads}, got {hidden}")
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(0.1 * torch.randn(length, hidden))
        layer = nn.TransformerEncoderLayer(
            hidden, heads, 2 * hidden, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(x) + self.pos[: x.shape[1]])
        return self.head(h).transpose(1, 2)


def make_seq_model(hidden: int, seed: int, length: int = SEQ_LENGTH, vocab: int = VOCAB) -> nn.Module:
    """:class:`SortTransformer` initialised from ``seed`` (the same on every rank)."""
    torch.manual_seed(seed)
    return SortTransformer(hidden, length, vocab)
