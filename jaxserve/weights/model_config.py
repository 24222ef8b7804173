"""A model's ModelConfig without its weights: what compiling for another target needs
(`jaxserve compile`). A GGUF file's header, a Hugging Face directory's config.json (safetensors
and tokenizer optional), an orbax checkpoint's saved config; a known name resolves to its file."""

from __future__ import annotations

import json
import os

from jaxserve.config import ModelConfig


def read_model_config(name_or_path: str) -> ModelConfig:
    """The ModelConfig of a model name, GGUF file, HF directory (config.json alone is enough) or
    orbax directory; no tensor data is read. ModelNotFoundError (a ValueError) otherwise."""
    from jaxserve.weights import ModelNotFoundError, gguf_loader, orbax_io, resolve_model_path

    path = resolve_model_path(os.fspath(name_or_path))
    if os.path.isdir(path):
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if orbax_io.is_orbax_dir(path):
            return orbax_io.load_orbax(path, lazy=True).config
        if os.path.isfile(os.path.join(path, "config.json")):
            return hf_config(path)
        if len(ggufs) != 1:
            raise ModelNotFoundError(f"{path} has no config.json, no orbax checkpoint and "
                                     f"{'several' if ggufs else 'no'} .gguf files")
        path = os.path.join(path, ggufs[0])
    with open(path, "rb") as f:
        if f.read(4) != gguf_loader.GGUF_MAGIC:
            raise ModelNotFoundError(f"{path} is not a GGUF file (unsupported file type)")
    return gguf_loader.gguf_model_config(gguf_loader.read_gguf(path))


def hf_config(directory: str) -> ModelConfig:
    """A Hugging Face directory's config.json as a ModelConfig; ModelFileError naming the file
    when it is not JSON, not an object, lacks a field or holds one the model cannot take."""
    from jaxserve.weights import ModelFileError
    from jaxserve.weights.hf_loader import config_from_hf

    path = os.path.join(directory, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            fields = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{path} is not JSON: {e}") from None
    if not isinstance(fields, dict):
        raise ModelFileError(f"{path} is not a JSON object")
    try:
        return config_from_hf(fields)
    except KeyError as e:
        raise ModelFileError(f"{path} has no {e.args[0]!r} field") from None
    except (TypeError, ValueError) as e:
        raise ModelFileError(f"{path}: {e}") from None
