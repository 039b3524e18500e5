"""Builds the torchreplay._C extension with CMake (CMakeLists.txt) for `pip install .`.

Extra CMake arguments come from the CMAKE_ARGS environment variable (e.g.
CMAKE_ARGS="-DCMAKE_PREFIX_PATH=/opt/deps/usr -DTORCHREPLAY_CUDA=ON")."""
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        args = [f"-DPython_EXECUTABLE={sys.executable}", f"-DTORCHREPLAY_OUTPUT_DIR={out_dir}",
                "-DCMAKE_BUILD_TYPE=Release"]
        if shutil.which("ninja"):
            args += ["-G", "Ninja"]
        args += shlex.split(os.environ.get("CMAKE_ARGS", ""))
        subprocess.check_call(["cmake", "-S", str(ROOT), "-B", str(build_dir), *args])
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        subprocess.check_call(["cmake", "--build", str(build_dir), "--target", "_C", "-j", jobs])


setup(
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=[CMakeExtension("torchreplay._C")],
    cmdclass={"build_ext": CMakeBuild},
)
