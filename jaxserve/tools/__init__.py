"""Tools beside the engine: analytic KV accounting, the serving benchmark, plots. What only they
need (matplotlib, httpx) is an optional extra, `pip install 'jaxserve[bench]'`."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message says which extra brings it."""


def require(module: str, extra: str = "bench") -> ModuleType:
    """Import `module`, or raise MissingExtra naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(f"this needs {module}, an optional dependency: pip install "
                           f"'jaxserve[{extra}]'") from None
