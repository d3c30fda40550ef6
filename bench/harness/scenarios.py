"""The end-to-end benchmark's scenarios (how the workers are slowed down) and its default system lists."""

from __future__ import annotations

import dataclasses

__all__ = ["SCENARIOS", "TRANSIENT", "Scenario", "default_systems", "parse_scenarios", "scenario"]

#: Scenario names, in the order the benchmark runs them.
SCENARIOS = ("equal", "slow2x", "transient")

#: The transient scenario: each step of each rank is 5x slower with probability 0.1.
TRANSIENT = (0.1, 5.0)


@dataclasses.dataclass(frozen=True)
class Scenario:
    """How the workers are slowed down; the same for every system of a run."""

    name: str  # one of SCENARIOS
    straggler: tuple[int, float] | None  # (rank, factor): that rank's steps take factor x C
    transient: tuple[float, float] | None  # (prob, factor): any step of any rank, see slowdowns.py
    about: str  # one line, for tables and plots


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
