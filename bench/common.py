"""The shared benchmark harness: machine info, timing, copy bandwidth, JSON results and tables.

Every benchmark in ``bench/`` uses this module so that all figures are taken the same way:

* timing: warm-up calls, then ``repeats`` samples taken round-robin over all candidates of one
  comparison (the pyasync kernel, the eager reference, the compiled reference, a plain copy), so that
  a change in background load hits every candidate alike; each sample times ``inner`` back-to-back
  calls (calibrated so that one sample lasts at least ``min_sample_s``) and reports the time of one
  call; the figure is the median over samples. A time budget per candidate stops a slow candidate
  (a reference many times slower than the kernel) after a few samples. CPU: ``time.perf_counter``;
  CUDA: CUDA events on the current stream.
* bandwidth: ``bytes / seconds`` in GB/s (1 GB = 1e9 bytes), where ``bytes`` is what the op must read
  plus write (each op documents its model); ``copy_gbps`` is a plain ``Tensor.copy_`` moving the same
  number of bytes (half read, half written) with the same threads, timed in the same round-robin.
* results: a JSON list of records; every record carries the ``machine`` and ``command`` it was taken
  with, so each record stands alone (see bench/README.md).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------------
# Machine and build information


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_simd() -> list[str]:
    """The vector extensions the kernels' -march=native build can use: the same model name hides
    machines with and without AVX-512, and the CPU figures differ by up to 7x between them."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    wanted = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl")
                    return [x for x in wanted if x in have]
    except OSError:
        pass
    return []


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(
            ["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def git_info() -> dict[str, Any]:
    """Commit of the source tree and whether it has uncommitted changes (None outside a checkout)."""
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def pyasync_info() -> dict[str, Any]:
    """Version and build facts of the pyasync being measured; ``import_error`` when ``_C`` is missing."""
    info: dict[str, Any] = {"version": None, "path": None, "available": False}
    try:
        import pyasync
        from pyasync import _ext
    except ImportError as e:
        info["import_error"] = str(e)
        return info
    info["version"] = getattr(pyasync, "__version__", None)
    where = Path(pyasync.__file__).resolve().parent
    # The source tree's own copy is recorded as "pyasync" (no machine path in committed results).
    if where == REPO_ROOT / "pyasync":
        info["path"] = "pyasync"
    else:
        info["path"] = "site-packages" if "site-packages" in where.parts else "outside the source tree"
    try:
        _ext.C()
    except ImportError as e:
        info["import_error"] = str(e)
        return info
    info["available"] = True
    info["has_cuda"] = _ext.has_cuda()
    info["cuda_device_count"] = _ext.cuda_device_count()
    info["num_threads"] = _ext.get_num_threads()
    return info


def machine_info(device: str = "cpu") -> dict[str, Any]:
    """Everything that decides the figures: CPU, GPU, versions, threads and the pyasync build."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count()
    info: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "cpu_simd": _cpu_simd(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_num_threads": torch.get_num_threads(),
        "numpy": _numpy_version(),
        "gpu": None,
        "pyasync": pyasync_info(),
        "git": git_info(),
        "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info["gpu"] = {
            "name": props.name,
            "memory_bytes": props.total_memory,
            "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
        }
    return info


def _numpy_version() -> str | None:
    try:
        import numpy
    except ImportError:
        return None
    return numpy.__version__


def loadavg() -> float | None:
    """The 1-minute load average (runnable processes; above the core count means the figures are
    shared with other work), None where the OS does not say."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def command_line() -> str:
    """The command that produced the results, as one shell-quoted string."""
    return " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])


def set_threads(n: int | None) -> int:
    """Give pyasync's CPU kernels and torch the same number of threads (None: pyasync's default,
    which is OpenMP's, i.e. all cores) so that comparisons are fair; returns the count used."""
    from pyasync import _ext

    if n is None:
        _ext.set_num_threads(0)
        n = _ext.get_num_threads()
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"threads must be an int >= 1, got {n!r}")
    _ext.set_num_threads(n)
    torch.set_num_threads(n)
    return n


# ------------------------------------------------------------------------------------------------
# Timing


@dataclass
class Timing:
    """Times of one candidate; all in milliseconds per call."""

    samples_ms: list[float] = field(default_factory=list)  # one per sample: sample time / inner
    inner: int = 1  # calls per sample

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def min_ms(self) -> float:
        return min(self.samples_ms)

    @property
    def iqr_ms(self) -> float:
        """Interquartile range of the samples (a spread measure robust to outliers)."""
        if len(self.samples_ms) < 2:
            return 0.0
        q = statistics.quantiles(self.samples_ms, n=4, method="inclusive")
        return q[2] - q[0]


def synchronize(device: torch.device) -> None:
    """Wait for queued work on `device` (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sample(fn: Callable[[], Any], inner: int, device: torch.device) -> float:
    """Seconds per call of `inner` back-to-back calls."""
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / inner
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def time_candidates(
    fns: Mapping[str, Callable[[], Any]],
    *,
    device: torch.device,
    repeats: int,
    warmup: int,
    min_sample_s: float,
    budget_s: float | None = None,
    min_repeats: int = 3,
) -> dict[str, Timing]:
    """Time every zero-argument callable in `fns` round-robin; see the module docstring.

    Returns one :class:`Timing` per name. `repeats` >= 1 samples each after `warmup` untimed calls
    (at least one, which also calibrates `inner`; fewer once they pass budget_s / 4); `min_sample_s`
    (seconds) is the shortest sample, reached by repeating calls inside it.
    `budget_s` (seconds, None: no limit) caps the sampling time of each candidate: once a candidate
    has spent it and has `min_repeats` samples, it sits out the remaining rounds (so a reference 100x
    slower than the kernel does not dominate the run; its median then rests on fewer samples).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    out: dict[str, Timing] = {}
    for name, fn in fns.items():
        # Warm-up calls, timed one by one for the calibration of `inner` (the fastest counts).
        times = []
        for _ in range(max(warmup, 1)):
            synchronize(device)
            times.append(_sample(fn, 1, device))
            if budget_s is not None and sum(times) >= budget_s / 4:
                break  # a slow candidate is warm after one call
        one = min(times)
        inner = max(1, min(10_000, math.ceil(min_sample_s / max(one, 1e-9))))
        out[name] = Timing(inner=inner)
    spent = dict.fromkeys(fns, 0.0)
    for r in range(repeats):
        for name, fn in fns.items():
            if budget_s is not None and r >= min_repeats and spent[name] >= budget_s:
                continue
            synchronize(device)
            t = _sample(fn, out[name].inner, device)
            spent[name] += t * out[name].inner
            out[name].samples_ms.append(t * 1e3)
    return out


@dataclass
class DeviceBusy:
    """GPU time of one call, from the profiler (see :func:`device_busy`)."""

    ms: float | None  # GPU busy time per call, milliseconds; None when it could not be measured
    kernels: list[str] = field(default_factory=list)  # GPU activity names (kernels, memsets, copies)
    error: str | None = None  # why ms is None, or a warning (e.g. no pyasync kernel was seen)


def device_busy(
    fn: Callable[[], Any], device: torch.device, calls: int = 10, expect: str = "pyasync"
) -> DeviceBusy:
    """GPU busy time of one call of `fn`: the summed durations of every kernel, memset and memory copy
    that the torch profiler (CUPTI) records during `calls` calls, divided by `calls`.

    :func:`time_candidates` times calls with CUDA events, which also counts the host-side gaps of a
    call (Python argument checks, a host sync inside it) whenever the GPU runs out of queued work; this
    counts only the GPU's own work, so ``ms`` against ``device_busy(...).ms`` says how much of a call
    the GPU spent working. `expect`: a substring that some activity name should contain (the
    pyasync kernels live in namespace ``pyasync``); when none does, ``error`` says so, since a
    profiler that cannot see those kernels would report only torch's own work. CUDA only; a failure
    of the profiler becomes ``error``, never an exception.
    """
    if device.type != "cuda":
        return DeviceBusy(None, [], "device_busy needs a CUDA device")
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        fn()  # warm: allocations and lazy initialisation stay out of the profile
        synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            synchronize(device)
        per_name: dict[str, float] = {}
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                per_name[e.name] = per_name.get(e.name, 0.0) + e.time_range.elapsed_us()
    except Exception as e:
        text = str(e).strip().splitlines()
        return DeviceBusy(None, [], f"{type(e).__name__}: {text[0][:300] if text else ''}")
    if not per_name:
        return DeviceBusy(None, [], "the profiler recorded no GPU activity")
    names = sorted(per_name, key=per_name.get, reverse=True)
    error = None
    if expect and not any(expect in name for name in names):
        error = f"no GPU activity named like {expect!r} was recorded: the figure may miss the kernels"
    return DeviceBusy(sum(per_name.values()) / calls / 1e3, [n[:160] for n in names[:12]], error)


# ------------------------------------------------------------------------------------------------
# Copy bandwidth


def copy_candidate(nbytes: int, device: torch.device) -> tuple[Callable[[], Any], int]:
    """A plain copy that moves about `nbytes` bytes: ``dst.copy_(src)`` of nbytes/2 bytes each way.

    Returns (fn, exact bytes moved: read + written). Both buffers are touched first so that no page
    fault is timed. Uses torch's threads (see :func:`set_threads`).
    """
    if nbytes < 8:
        raise ValueError(f"nbytes must be >= 8, got {nbytes}")
    n = max(1, nbytes // 8)  # fp32 elements per buffer: 4 bytes read + 4 bytes written each
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.zeros(n, dtype=torch.float32, device=device)
    return (lambda: dst.copy_(src)), 8 * n


def gbps(nbytes: int, ms: float) -> float:
    """GB/s (1e9 bytes per second) for `nbytes` moved in `ms` milliseconds."""
    return nbytes / (ms * 1e-3) / 1e9


# ------------------------------------------------------------------------------------------------
# Results


def write_results(path: str | None, records: Sequence[Mapping[str, Any]]) -> None:
    """Write `records` as one JSON list to `path` (atomically: a temp file, then a rename); NaN and
    Inf become null. No-op when `path` is empty."""
    if not path:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump([_finite(r) for r in records], f, indent=1, allow_nan=False, default=_json_default)
        f.write("\n")
    os.replace(tmp, p)


def _finite(o: Any) -> Any:
    """`o` with every NaN/Inf float replaced by None (strict JSON has no such numbers)."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, Mapping):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def _json_default(o: Any) -> Any:
    if isinstance(o, (torch.device, torch.dtype, Path)):
        return str(o)
    raise TypeError(f"cannot write {type(o).__name__} to JSON")


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v == 0 or not math.isfinite(v):
            return str(v)
        a = abs(v)
        return f"{v:.3f}" if a < 10 else (f"{v:.1f}" if a < 1000 else f"{v:.0f}")
    return str(v)


def format_table(records: Iterable[Mapping[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """A plain-text table of `records`; `columns` are (record key, header) pairs."""
    rows = [[h for _, h in columns]]
    rows += [[_fmt(r.get(k)) for k, _ in columns] for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = []
    for j, row in enumerate(rows):
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def parse_size(s: str) -> int:
    """'25M' -> 25_000_000 elements (K, M, G are powers of 1000; a plain int is taken as is)."""
    t = s.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(t[-1:], 1)
    num = t[:-1] if mult != 1 else t
    try:
        v = float(num) * mult
    except ValueError:
        raise ValueError(f"bad size {s!r}: use an element count such as 1000000, 1M or 25M") from None
    if v < 1 or v != int(v):
        raise ValueError(f"bad size {s!r}: must be a whole number of elements >= 1")
    return int(v)
