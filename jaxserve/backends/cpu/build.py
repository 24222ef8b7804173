"""Building the CPU kernels' library (kernels.py loads it), at install time or on first use.

At install: `pip install` runs setup.py's build step, which loads this file on its own (the
package's other modules need the runtime dependencies, which a build environment lacks) and
builds `built/cpu_kernels-<key>.so` into the package: the wheel's, or the source tree's for
an editable install (git ignores built/). The library holds this machine's code
(-march=native), so the wheel is tagged for the platform, and a copy taken to another CPU
misses the key below.

On first use, when no install build carries the current key (none was made, or the sources,
flags, jaxlib's FFI headers or the CPU changed since, as in an editable checkout being
edited): the same build into $XDG_CACHE_HOME/jaxserve/kernels (or ~/.cache), where a new build
removes the builds unused for STALE_DAYS.

The key hashes everything the library is compiled from: the sources and headers, the compiler
flags, the XLA FFI headers jaxlib ships (the only part of JAX compiled in; XLA checks the FFI
API version when a handler is registered) and the CPU's features.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import jax

PACKAGE_DIR = Path(__file__).resolve().parent
# The library's translation units and the headers they include: every .cc and .h here
# (package data ships exactly these). The largest first: its compile is the longest, so the
# parallel build starts it first.
SOURCES = tuple(sorted(PACKAGE_DIR.glob("*.cc"), key=lambda p: (-p.stat().st_size, p.name)))
HEADERS = tuple(sorted(PACKAGE_DIR.glob("*.h")))
INSTALL_DIR = PACKAGE_DIR / "built"  # the install-time build
STALE_DAYS = 7
# Associative math lets the compiler vectorise dot products and sums.
_FLAGS = ("-O3", "-std=c++20", "-fPIC", "-fno-math-errno", "-fno-trapping-math",
          "-fno-signed-zeros", "-fassociative-math", "-ffp-contract=fast")
# The instruction set the library is built for: this CPU's. The sources pick their AVX-512,
# AVX2+FMA, AMX-BF16 or portable branches from the macros these flags define.
NATIVE = ("-march=native",)


def cpu_features() -> str:
    """The CPU's feature line as Linux lists it ("flags : fpu ... avx512f ..."), or the
    processor's name elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _ffi_headers() -> list[Path]:
    return sorted((Path(jax.ffi.include_dir()) / "xla" / "ffi").rglob("*.h"))


def library_name() -> str:
    """cpu_kernels-<key>.so: the key hashes what the library is compiled from (module
    docstring), so a build with this name is current."""
    key = hashlib.sha256()
    for path in (*sorted(SOURCES), *HEADERS, *_ffi_headers()):
        key.update(path.name.encode() + b"\0" + path.read_bytes())
    key.update(" ".join(_FLAGS + NATIVE).encode())
    key.update(cpu_features().encode())
    return f"cpu_kernels-{key.hexdigest()[:16]}.so"


def cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "jaxserve" / "kernels"


def library() -> Path:
    """The current library: the install's build, else the cache's, built there first if
    missing. RuntimeError (no compiler, a failed build) or OSError says why not."""
    name = library_name()
    installed = INSTALL_DIR / name
    if installed.exists():
        return installed
    path = cache_dir() / name
    if not path.exists():
        build(path)
        _prune(path)
    os.utime(path)  # in use: not stale
    return path


def install_build(directory: Path) -> Path:
    """The install-time build into `directory` (a package's built/), reused when current;
    the builds of earlier sources there are removed."""
    path = directory / library_name()
    if not path.exists():
        build(path)
    for old in directory.glob("cpu_kernels-*.so"):
        if old != path:
            old.unlink(missing_ok=True)
    return path


def _prune(keep: Path) -> None:
    """Remove other builds in keep's directory not loaded for STALE_DAYS (each load touches its
    file): every edit of the sources leaves a library behind."""
    cutoff = time.time() - STALE_DAYS * 86400
    for old in keep.parent.glob("cpu_kernels-*.so"):
        try:
            if old != keep and old.stat().st_mtime < cutoff:
                old.unlink()
        except OSError:
            pass  # another process removed it first


def compiler() -> str | None:
    """The C++ compiler the kernels build with: $CXX, else g++ or c++ on PATH (None if none)."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def compile_command(srcs, output, arch=NATIVE, *, shared: bool = True) -> list[str]:
    """The compiler command line that builds the sources `srcs` with the kernels' flags for the
    instruction set that the flags `arch` name (NATIVE: this CPU's; ("-march=haswell",): AVX2
    and FMA, wherever it runs): into the shared library `output`, or with shared=False only
    compiles them (one source) into the object file `output` (/dev/null to check a build)."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++/c++ or $CXX) to build the CPU kernels")
    return [cxx, *_FLAGS, *arch, f"-I{jax.ffi.include_dir()}", "-shared" if shared else "-c",
            *map(str, srcs), "-o", str(output)]


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"building the CPU kernels failed:\n{done.stderr[-2000:]}")


def build(path: Path) -> None:
    """Each source compiled on its own core (they are independent: a cold start waited for
    them one after another, 36 s on an idle 2-core machine), then linked into `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        objects = [Path(tmp) / f"{src.stem}.o" for src in SOURCES]
        workers = min(len(SOURCES), os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda so: _run(compile_command([so[0]], so[1], shared=False)),
                          zip(SOURCES, objects)))
        library = Path(tmp) / path.name
        _run(compile_command(objects, library))
        os.replace(library, path)  # atomic: a concurrent build of the same key is harmless
