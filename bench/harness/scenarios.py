"""The end-to-end benchmark's scenarios (how the workers are slowed down) and its default system lists."""

from __future__ import annotations

import dataclasses
import math

__all__ = [
    "DEFAULT_SCENARIOS",
    "DEVICE_SCENARIOS",
    "SCENARIOS",
    "TRANSIENT",
    "Scenario",
    "default_systems",
    "hetero_speeds",
    "parse_scenarios",
    "scenario",
]

#: Scenario names.
SCENARIOS = ("equal", "slow2x", "transient", "hetero")

#: The scenarios the benchmark runs by default, in this order; with an emulated device (--device-ms),
#: DEVICE_SCENARIOS.
DEFAULT_SCENARIOS = ("equal", "slow2x", "transient")
DEVICE_SCENARIOS = ("equal", "slow2x", "hetero", "transient")

#: The transient scenario: each step of each rank is 5x slower with probability 0.1.
TRANSIENT = (0.1, 5.0)


@dataclasses.dataclass(frozen=True)
class Scenario:
    """How the workers are slowed down; the same for every system of a run."""

    name: str  # one of SCENARIOS
    straggler: tuple[int, float] | None  # (rank, factor): that rank's steps take factor x C
    transient: tuple[float, float] | None  # (prob, factor): any step of any rank, see slowdowns.py
    about: str  # one line, for tables and plots
    speeds: tuple[float, ...] | None = None  # slowdown factor of each rank, see Note [Rank speeds]


def hetero_speeds(workers: int) -> tuple[float, ...]:
    """The ``hetero`` scenario's slowdown factor of each rank: the first ``ceil(n / 2)`` ranks at full
    speed (1), the others spread evenly from 1.5 to 2 (the slowest, the last rank, at 2; a single slow
    rank is at 2). Four workers: (1, 1, 1.5, 2); two: (1, 2); six: (1, 1, 1, 1.5, 1.75, 2)."""
    if workers < 2:
        raise ValueError(f"the hetero scenario needs at least 2 workers, got {workers}")
    fast = math.ceil(workers / 2)
    slow = workers - fast
    spread = [2.0] if slow == 1 else [1.5 + 0.5 * i / (slow - 1) for i in range(slow)]
    return (1.0,) * fast + tuple(spread)


def scenario(name: str, workers: int) -> Scenario:
    """The scenario ``name`` for ``workers`` ranks; the persistent straggler is the last rank."""
    if name == "equal":
        return Scenario(name, None, None, "all workers at equal speed")
    if name == "slow2x":
        return Scenario(name, (workers - 1, 2.0), None, f"rank {workers - 1} persistently 2x slower")
    if name == "transient":
        prob, factor = TRANSIENT
        return Scenario(
            name, None, TRANSIENT, f"each step of each worker {factor:g}x slower with probability {prob:g}"
        )
    if name == "hetero":
        speeds = hetero_speeds(workers)
        factors = "x, ".join(f"{f:g}" for f in speeds)
        about = f"steps of ranks 0..{workers - 1} take {factors}x as long"
        return Scenario(name, None, None, about, speeds)
    raise ValueError(f"unknown scenario {name!r}: choose from {', '.join(SCENARIOS)}")


def parse_scenarios(text: str, workers: int) -> list[Scenario]:
    """A comma-separated list of scenario names (unique, at least one)."""
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    if not names:
        raise ValueError(f"--scenarios: give at least one of {', '.join(SCENARIOS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--scenarios: names must be unique, got {names}")
    return [scenario(n, workers) for n in names]


def default_systems(workers: int, quick: bool = False) -> str:
    """The systems the benchmark runs by default, as a comma list of system names.

    Full: DDP with its three hooks; BSP, SSP(2), ASP and Quorum(n-1), each without compression, with
    int8 and with top-k 1%; hivemind. Quick: still every kind (each DDP hook, each policy, each
    compression, hivemind), but each policy with one compression.
    """
    q = f"quorum:{max(1, workers - 1)}"
    if quick:
        return f"ddp,ddp+fp16,ddp+powersgd,bsp,ssp:2+int8,asp+topk:0.01,{q},hivemind"
    pyasync = [f"{p}{c}" for p in ("bsp", "ssp:2", "asp", q) for c in ("", "+int8", "+topk:0.01")]
    return ",".join(["ddp", "ddp+fp16", "ddp+powersgd", *pyasync, "hivemind"])
