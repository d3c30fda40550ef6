"""The GPU check's environment, summary and README table (see bench/gpu_check.sh).

    python bench/gpu_report.py env --out DIR/env.json       # GPU, driver, versions; prints the GPU's slug
    python bench/gpu_report.py summarize DIR --step build=ok:41 --step tests_cuda=failed:88 ...
                                                            # DIR/summary.json and DIR/table.md
    python bench/gpu_report.py table DIR/summary.json       # the README's GPU table, as markdown
    python bench/gpu_report.py report DIR/summary.json      # a short plain-text account (end of the log)

``summarize`` reads what the check left in DIR (env.json, the pytest JUnit files tests_cuda.xml and
tests_engine.xml, the benchmark records kernels.json), evaluates the performance targets of issue 15 on
the CUDA records of at least 25M elements and writes summary.json (fields in bench/README.md). Only
``env`` imports torch; the other commands read files.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent

# Targets (issue 15), on CUDA records of at least MIN_NUMEL elements.
MIN_NUMEL = 25_000_000
COPY_FRACTION = 0.8  # every compressor with error feedback and every fused apply, of copy bandwidth
TOPK_SPEEDUP = 3.0  # top-k 1% against torch.topk on the same v, with the same index set
FUSED_ADAM_SPEEDUP = 1.3  # fused decode + Adam against decode, then torch's fused Adam
COMPRESSORS = ("fp16", "bf16", "int8", "sign", "topk")  # the lossy codecs: encode includes error feedback
CODECS = ("none", *COMPRESSORS)
OPTIMS = ("sgd", "adam", "adamw")

STEP_STATES = ("ok", "failed", "timeout", "skipped")


# ------------------------------------------------------------------------------------------------
# env


def _run(cmd: list[str], timeout: float = 20.0) -> str | None:
    """stdout of `cmd`, or None when it is missing, fails or takes longer than `timeout` seconds."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def slug(name: str | None) -> str:
    """A folder-safe form of a GPU name: 'NVIDIA H200' -> 'nvidia_h200'; None -> 'none'."""
    if not name:
        return "none"
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "gpu"


def collect_env() -> dict[str, Any]:
    """The machine the check runs on: GPU (from torch and nvidia-smi), driver, versions, git commit."""
    env: dict[str, Any] = {
        "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "gpu": None,
        "no_gpu_reason": None,
    }
    include = sysconfig.get_paths().get("include") or ""
    env["python_headers"] = include if os.path.exists(os.path.join(include, "Python.h")) else None
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
                "--format=csv,noheader"])
    env["nvidia_smi"] = smi
    nvcc = _run([os.environ.get("CUDACXX") or "nvcc", "--version"])
    release = [line for line in (nvcc or "").splitlines() if "release" in line]
    env["nvcc"] = release[0].strip() if release else None
    cmake = _run(["cmake", "--version"])
    env["cmake"] = cmake.splitlines()[0] if cmake else None
    commit = _run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], timeout=10)
    status = _run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"], timeout=10)
    env["git"] = {"commit": commit or os.environ.get("GPU_CHECK_COMMIT") or None,
                  "dirty": None if status is None else bool(status)}
    try:
        import torch
    except ImportError as e:
        env["torch"] = None
        env["no_gpu_reason"] = f"torch is not importable: {e}"
        return env
    env["torch"] = torch.__version__
    env["torch_cuda"] = torch.version.cuda
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        env["no_gpu_reason"] = (
            "torch sees no CUDA GPU" + ("" if torch.version.cuda else " (a CPU-only torch build)")
            + (f"; nvidia-smi reports: {smi}" if smi else "; nvidia-smi is missing or reports no GPU")
        )
        return env
    props = torch.cuda.get_device_properties(0)
    gpu: dict[str, Any] = {
        "name": props.name,
        "count": torch.cuda.device_count(),
        "capability": f"{props.major}.{props.minor}",
        "arch": f"{props.major}{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "memory_bytes": props.total_memory,
        "driver": None,
    }
    if smi:
        fields = [f.strip() for f in smi.splitlines()[0].split(",")]
        if len(fields) >= 2:
            gpu["driver"] = fields[1]
    env["gpu"] = gpu
    return env


# ------------------------------------------------------------------------------------------------
# pytest JUnit results


def junit_summary(path: Path) -> dict[str, Any] | None:
    """Counts, failures (test id and first line of the message) and skip reasons of a pytest JUnit
    XML file; None when the file is missing; {"error": ...} when it cannot be read."""
    if not path.exists():
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        return {"error": f"unreadable JUnit XML: {e}"}
    out: dict[str, Any] = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "seconds": 0.0}
    failures: list[dict[str, str]] = []
    skips: dict[str, int] = {}
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    for suite in suites:
        out["seconds"] += float(suite.get("time", 0.0) or 0.0)
        for case in suite.iter("testcase"):
            out["tests"] += 1
            test = f"{case.get('classname', '')}::{case.get('name', '')}"
            bad = case.find("failure")
            kind = "failed"
            if bad is None:
                bad, kind = case.find("error"), "errors"
            skip = case.find("skipped")
            if bad is not None:
                out[kind] += 1
                text = (bad.get("message") or bad.text or "").strip().splitlines()
                failures.append({"test": test, "kind": kind, "message": (text[0] if text else "")[:400]})
            elif skip is not None:
                out["skipped"] += 1
                reason = (skip.get("message") or "").strip()[:200]
                skips[reason] = skips.get(reason, 0) + 1
            else:
                out["passed"] += 1
    out["seconds"] = round(out["seconds"], 1)
    out["failures"] = failures[:50]
    out["failures_left_out"] = max(0, len(failures) - 50)
    out["skip_reasons"] = dict(sorted(skips.items(), key=lambda kv: -kv[1])[:5])
    return out


# ------------------------------------------------------------------------------------------------
# Targets


def _largest(records: list[dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    """CUDA records of at least MIN_NUMEL elements, by op and size."""
    by: dict[str, dict[int, dict[str, Any]]] = {}
    for r in records:
        if r.get("device") != "cuda" or not isinstance(r.get("numel"), int) or r["numel"] < MIN_NUMEL:
            continue
        by.setdefault(r["op"], {})[r["numel"]] = r
    return by


def _target(name: str, op: str, numel: int | None, metric: str, value: Any, threshold: float,
            ok: bool | None = None, **extra: Any) -> dict[str, Any]:
    measured = value if isinstance(value, (int, float)) and math.isfinite(value) else None
    if ok is None:
        ok = measured is not None and measured >= threshold
    return {"target": name, "op": op, "numel": numel, "metric": metric, "measured": measured,
            "threshold": threshold, "pass": bool(ok), **extra}


def evaluate_targets(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every target of issue 15 at every CUDA size >= MIN_NUMEL that was measured; a target whose op
    was not measured (or failed) is listed once with ``measured: None`` and ``pass: False``."""
    by = _largest(records)
    out: list[dict[str, Any]] = []

    def each(op: str):
        sizes = by.get(op)
        if not sizes:
            yield None, None
            return
        for n in sorted(sizes):
            yield n, sizes[n]

    for codec in COMPRESSORS:
        op = f"encode:{codec}"
        for n, r in each(op):
            r = r or {}
            out.append(_target(f"{op} (with error feedback) >= {COPY_FRACTION} of copy bandwidth", op, n,
                               "copy_fraction", r.get("copy_fraction"), COPY_FRACTION,
                               device_copy_fraction=r.get("device_copy_fraction"), error=r.get("error")))
    for optim in OPTIMS:
        for codec in CODECS:
            op = f"apply:{optim}:{codec}"
            for n, r in each(op):
                r = r or {}
                out.append(_target(f"{op} >= {COPY_FRACTION} of copy bandwidth", op, n, "copy_fraction",
                                   r.get("copy_fraction"), COPY_FRACTION,
                                   device_copy_fraction=r.get("device_copy_fraction"), error=r.get("error")))
    for n, r in each("encode:topk"):
        r = r or {}
        same = r.get("topk_same_index_set_up_to_ties")
        speed = r.get("speedup_vs_torch_topk")
        ok = same is True and isinstance(speed, (int, float)) and speed >= TOPK_SPEEDUP
        name = f"top-k 1% >= {TOPK_SPEEDUP}x faster than torch.topk, same index set"
        out.append(_target(name, "encode:topk", n, "speedup_vs_torch_topk", speed, TOPK_SPEEDUP, ok=ok,
                           same_index_set=r.get("topk_same_index_set"), same_index_set_up_to_ties=same,
                           index_differences=r.get("topk_index_differences"), error=r.get("error")))
    for codec in CODECS:
        op = f"apply:adam:{codec}"
        for n, r in each(op):
            r = r or {}
            bound = None
            if isinstance(r.get("bytes"), int) and isinstance(r.get("payload_bytes"), int) and n:
                # decode (payload + 4n) then torch's fused Adam (4n gradient + 24n state), against ours
                bound = (r["payload_bytes"] + 32 * n) / r["bytes"]
            decode = (by.get(f"decode:{codec}") or {}).get(n) or {}
            matches = r.get("torch_fused_adam_matches")
            speed = r.get("speedup_vs_torch_fused_adam")
            ok = matches is True and isinstance(speed, (int, float)) and speed >= FUSED_ADAM_SPEEDUP
            name = f"{op}: fused decode + Adam >= {FUSED_ADAM_SPEEDUP}x faster than decode + torch fused Adam"
            out.append(_target(name, op, n, "speedup_vs_torch_fused_adam", speed, FUSED_ADAM_SPEEDUP, ok=ok,
                               same_result=matches, bound_from_bytes=round(bound, 3) if bound else None,
                               decode_copy_fraction=decode.get("copy_fraction"), error=r.get("error")))
    return out


# ------------------------------------------------------------------------------------------------
# summarize


def parse_step(text: str) -> dict[str, Any]:
    """'build=ok:41.5' or 'bench=skipped:0:no GPU' -> {"name", "status", "seconds", "note"}."""
    name, sep, rest = text.partition("=")
    parts = rest.split(":", 2)
    if not sep or not name or len(parts) < 2 or parts[0] not in STEP_STATES:
        raise ValueError(f"bad --step {text!r}: use NAME=STATUS:SECONDS[:NOTE], STATUS one of {STEP_STATES}")
    try:
        seconds = float(parts[1])
    except ValueError:
        raise ValueError(f"bad --step {text!r}: SECONDS must be a number") from None
    note = parts[2] if len(parts) > 2 else None
    return {"name": name, "status": parts[0], "seconds": seconds, "note": note}


def _read_json(path: Path) -> Any:
    if not path.exists():
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        return {"error": f"unreadable {path.name}: {e}"}


def benchmark_summary(records: Any) -> dict[str, Any] | None:
    if records is None:
        return None
    if not isinstance(records, list):
        return {"error": records.get("error") if isinstance(records, dict) else "kernels.json is not a list"}
    cuda = [r for r in records if r.get("device") == "cuda"]
    copy = [r["copy_gbps"] for r in cuda if isinstance(r.get("copy_gbps"), (int, float))]
    return {
        "records": len(records),
        "devices": sorted({str(r.get("device")) for r in records}),
        "sizes": sorted({r["numel"] for r in records if isinstance(r.get("numel"), int)}),
        "copy_gbps_median": round(statistics.median(copy), 1) if copy else None,
        "errors": [
            {"op": r.get("op"), "numel": r.get("numel"), "error": r["error"]}
            for r in records if r.get("error")
        ],
        "reference_mismatches": [
            {"op": r.get("op"), "numel": r.get("numel"), "max_abs_err": r.get("max_abs_err")}
            for r in records if r.get("matches_reference") is False
        ],
        "device_time_errors": sorted({r["device_time_error"] for r in records if r.get("device_time_error")}),
    }


def summarize(folder: Path, steps: list[dict[str, Any]]) -> dict[str, Any]:
    """summary.json's content from the files in `folder` and the steps' outcomes."""
    env = _read_json(folder / "env.json") or {}
    records = _read_json(folder / "kernels.json")
    gpu = env.get("gpu") if isinstance(env, dict) else None
    summary: dict[str, Any] = {
        "schema": 1,
        "gpu": gpu,
        "gpu_name": gpu.get("name") if gpu else None,
        "no_gpu_reason": env.get("no_gpu_reason"),
        "versions": {k: env.get(k) for k in ("torch", "torch_cuda", "python", "python_headers", "nvcc",
                                             "cmake")},
        "git": env.get("git"),
        "time_utc": env.get("time_utc"),
        "cpu_count": env.get("cpu_count"),
        "steps": steps,
        "tests": {"cuda": junit_summary(folder / "tests_cuda.xml"),
                  "engine": junit_summary(folder / "tests_engine.xml")},
        "collective_bsp": (
            "present: pyasync/transport/nccl.py exists; its tests run with the engine tests when marked cuda"
            if (REPO_ROOT / "pyasync" / "transport" / "nccl.py").exists()
            else "absent: pyasync has no collective (NCCL) transport yet: no collective BSP path to test"
        ),
        "benchmark": benchmark_summary(records),
    }
    if gpu is None:
        summary["status"] = "no GPU: skipped"
        summary["targets"] = []
        summary["targets_passed"] = summary["targets_total"] = 0
        summary["ok"] = None
        return summary
    targets = evaluate_targets(records if isinstance(records, list) else [])
    summary["targets"] = targets
    summary["targets_passed"] = sum(t["pass"] for t in targets)
    summary["targets_total"] = len(targets)
    unfinished = [s["name"] for s in steps if s["status"] in ("timeout", "skipped")]
    failed = [s["name"] for s in steps if s["status"] == "failed"]
    summary["status"] = "complete" if not unfinished else "incomplete: " + ", ".join(unfinished)
    tests_ok = all(t is not None and not t.get("error") and t["failed"] == 0 and t["errors"] == 0
                   for t in summary["tests"].values())
    summary["ok"] = not unfinished and not failed and tests_ok and summary["targets_passed"] == len(targets)
    return summary


# ------------------------------------------------------------------------------------------------
# table


def _f(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}f}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def render_table(summary: dict[str, Any], records: list[dict[str, Any]] | None = None) -> str:
    """The README's GPU section body (markdown) from a summary; `records`: the run's kernels.json, for
    the per-op times (without it only the targets are listed)."""
    if not summary.get("gpu"):
        when = summary.get("time_utc") or "an unknown time"
        return (
            "No GPU run has happened yet. The last `bench/gpu_check.sh` run "
            f"({when}) found no GPU ({summary.get('no_gpu_reason') or 'no reason recorded'}) "
            "and skipped the CUDA parts."
        )
    gpu = summary["gpu"]
    v = summary.get("versions") or {}
    bench = summary.get("benchmark") or {}
    commit = ((summary.get("git") or {}).get("commit") or "")[:12]
    mem = gpu.get("memory_bytes")
    gib = f"{mem / 2**30:.0f} GiB" if isinstance(mem, (int, float)) else "? GiB"
    lines = [
        (
            f"Measured on {gpu.get('name')} (compute capability {gpu.get('capability')}, "
            f"{gpu.get('multiprocessors')} SMs, {gib}, driver {gpu.get('driver') or '?'}), "
            f"torch {v.get('torch')} (CUDA {v.get('torch_cuda')}), commit {commit or '?'}, "
            f"{summary.get('time_utc')}. "
            f"Plain copy in the same run: {_f(bench.get('copy_gbps_median'), 0)} GB/s "
            "(median over the ops, bytes read + written). \"of copy\" is the op's GB/s over that copy's; "
            "\"GPU busy\" counts only the GPU's own work (profiler), without the host-side gaps of a call."
        ),
        "",
    ]
    targets = summary.get("targets") or []
    by_op: dict[tuple[str, Any], list[dict[str, Any]]] = {}
    for t in targets:
        by_op.setdefault((t["op"], t["numel"]), []).append(t)
    recs = {(r.get("op"), r.get("numel")): r for r in (records or []) if r.get("device") == "cuda"}
    lines.append("| op | elements | ms | of copy | GPU busy: of copy | vs torch | target | met |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for (op, numel), ts in by_op.items():
        r = recs.get((op, numel), {})
        vs = "-"
        if r.get("speedup_vs_torch_topk") is not None:
            same = "same set" if r.get("topk_same_index_set_up_to_ties") else "DIFFERENT set"
            vs = f"{_f(r['speedup_vs_torch_topk'])}x torch.topk ({same})"
        elif r.get("speedup_vs_torch_fused_adam") is not None:
            vs = f"{_f(r['speedup_vs_torch_fused_adam'])}x decode + torch fused Adam"
        wants = "; ".join(
            (f">= {t['threshold']}x" if t["metric"].startswith("speedup") else f">= {t['threshold']} of copy")
            + (f" (bytes allow {t['bound_from_bytes']}x)" if t.get("bound_from_bytes") else "")
            for t in ts
        )
        met = "; ".join(_f(t["pass"]) for t in ts)
        size = f"{numel / 1e6:g}M" if numel else "-"
        lines.append(f"| {op} | {size} | {_f(r.get('ms'), 3)} | {_f(r.get('copy_fraction'))} | "
                     f"{_f(r.get('device_copy_fraction'))} | {vs} | {wants} | {met} |")
    tests = summary.get("tests") or {}
    parts = []
    for name, t in tests.items():
        if t and not t.get("error"):
            failed = t["failed"] + t["errors"]
            parts.append(f"{name} tests: {t['passed']} passed, {failed} failed, {t['skipped']} skipped")
        else:
            parts.append(f"{name} tests: {'not run' if t is None else t['error']}")
    lines += ["", f"Targets met: {summary.get('targets_passed')} of {summary.get('targets_total')}. "
              + "; ".join(parts) + f". Status: {summary.get('status')}."]
    return "\n".join(lines)


def render_report(summary: dict[str, Any]) -> str:
    """A few lines for the end of the check's log: status, test counts and failures, missed targets."""
    lines = [f"status: {summary.get('status')} | all good: {summary.get('ok')}"]
    if not summary.get("gpu"):
        lines.append(f"no GPU: {summary.get('no_gpu_reason')}")
    for s in summary.get("steps") or []:
        note = f" ({s['note']})" if s.get("note") else ""
        lines.append(f"step {s['name']}: {s['status']} in {s['seconds']:.0f} s{note}")
    for name, t in (summary.get("tests") or {}).items():
        if t is None:
            lines.append(f"{name} tests: not run")
            continue
        if t.get("error"):
            lines.append(f"{name} tests: {t['error']}")
            continue
        lines.append(f"{name} tests: {t['passed']} passed, {t['failed']} failed, {t['errors']} errors, "
                     f"{t['skipped']} skipped")
        lines += [f"    {f['kind']}: {f['test']} | {f['message'][:160]}" for f in t["failures"][:15]]
        if not summary.get("gpu") and t["skipped"] == t["tests"]:
            lines.append("    (all skipped: no GPU)")
        elif t["skipped"]:
            lines += [f"    skipped {count}: {reason}" for reason, count in t.get("skip_reasons", {}).items()]
    bench = summary.get("benchmark")
    if bench and not bench.get("error"):
        lines.append(f"benchmark: {bench['records']} records, sizes {bench['sizes']}, copy "
                     f"{bench['copy_gbps_median']} GB/s; errors {len(bench['errors'])}, reference mismatches "
                     f"{len(bench['reference_mismatches'])}")
        lines += [f"    error: {e['op']} n={e['numel']}: {e['error'][:160]}" for e in bench["errors"][:10]]
        lines += [f"    mismatch: {m['op']} n={m['numel']} max_abs_err={m['max_abs_err']}"
                  for m in bench["reference_mismatches"][:10]]
        lines += [f"    GPU busy time: {e}" for e in bench.get("device_time_errors", [])[:3]]
    if summary.get("gpu"):
        lines.append(f"targets met: {summary.get('targets_passed')} of {summary.get('targets_total')}")
        for t in summary.get("targets") or []:
            if not t["pass"]:
                extra = "".join(f", {k} {t[k]}" for k in ("device_copy_fraction", "bound_from_bytes",
                                                          "same_index_set_up_to_ties", "same_result", "error")
                                if t.get(k) is not None)
                lines.append(f"    missed: {t['target']} | measured {_f(t['measured'], 3)}{extra}")
    lines.append(f"collective BSP: {summary.get('collective_bsp')}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    pe = sub.add_parser("env", help="write the environment JSON; print a slug of the GPU name ('none')")
    pe.add_argument("--out", required=True)
    ps = sub.add_parser("summarize", help="write DIR/summary.json and DIR/table.md")
    ps.add_argument("dir")
    ps.add_argument("--step", action="append", default=[], help="NAME=STATUS:SECONDS[:NOTE], in run order")
    pt = sub.add_parser("table", help="print the README's GPU table from a summary.json")
    pt.add_argument("summary")
    pr = sub.add_parser("report", help="print a short plain-text account of a summary.json")
    pr.add_argument("summary")
    args = p.parse_args(argv)

    if args.cmd == "env":
        env = collect_env()
        Path(args.out).write_text(json.dumps(env, indent=1) + "\n", encoding="utf-8")
        print(slug(env["gpu"]["name"] if env["gpu"] else None))
        return 0
    if args.cmd == "summarize":
        folder = Path(args.dir)
        try:
            steps = [parse_step(s) for s in args.step]
        except ValueError as e:
            p.error(str(e))
        summary = summarize(folder, steps)
        tmp = folder / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, folder / "summary.json")
        records = _read_json(folder / "kernels.json")
        table = render_table(summary, records if isinstance(records, list) else None)
        (folder / "table.md").write_text(table + "\n", encoding="utf-8")
        return 0
    path = Path(args.summary)
    summary = _read_json(path)
    if not isinstance(summary, dict) or "status" not in summary:
        print(f"error: {path} is not a gpu_check summary.json", file=sys.stderr)
        return 2
    if args.cmd == "report":
        print(render_report(summary))
        return 0
    records = _read_json(path.parent / "kernels.json")
    print(render_table(summary, records if isinstance(records, list) else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
