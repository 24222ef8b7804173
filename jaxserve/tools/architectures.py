"""Named KV architectures (configs/architectures.json): the models kv_budget's plots compare."""

from __future__ import annotations

import json
import os

from jaxserve.tools.kv_budget import KVArchitecture


def default_architectures_path() -> str:
    """``configs/architectures.json`` at the repository root."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.join(root, "configs", "architectures.json")


def load_architectures(path: str | None = None) -> list[KVArchitecture]:
    """Read ``{"architectures": [{"name", "num_layers", "num_kv_heads", "head_dim",
    "dtype_bytes"}, ...]}``."""
    path = path or default_architectures_path()
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"architectures file not found: {path}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"architectures file {path} is not valid JSON: {e}") from None
    entries = data.get("architectures") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: expected a non-empty list under 'architectures'")
    keys = ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes")
    out = []
    for i, e in enumerate(entries):
        missing = [k for k in ("name",) + keys if k not in e]
        if missing:
            raise ValueError(f"{path}: architecture #{i} lacks {missing}")
        out.append(KVArchitecture(name=str(e["name"]), **{k: e[k] for k in keys}))
    return out
