"""The benchmark's workloads and options on top of the demo's: a second (wide) model on a synthetic teacher
task, a third (seq) where staleness hurts (``seqtask``), a fourth (lm) a small GPT scored by its held-out
loss (``lmtask``), DDP's compression hooks and hivemind as systems, the optimizer every system builds
(:func:`make_optimizer`), and :class:`BenchConfig`, the demo's TrainConfig with the benchmark's
slowdowns, link, model and optimizer."""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
from torch import nn

from pyasync.demo.config import SystemSpec, TrainConfig
from pyasync.demo.config import parse_system as parse_demo_system
from pyasync.demo.config import parse_systems as parse_demo_systems
from pyasync.demo.data import Digits, load_digits_split
from pyasync.policy import LOCAL_OUTER_DEFAULTS, Local

from .lmtask import CONTEXT, load_lm_split, make_lm_model
from .seqtask import SEQ_LENGTH, load_sort_split, make_seq_model

# ---------------------------------------------------------------------------------------------------
# Systems: the demo's, plus DDP's compression hooks and the peers (hivemind, torchft)
# ---------------------------------------------------------------------------------------------------

#: The other libraries' systems (bench/harness/peers.py), which need the peers' venv.
PEER_KINDS = ("hivemind", "torchft", "torchft-diloco", "torchft-localsgd")
#: torchft's local-steps algorithms (torchft.local_sgd): DiLoCo and LocalSGD, H inner steps per sync.
TORCHFT_LOCAL_KINDS = ("torchft-diloco", "torchft-localsgd")
#: H of ``torchft-diloco`` and ``torchft-localsgd`` without one: pyasync's ``local``'s default steps.
TORCHFT_LOCAL_STEPS = Local().steps

#: PowerSGD rank of ``ddp+powersgd`` (rank 2 keeps ~99% of this MLP's bytes off the wire).
DEFAULT_POWERSGD_RANK = 2


@dataclasses.dataclass(frozen=True)
class BenchSystem(SystemSpec):
    """A system of the benchmark: the demo's kinds, ``ddp`` with a compression hook (``compression`` holds
    ``fp16`` or ``powersgd:RANK``), or a peer: ``kind="hivemind"`` (hivemind.Optimizer, ``peer_round``
    steps of every peer per averaging round), ``kind="torchft"`` (torchft's Manager and DDP),
    ``kind="torchft-diloco"`` (torchft.local_sgd.DiLoCo: ``peer_round`` inner steps per outer step, an
    outer Nesterov SGD at ``outer_lr`` and ``outer_momentum``) or ``kind="torchft-localsgd"``
    (torchft.local_sgd.LocalSGD: parameters averaged every ``peer_round`` steps); see
    ``bench/harness/peers.py``."""

    # hivemind: steps of every peer per averaging round (None: default); torchft-diloco and
    # torchft-localsgd: H, the inner steps between two syncs
    peer_round: int | None = None
    outer_lr: float | None = None  # torchft-diloco: the outer SGD's learning rate
    outer_momentum: float | None = None  # torchft-diloco: the outer SGD's (Nesterov) momentum
    lr_scale: float = 1.0  # ``NAME@lr=X``: the system's optimizer runs at X times the model's lr

    @property
    def is_peer(self) -> bool:
        """True for the other libraries the benchmark runs (hivemind, torchft)."""
        return self.kind in PEER_KINDS

    @property
    def ddp_hook(self) -> str | None:
        """DDP's communication hook: "allreduce", "fp16" or "powersgd"; None for other systems."""
        if not self.is_ddp:
            return None
        return "allreduce" if self.compression is None else self.compression.split(":")[0]

    @property
    def powersgd_rank(self) -> int | None:
        """PowerSGD's matrix approximation rank (``ddp+powersgd:RANK``, default 2); None otherwise."""
        if self.ddp_hook != "powersgd":
            return None
        _, _, rank = self.compression.partition(":")
        return int(rank) if rank else DEFAULT_POWERSGD_RANK


def _parse_ddp_hook(name: str, codec: str) -> str:
    """The normalised DDP hook spec of ``ddp+CODEC``: "fp16" or "powersgd:RANK"."""
    head, colon, arg = codec.partition(":")
    if head == "fp16" and not colon:
        return "fp16"
    if head == "powersgd":
        try:
            rank = int(arg) if colon else DEFAULT_POWERSGD_RANK
        except ValueError:
            rank = 0
        if rank >= 1:
            return f"powersgd:{rank}"
        raise ValueError(f"system {name!r}: PowerSGD rank must be an int >= 1, e.g. ddp+powersgd:2")
    raise ValueError(
        f"system {name!r}: ddp takes +fp16 or +powersgd[:RANK] (its communication hooks); compression "
        f"{codec!r} applies to pyasync policies, not to ddp"
    )


def _parse_torchft_local(name: str, kind: str, args: list[str]) -> BenchSystem:
    """``torchft-diloco[:H][:lr=X][:momentum=M]`` or ``torchft-localsgd[:H]`` (``args``: what follows the
    kind, split at ``:``), options as pyasync's ``local:H:lr=..:momentum=..``. DiLoCo's outer lr and
    momentum default to pyasync's ``local:H`` defaults (``LOCAL_OUTER_DEFAULTS["sync"]``)."""
    opts = dict(a.split("=", 1) for a in args if "=" in a)
    steps = [a for a in args if "=" not in a]
    known = ("lr", "momentum") if kind == "torchft-diloco" else ()
    bad = sorted(set(opts) - set(known))
    if bad:
        takes = f"it takes {list(known)}" if known else "it takes no options"
        raise ValueError(f"system {name!r}: unknown option(s) {bad} for {kind}; {takes}")
    if len(steps) > 1:
        raise ValueError(f"system {name!r}: {kind} takes one H (its inner steps per sync), got {steps}")
    try:
        h = int(steps[0]) if steps else TORCHFT_LOCAL_STEPS
    except ValueError:
        h = 0
    if h < 1:
        raise ValueError(
            f"system {name!r}: {kind} takes H, its inner steps per sync, an int >= 1 (e.g. {kind}:16)"
        )
    if kind == "torchft-localsgd":
        return BenchSystem(
            name=name, policy=None, compression=None, synchronous=True, kind=kind, peer_round=h
        )
    lr, mu = LOCAL_OUTER_DEFAULTS["sync"]
    try:
        lr, mu = float(opts.get("lr", lr)), float(opts.get("momentum", mu))
    except ValueError:
        lr = mu = math.nan
    if not (0 < lr < math.inf and 0 <= mu < 1):
        raise ValueError(
            f"system {name!r}: {kind}'s outer lr must be a finite number > 0 and its momentum in [0, 1), "
            f"e.g. {kind}:16:lr=0.5:momentum=0.8"
        )
    return BenchSystem(
        name=name,
        policy=None,
        compression=None,
        synchronous=True,
        kind=kind,
        peer_round=h,
        outer_lr=lr,
        outer_momentum=mu,
    )


def parse_system(token: str, workers: int) -> BenchSystem:
    """Parse one system name: the demo's (``ddp``, or a pyasync policy optionally ``+COMPRESSION``, see
    ``pyasync.demo.config.parse_system``), ``ddp+fp16``, ``ddp+powersgd[:RANK]``, ``hivemind[:ROUND]``
    (ROUND: steps of every peer per averaging round, an int >= 1), ``torchft``,
    ``torchft-diloco[:H][:lr=X][:momentum=M]`` (H inner steps per outer step, default
    :data:`TORCHFT_LOCAL_STEPS`; the outer Nesterov SGD's lr and momentum, default pyasync's ``local:H``
    ones, 0.5 and 0.8) or ``torchft-localsgd[:H]``.

    ``ddp+fp16`` and ``ddp+powersgd`` are DDP with torch's ``fp16_compress_hook`` and ``powerSGD_hook``
    (rank 2 unless given). Any of them may end in ``@lr=X``: its (inner) optimizer runs at X times the
    model's learning rate, e.g. ``local:16:quorum:3@lr=0.5`` beside ``ddp`` at the model's own.
    Raises ValueError naming the token.
    """
    name = token.strip()
    head, at, scale = name.partition("@")
    if at:
        return dataclasses.replace(parse_system(head, workers), name=name, lr_scale=_lr_scale(name, scale))
    base, plus, codec = name.lower().partition("+")
    if base == "ddp" and plus:
        hook = _parse_ddp_hook(name, codec)
        return BenchSystem(name=name, policy=None, compression=hook, synchronous=True, kind="ddp")
    head, colon, arg = base.partition(":")
    if head in PEER_KINDS:
        if plus:
            raise ValueError(f"system {name!r}: {head} runs without compression here")
        if head in TORCHFT_LOCAL_KINDS:
            return _parse_torchft_local(name, head, arg.split(":") if colon else [])
        if head == "torchft":
            if colon:
                raise ValueError(f"system {name!r}: torchft takes no argument")
            return BenchSystem(name=name, policy=None, compression=None, synchronous=True, kind="torchft")
        try:
            rounds = int(arg) if colon else None
        except ValueError:
            rounds = 0
        if rounds is not None and rounds < 1:
            raise ValueError(
                f"system {name!r}: hivemind's round must be an int >= 1 of steps, e.g. hivemind:16"
            )
        return BenchSystem(
            name=name, policy=None, compression=None, synchronous=False, kind="hivemind", peer_round=rounds
        )
    try:
        spec = parse_demo_system(name, workers)
    except ValueError as e:
        raise ValueError(
            f"{e} (the benchmark also runs 'ddp+fp16', 'ddp+powersgd', 'hivemind', 'torchft', "
            "'torchft-diloco' and 'torchft-localsgd')"
        ) from None
    return BenchSystem(**dataclasses.asdict(spec))


def _lr_scale(name: str, text: str) -> float:
    key, eq, value = text.partition("=")
    try:
        x = float(value) if key.strip().lower() == "lr" and eq else math.nan
    except ValueError:
        x = math.nan
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"system {name!r}: after '@' write lr=X with X > 0, e.g. local:16@lr=0.5")
    return x


def parse_systems(text: str, workers: int) -> list[BenchSystem]:
    """A comma-separated list of :func:`parse_system` names (unique, at least one)."""
    return parse_demo_systems(text, workers, parse_system)


def powersgd_warmup(steps_per_rank: int) -> int:
    """Default ``start_powerSGD_iter`` of ``ddp+powersgd``: 10 plain all-reduce steps, at most ~10% of
    the run, at least 2 (PowerSGD requires > 1 with error feedback). They are timed and counted."""
    return max(2, min(10, steps_per_rank // 10))


# ---------------------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def load_teacher_split(
    seed: int = 0,
    n_train: int = 8192,
    n_test: int = 2048,
    features: int = 256,
    latent: int = 16,
    ambiguous: float = 0.25,
) -> Digits:
    """A synthetic 10-class task whose labels come from a fixed random teacher network (``seed``).

    Inputs are ``x = z A + 0.1 e`` with ``z`` of ``latent`` standard normal coordinates, ``A`` a fixed
    random ``latent x features`` map and ``e`` standard normal noise in every feature. The teacher is a
    random MLP ``latent -> 32 (tanh) -> 10`` on ``z``; its logits are centred over the data and the
    label is their argmax. The ``ambiguous`` fraction of samples with the smallest gap between the two
    largest teacher logits is dropped, so the task has margins and high accuracy is reachable (a
    single-process run of the default wide MLP with the same global batch reaches ~0.90 test accuracy in
    2 epochs and ~0.96 in 4). Deterministic for a given seed.
    """
    if not 0 <= ambiguous < 1:
        raise ValueError(f"ambiguous must be in [0, 1), got {ambiguous}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + 7919)
    a = torch.randn(latent, features, generator=g) / math.sqrt(latent)
    w1 = torch.randn(latent, 32, generator=g) / math.sqrt(latent)
    w2 = torch.randn(32, 10, generator=g) / math.sqrt(32)
    need = n_train + n_test
    n = math.ceil(need / (1 - ambiguous)) + 16
    z = torch.randn(n, latent, generator=g)
    x = z @ a + 0.1 * torch.randn(n, features, generator=g)
    logits = torch.tanh(0.5 * (z @ w1)) @ w2
    logits = logits - logits.mean(0)
    top2 = logits.topk(2, dim=1).values
    gap = top2[:, 0] - top2[:, 1]
    keep = torch.argsort(gap, descending=True, stable=True)[:need]
    keep = keep.sort().values  # original (random) order
    x, y = x[keep].contiguous(), logits[keep].argmax(1)
    return Digits(x[:n_train], y[:n_train], x[n_train:], y[n_train:])


#: What a workload's curve, final figure and target measure: "acc" (test accuracy, higher is better) or
#: "loss" (held-out cross-entropy in nats per token, lower is better). See Note [Loss as the metric] in
#: ``lmtask``.
HIGHER_IS_BETTER = {"acc": True, "loss": False}

#: The optimizers a benchmark run can build (--optimizer); see :func:`make_optimizer`.
OPTIMIZERS = ("sgd", "adamw")
#: AdamW's betas and decoupled weight decay, the same for every workload.
ADAMW_BETAS = (0.9, 0.999)
ADAMW_WEIGHT_DECAY = 0.01


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One workload of the benchmarks: a data set and the model trained on it (an MLP, or for ``seq`` and
    ``lm`` the transformers of ``seqtask`` and ``lmtask``)."""

    name: str  # key of MODELS
    features: int  # input width of the MLP (seq, lm: tokens per sequence)
    hidden: int  # default width of its two hidden layers (seq, lm: the transformer's width)
    lr: float  # default SGD learning rate
    target: float  # default target of time-to-target, in units of ``metric`` (reachable in the budget)
    epochs: int  # default budget of python bench/e2e.py (passes over the training set)
    data: str  # what it trains on, in words
    momentum: float = 0.0  # default SGD momentum
    adamw_lr: float = 1e-3  # AdamW's learning rate (--optimizer adamw), see MODELS
    optimizer: str = "sgd"  # the optimizer of a run without --optimizer: a name of OPTIMIZERS
    metric: str = "acc"  # "acc" (test accuracy) or "loss" (held-out loss), a key of HIGHER_IS_BETTER
    adamw_target: float | None = None  # the target under AdamW, which converges faster (None: ``target``)

    def __post_init__(self) -> None:
        if self.metric not in HIGHER_IS_BETTER or self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"model {self.name!r}: metric must be one of {sorted(HIGHER_IS_BETTER)} and optimizer one "
                f"of {OPTIMIZERS}, got {self.metric!r}, {self.optimizer!r}"
            )

    def target_for(self, optimizer: str) -> float:
        """The default target of a run with ``optimizer`` (a name of OPTIMIZERS)."""
        return self.adamw_target if optimizer == "adamw" and self.adamw_target is not None else self.target

    @property
    def higher_is_better(self) -> bool:
        """True when the target is reached from below (accuracy), False from above (loss)."""
        return HIGHER_IS_BETTER[self.metric]


#: The workloads. "mlp" is the demo's (digits, ~300K parameters, 1.2 MB); "wide" has ~4.7M parameters
#: (19 MB of fp32 gradients per step) on the teacher task, where the wire starts to matter; "seq" is a
#: 2-layer transformer (~70K parameters) sorting 12 digits with SGD at momentum 0.9, where staleness
#: costs accuracy (see Note [Why staleness hurts here] in ``seqtask``); "lm" is a 2-layer causal GPT
#: (~104K parameters) on generated arithmetic, scored by its held-out loss (Note [The arithmetic
#: corpus] in ``lmtask``). lm's lr, adamw_lr, budget and targets were measured under DDP
#: (docs/benchmarks.md, "Workloads"); adamw_lr 1e-3 of the other three is the usual default, not tuned.
MODELS: dict[str, ModelSpec] = {
    "mlp": ModelSpec("mlp", 64, 512, 0.2, 0.95, 20, "scikit-learn digits (8x8 images)", adamw_lr=1e-3),
    "wide": ModelSpec("wide", 256, 2048, 0.05, 0.90, 6, "synthetic teacher task (256 features)",
                      adamw_lr=1e-3),
    "seq": ModelSpec("seq", SEQ_LENGTH, 64, 0.03, 0.95, 8, f"synthetic sorting task ({SEQ_LENGTH} digits)",
                     momentum=0.9, adamw_lr=1e-3),
    "lm": ModelSpec("lm", CONTEXT, 64, 0.1, 1.85, 12, f"generated arithmetic ({CONTEXT}-token windows)",
                    momentum=0.9, adamw_lr=3e-3, metric="loss", adamw_target=1.66),
}  # fmt: skip


def make_optimizer(cfg: BenchConfig, params) -> torch.optim.Optimizer:
    """The optimizer every system of the benchmark steps (pyasync wraps it, DDP and the peers step it):
    ``cfg.optimizer`` "sgd" (``lr``, ``momentum``) or "adamw" (``lr``, ADAMW_BETAS, ADAMW_WEIGHT_DECAY)."""
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=ADAMW_BETAS, weight_decay=ADAMW_WEIGHT_DECAY)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum)


def optimizer_config(cfg: BenchConfig) -> dict[str, object]:
    """What a record says of ``cfg``'s optimizer: its name, and AdamW's betas and weight decay."""
    if cfg.optimizer == "adamw":
        return {"optimizer": "adamw", "betas": list(ADAMW_BETAS), "weight_decay": ADAMW_WEIGHT_DECAY}
    return {"optimizer": "sgd"}


def load_split(model: str, seed: int = 0) -> Digits:
    """The data set of workload ``model`` (a key of MODELS), split with ``seed``."""
    if model == "mlp":
        return load_digits_split(seed)
    if model == "wide":
        return load_teacher_split(seed)
    if model == "seq":
        return load_sort_split(seed)
    if model == "lm":
        return load_lm_split(seed)
    raise ValueError(f"model must be one of {sorted(MODELS)}, got {model!r}")


# ---------------------------------------------------------------------------------------------------
# One run's options
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BenchConfig(TrainConfig):
    """The demo's TrainConfig plus the benchmark's model, slowdowns, DDP hooks and link; the same on every
    rank."""

    model: str = "mlp"  # workload, a key of MODELS: "mlp" (digits), "wide" (teacher), "seq" (sorting), "lm"
    optimizer: str = "sgd"  # "sgd" (lr, momentum) or "adamw" (lr; see make_optimizer)
    transient: tuple[float, float] | None = None  # (prob, factor), see Note [Transient slowdowns]
    compute_s: float | None = None  # compute time C of one step (s) for injected delays; None: measure
    powersgd_warmup: int | None = None  # ddp+powersgd: all-reduce steps first; None: see powersgd_warmup
    bandwidth_gbps: float | None = None  # Gbit/s of each rank's emulated sending link; None: no emulation
    speeds: tuple[float, ...] | None = None  # slowdown factor of each rank (>= 1), see Note [Rank speeds]

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {sorted(MODELS)}, got {self.model!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.transient is not None:
            prob, factor = self.transient
            if not 0 <= prob <= 1 or not 1 <= factor < math.inf:
                raise ValueError(
                    f"transient must be (prob, factor) with 0 <= prob <= 1 and a finite factor >= 1, got "
                    f"{self.transient}"
                )
        if self.compute_s is not None and not self.compute_s >= 0:
            raise ValueError(f"compute_s must be >= 0 seconds, got {self.compute_s}")
        if self.compute_s is not None and self.device_ms is not None:
            raise ValueError(
                "compute_s is C of the CPU-only mode; with device_ms every slowdown is a multiple of D "
                "(see Note [Emulated device])"
            )
        if self.speeds is not None and (
            len(self.speeds) != self.workers or not all(1 <= f < math.inf for f in self.speeds)
        ):
            raise ValueError(
                f"speeds must give a finite factor >= 1 for each of the {self.workers} workers, got "
                f"{self.speeds}"
            )
        if self.bandwidth_gbps is not None and not 0 < self.bandwidth_gbps < math.inf:
            raise ValueError(
                f"bandwidth_gbps must be a finite number > 0 (Gbit/s), got {self.bandwidth_gbps}"
            )
        if self.powersgd_warmup is not None and self.powersgd_warmup < 2:
            raise ValueError(
                f"powersgd_warmup must be >= 2 steps (PowerSGD's rule), got {self.powersgd_warmup}"
            )

    def load_data(self) -> Digits:
        """The data set of ``model``, split with ``seed``."""
        return load_split(self.model, self.seed)

    def build_model(self, data: Digits) -> nn.Module:
        """The model of workload ``model``: the demo's MLP, for ``seq`` the sorting transformer of width
        ``hidden`` (``seqtask.make_seq_model``), for ``lm`` the GPT of ``lmtask.make_lm_model``."""
        if self.model == "seq":
            return make_seq_model(self.hidden, self.seed, data.x_train.shape[1])
        if self.model == "lm":
            return make_lm_model(self.hidden, self.seed, data.x_train.shape[1])
        return super().build_model(data)
