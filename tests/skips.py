"""Skip guards the tests share."""

from __future__ import annotations

import pytest

from jaxserve.backends.cpu import kernels as cpu_kernels


def need_backend(backend: str) -> None:
    """Skips a test of the cpu backend where its C++ kernels did not build."""
    if backend == "cpu" and not cpu_kernels.available():
        pytest.skip(f"CPU kernel not built: {cpu_kernels.unavailable_reason()}")
