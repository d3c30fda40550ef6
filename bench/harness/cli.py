"""The benchmarks' shared command-line vocabulary: ``--systems``, "what to run", in every script.

Note [One name for what to run]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every benchmark takes the systems it runs as ``--systems``: a comma-separated list of system specs,
``ddp`` or a pyasync policy as ``pyasync.parse_policy`` reads it (``bsp``, ``asp``, ``ssp:1``,
``quorum:3``, ...), optionally ``+COMPRESSION`` (``asp+int8``), plus what a script adds on top
(bench/e2e.py's ``ddp+fp16`` and peers: ``hivemind[:ROUND]``, ``torchft``,
``torchft-diloco[:H][:lr=X][:momentum=M]``, ``torchft-localsgd[:H]``; bench/engine.py's ``@gloo``
transport suffix, bench/simulate.py's ``quorum:n-1``). The older spellings of the same option (``--modes`` in
bench/engine.py, ``--policies`` in bench/capture.py, bench/faults.py and bench/simulate.py, ``--policy``
in bench/soak.py) stay accepted as aliases of it, so documented commands and kept results' ``command``
lines still run. Specs are checked by one parser, :func:`parse_system_specs` (built on
``harness.workload.parse_system``, itself on the demo's parser and ``pyasync.parse_policy``), so a typo
fails the same way before any process starts. (bench/capture.py's ``--modes`` are its capture modes,
not systems, and keep that name.)
"""

from __future__ import annotations

import argparse
from collections.abc import Collection
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the parser is imported when used: bench/simulate.py needs no torch model code
    from .workload import BenchSystem


def add_systems_option(
    ap: argparse.ArgumentParser,
    *aliases: str,
    default: str,
    help: str,
    dest: str = "systems",
) -> argparse.Action:
    """Add ``--systems`` (and the old spellings ``aliases``, e.g. ``"--modes"``) to ``ap``: one option,
    a comma-separated string of system specs in ``dest`` (Note [One name for what to run])."""
    names = ", ".join(aliases)
    old = f" ({names}: the old name{'s' if len(aliases) > 1 else ''} of --systems)" if aliases else ""
    return ap.add_argument(
        "--systems", *aliases, dest=dest, default=default, metavar="SYSTEMS", help=help + old
    )


def split_systems(text: str) -> list[str]:
    """The specs of a ``--systems`` string, stripped, empty entries dropped; ValueError when none is
    left or one repeats."""
    specs = [s.strip() for s in text.split(",") if s.strip()]
    if not specs:
        raise ValueError("--systems is empty: give e.g. ddp,bsp,asp")
    if len(set(specs)) != len(specs):
        raise ValueError(f"--systems must be unique, got {text!r}")
    return specs


def parse_system_specs(
    text: str, workers: int, kinds: Collection[str] = ("ddp", "pyasync")
) -> list[BenchSystem]:
    """Every spec of a ``--systems`` string (see :func:`split_systems`) parsed by
    ``harness.workload.parse_system`` for ``workers`` ranks; ValueError naming the spec when one does
    not parse or is of a kind (``ddp``, ``pyasync``, ``hivemind``, ``torchft``, ``torchft-diloco``,
    ``torchft-localsgd``) not in ``kinds``."""
    from .workload import parse_system

    out = []
    for spec in split_systems(text):
        system = parse_system(spec, workers)
        if system.kind not in kinds:
            raise ValueError(f"system {spec!r}: this benchmark runs {', '.join(sorted(kinds))} systems only")
        out.append(system)
    return out
