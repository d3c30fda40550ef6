"""Every ``Note [Title]`` that is cited has a body, and only one (Note [What the layout check holds]).

A Note's body starts on a line of its own that holds only ``Note [Title]`` (after a comment marker or
inside a docstring); a citation is any other mention, on one line or broken across two. Pure text
over pyasync/, csrc/, bench/ (not its results), scripts/, tests/, docs/ and README.md."""

from __future__ import annotations

import collections
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUFFIXES = {".py", ".md", ".h", ".cuh", ".cpp", ".cu", ".sh", ".txt"}
_MENTION = re.compile(r"Note(?:\s|//|#|\*)+\[([^\]]+)\]")
_HEAD = re.compile(r"^\s*(?:#+|//+|\*+|\"\"\"|'''|>)?\s*Note \[([^\]]+)\]\s*$")


def _files() -> list[Path]:
    out = [ROOT / "README.md"]
    for top in ("pyasync", "csrc", "bench", "scripts", "tests", "docs"):
        out += [
            p
            for p in (ROOT / top).rglob("*")
            if p.suffix in SUFFIXES and p.is_file() and "results" not in p.relative_to(ROOT).parts
        ]
    return sorted(out)


def _name(raw: str) -> str:
    """The title with line breaks, comment markers and string concatenation taken out."""
    return " ".join(re.sub(r"\"\s*\"|#:|//|#|\*", " ", raw).split())


def notes() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(heads, citations): Note title -> the places that hold its body / cite it."""
    heads: dict[str, list[str]] = collections.defaultdict(list)
    cited: dict[str, list[str]] = collections.defaultdict(list)
    for p in _files():
        if p.name == "test_notes.py":
            continue
        text = p.read_text(errors="replace")
        where = str(p.relative_to(ROOT))
        head_lines = set()
        for i, line in enumerate(text.splitlines(), 1):
            m = _HEAD.match(line)
            if m:
                heads[_name(m.group(1))].append(f"{where}:{i}")
                head_lines.add(i)
        for m in _MENTION.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            if line not in head_lines:
                cited[_name(m.group(1))].append(f"{where}:{line}")
    return heads, cited


def test_every_cited_note_has_a_body():
    heads, cited = notes()
    missing = {k: v for k, v in cited.items() if k not in heads and k != "..."}
    assert not missing, "Notes cited without a body (write one, or cite the Note that exists):\n" + "\n".join(
        f"  Note [{k}]: cited at {', '.join(v[:3])}" for k, v in sorted(missing.items())
    )


def test_no_note_has_two_bodies():
    heads, _ = notes()
    twice = {k: v for k, v in heads.items() if len(v) > 1}
    assert not twice, "Notes with two bodies (rename one, or merge them):\n" + "\n".join(
        f"  Note [{k}]: {', '.join(v)}" for k, v in sorted(twice.items())
    )
