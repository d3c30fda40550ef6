"""The ``lm`` workload: a small causal GPT-style transformer trained with next-token cross-entropy on a
corpus of arithmetic generated on the spot ("12+7=19;83-5=78;..."), scored by its held-out loss.

Note [The arithmetic corpus]
    Every expression ``a+b=c;`` and ``a-b=c;`` (``a >= b`` for ``-``) with operands in ``0..MAX_OPERAND``
    is one sentence; ``seed`` shuffles them and sets ``HELD_OUT`` of them aside. A split's text is its
    own pool's sentences drawn at random (with replacement) and concatenated, cut into windows of
    ``CONTEXT + 1`` tokens that do not overlap; ``x`` is a window's first ``CONTEXT`` tokens and ``y``
    the same shifted by one (next-token targets), so the training loop's ``F.cross_entropy(net(x), y)``
    is the mean next-token loss. No held-out sentence occurs in the training text: the held-out loss
    measures what the model learnt of the arithmetic, not what it memorised. The operands' digits are
    random (about ln 10 nats each, roughly half the tokens), so the loss has a floor near 1.1 nats per
    token; the format (where ``=`` and ``;`` go, how long a result is) is learnt first and the sums'
    digits later, which makes the curve fall over the whole budget instead of flattening early.

Note [Loss as the metric]
    For this workload the benchmark's metric is the held-out loss (lower is better), not an accuracy:
    time to target is the time of the first curve point whose loss is <= the target. ``make_record``
    still evaluates next-token accuracy (argmax over dim 1) at every point; :func:`held_out_loss` adds
    the loss to the same points (``bench/harness/train.py``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from pyasync.demo.data import Digits

#: The alphabet: digits, the two operators, "=" and the separator ";" (token i is SYMBOLS[i]).
SYMBOLS = "0123456789+-=;"
VOCAB = len(SYMBOLS)
#: Tokens the model reads per sequence.
CONTEXT = 32
#: Largest operand, and the fraction of sentences held out (Note [The arithmetic corpus]).
MAX_OPERAND = 99
HELD_OUT = 0.1

_INDEX = {s: i for i, s in enumerate(SYMBOLS)}


def encode(text: str) -> torch.Tensor:
    """The int64 tokens of ``text`` (characters of SYMBOLS only)."""
    try:
        return torch.tensor([_INDEX[c] for c in text], dtype=torch.int64)
    except KeyError as e:
        raise ValueError(f"cannot encode {e.args[0]!r}: the alphabet is {SYMBOLS!r}") from None


def decode(tokens: torch.Tensor) -> str:
    """The text of int64 ``tokens`` (inverse of :func:`encode`)."""
    return "".join(SYMBOLS[int(t)] for t in tokens.reshape(-1))


@functools.lru_cache(maxsize=4)
def sentence_pools(seed: int = 0, max_operand: int = MAX_OPERAND, held_out: float = HELD_OUT):
    """(training sentences, held-out sentences): every ``a+b=c;`` and ``a-b=c;`` (``a >= b``) with
    operands in ``0..max_operand``, shuffled with ``seed``, the last ``held_out`` fraction held out.
    Two disjoint tuples of strings."""
    if max_operand < 1 or not 0 < held_out < 1:
        raise ValueError(f"need max_operand >= 1 and 0 < held_out < 1, got {max_operand}, {held_out}")
    sentences = [f"{a}+{b}={a + b};" for a in range(max_operand + 1) for b in range(max_operand + 1)]
    sentences += [f"{a}-{b}={a - b};" for a in range(max_operand + 1) for b in range(a + 1)]
    g = torch.Generator().manual_seed(seed * 1_000_003 + 15_485_863)
    order = torch.randperm(len(sentences), generator=g).tolist()
    cut = len(sentences) - max(1, round(held_out * len(sentences)))
    shuffled = [sentences[i] for i in order]
    return tuple(shuffled[:cut]), tuple(shuffled[cut:])


def _windows(pool: tuple[str, ...], n: int, context: int, g: torch.Generator) -> torch.Tensor:
    """``n`` non-overlapping windows of ``context + 1`` tokens of ``pool``'s sentences drawn at random."""
    need = n * (context + 1)
    mean_len = sum(len(s) for s in pool) / len(pool)
    text: list[str] = []
    have = 0
    while have < need:
        for i in torch.randint(0, len(pool), (int(need / mean_len) + 16,), generator=g).tolist():
            text.append(pool[i])
            have += len(pool[i])
    return encode("".join(text))[:need].view(n, context + 1)


@functools.lru_cache(maxsize=4)
def load_lm_split(seed: int = 0, n_train: int = 8192, n_test: int = 512, context: int = CONTEXT) -> Digits:
    """The ``lm`` data set (Note [The arithmetic corpus]): ``x`` int64 (n, context) tokens, ``y`` the next
    tokens (n, context); training windows from the training sentences, test windows from the held-out
    ones. Deterministic for a given seed; nothing is downloaded."""
    if n_train < 1 or n_test < 1 or context < 2:
        raise ValueError(f"need n_train, n_test >= 1 and context >= 2, got {n_train}, {n_test}, {context}")
    train, test = sentence_pools(seed)
    g = torch.Generator().manual_seed(seed * 1_000_003 + 32_452_843)
    w_train = _windows(train, n_train, context, g)
    w_test = _windows(test, n_test, context, g)
    return Digits(w_train[:, :-1], w_train[:, 1:], w_test[:, :-1], w_test[:, 1:])


class TinyGPT(nn.Module):
    """A causal GPT-style language model: token and learned position embeddings (width ``hidden``),
    ``layers`` pre-norm transformer blocks (``heads`` heads, feed-forward 4 x hidden, GELU, no dropout)
    under a causal mask, a final LayerNorm and a linear read-out. ``forward`` maps int64 tokens (batch,
    length <= context) to next-token logits (batch, vocab, length)."""

    def __init__(
        self, hidden: int = 64, context: int = CONTEXT, vocab: int = VOCAB, layers: int = 2, heads: int = 4
    ) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden must be a multiple of heads={heads}, got {hidden}")
        self.context = context
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(0.1 * torch.randn(context, hidden))
        block = nn.TransformerEncoderLayer(
            hidden, heads, 4 * hidden, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(
            block, layers, norm=nn.LayerNorm(hidden), enable_nested_tensor=False
        )
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        if length > self.context:
            raise ValueError(f"sequences of {length} tokens exceed the model's context of {self.context}")
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=x.device)
        h = self.blocks(self.embed(x) + self.pos[:length], mask=mask, is_causal=True)
        return self.head(h).transpose(1, 2)


def make_lm_model(hidden: int, seed: int, context: int = CONTEXT, vocab: int = VOCAB) -> nn.Module:
    """:class:`TinyGPT` initialised from ``seed`` (the same on every rank)."""
    torch.manual_seed(seed)
    return TinyGPT(hidden, context, vocab)


def held_out_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 256) -> float:
    """Mean next-token cross-entropy (nats per token) of ``model`` on ``x`` -> ``y``; no gradients."""
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            total += float(F.cross_entropy(model(x[i : i + batch]), y[i : i + batch], reduction="sum"))
    return total / y.numel()
