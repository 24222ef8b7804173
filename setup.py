"""The install-time build of the CPU kernels (pyproject.toml holds everything else): `pip install`
builds them here, so that the first `jaxserve serve` finds them built, as an engine's compiled
kernels come with its install. The build is jaxserve/backends/cpu/build.py's; without a C++
compiler the install goes on and the engine builds them on first use or runs without them."""

import importlib.util
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

CPU_PACKAGE = Path("jaxserve", "backends", "cpu")


def _build_module():
    """build.py loaded by itself: importing the package would import jaxserve's runtime
    dependencies, which the build environment lacks (it has jax, for the FFI headers)."""
    spec = importlib.util.spec_from_file_location(
        "jaxserve_cpu_build", Path(__file__).resolve().parent / CPU_PACKAGE / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithCpuKernels(build_py):
    """build_py, then the CPU kernels into the package's built/: the wheel's, or the source
    tree's for an editable install."""

    def run(self):
        super().run()
        root = Path(__file__).resolve().parent if self.editable_mode else Path(self.build_lib)
        try:
            path = _build_module().install_build(root / CPU_PACKAGE / "built")
            print(f"jaxserve: built the CPU kernels: {path}", file=sys.stderr)
        except (ImportError, OSError, RuntimeError) as e:
            print(f"jaxserve: the CPU kernels were not built at install ({e}); the engine "
                  "builds them on first use", file=sys.stderr)


class MachineCodeDistribution(Distribution):
    """The package holds a library compiled for this machine: a wheel tagged for the
    platform, not pure Python."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildPyWithCpuKernels}, distclass=MachineCodeDistribution)
