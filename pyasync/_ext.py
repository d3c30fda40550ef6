"""The only importer of ``pyasync._C``.

A missing or CPU-only build becomes one actionable error here, raised when a kernel is first needed
(importing ``pyasync`` itself never fails because of the extension, so ``pyasync.reference`` and the
pure-Python policies stay usable for inspection). The original ImportError is chained, never
swallowed.
"""

from __future__ import annotations

import functools
from types import ModuleType

_BUILD_HINT = (
    "Build it from the source tree with `pip install -e .` (needs a C++17 compiler, CMake >= 3.18 and "
    "Ninja; pip installs the last two), or reinstall pyasync with `pip install .`."
)


@functools.cache
def _load() -> ModuleType:
    try:
        from pyasync import _C
    except ImportError as e:
        raise ImportError(
            f"pyasync's compiled core (pyasync._C) could not be imported: {e}. {_BUILD_HINT}"
        ) from e
    return _C


def C() -> ModuleType:
    """The compiled module; raises ImportError with build instructions when it is missing."""
    return _load()


def available() -> bool:
    """True when the compiled core imports."""
    try:
        _load()
    except ImportError:
        return False
    return True


def has_cuda() -> bool:
    """True when the core was compiled with the CUDA kernels (says nothing about a GPU being present)."""
    return bool(C().has_cuda())


def cuda_device_count() -> int:
    """Usable CUDA devices as seen by the core (0 without a driver or without CUDA kernels)."""
    return int(C().cuda_device_count())


def require_cuda() -> ModuleType:
    """The compiled module, checked to have CUDA kernels and a usable GPU; else a RuntimeError."""
    c = C()
    if not c.has_cuda():
        raise RuntimeError(
            "pyasync was built without CUDA kernels, but a CUDA tensor was passed. Rebuild on a machine "
            "with nvcc (`PYASYNC_WITH_CUDA=ON pip install -e .`) or move the tensors to the CPU."
        )
    if c.cuda_device_count() == 0:
        raise RuntimeError(
            "pyasync's CUDA kernels are built but no usable CUDA GPU is visible (driver missing or "
            "CUDA_VISIBLE_DEVICES empty). Use CPU tensors or fix the GPU setup."
        )
    return c


def set_num_threads(n: int) -> None:
    """Threads the CPU kernels use when a call does not say (0 restores the default:
    ``PYASYNC_NUM_THREADS``, else OpenMP's default)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"num_threads must be an int >= 0, got {n!r}")
    C().set_num_threads(n)


def get_num_threads() -> int:
    """Threads the CPU kernels use when a call does not say."""
    return int(C().get_num_threads())
