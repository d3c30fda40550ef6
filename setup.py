"""Build pyasync._C with CMake + Ninja (the shape of pybind11's cmake_example).

Environment variables mapped to CMake options:
  PYASYNC_WITH_CUDA   AUTO (default) | ON | OFF
  PYASYNC_CUDA_ARCHS  CUDA architectures, default "80;90" ("native" builds for the local GPU)
  PYASYNC_CPU_ARCH    -march for the CPU kernels, default "native" ("" for the compiler's baseline)
  PYASYNC_SANITIZE    1 to build with AddressSanitizer + UndefinedBehaviorSanitizer
  PYASYNC_BUILD_TYPE  Release (default) | Debug | RelWithDebInfo
  CMAKE_BUILD_PARALLEL_LEVEL  parallel compile jobs (Ninja's default otherwise)
"""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: CMakeExtension) -> None:
        import pybind11

        out = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        env = os.environ
        args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out}{os.sep}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DCMAKE_BUILD_TYPE={env.get('PYASYNC_BUILD_TYPE', 'Release')}",
            f"-DPYASYNC_WITH_CUDA={env.get('PYASYNC_WITH_CUDA', 'AUTO')}",
            f"-DPYASYNC_CUDA_ARCHS={env.get('PYASYNC_CUDA_ARCHS', '80;90')}",
            f"-DPYASYNC_CPU_ARCH={env.get('PYASYNC_CPU_ARCH', 'native')}",
            f"-DPYASYNC_SANITIZE={'ON' if env.get('PYASYNC_SANITIZE', '0') not in ('', '0') else 'OFF'}",
            "-G",
            "Ninja",
        ]
        subprocess.run(["cmake", str(ROOT), *args], cwd=build_dir, check=True)
        subprocess.run(["cmake", "--build", "."], cwd=build_dir, check=True)


setup(ext_modules=[CMakeExtension("pyasync._C")], cmdclass={"build_ext": CMakeBuild})
