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
    from jaxserve.weights.hf_loader import config_from_hf

    path = resolve_model_path(os.fspath(name_or_path))
    if os.path.isdir(path):
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if orbax_io.is_orbax_dir(path):
            return orbax_io.load_orbax(path, lazy=True).config
        if os.path.isfile(os.path.join(path, "config.json")):
            with open(os.path.join(path, "config.json")) as f:
                try:
                    return config_from_hf(json.load(f))
                except (KeyError, TypeError, json.JSONDecodeError) as e:
                    raise ModelNotFoundError(f"{path}/config.json is not a model config: "
                                             f"{type(e).__name__}: {e}") from None
        if len(ggufs) != 1:
            raise ModelNotFoundError(f"{path} has no config.json, no orbax checkpoint and "
                                     f"{'several' if ggufs else 'no'} .gguf files")
        path = os.path.join(path, ggufs[0])
    with open(path, "rb") as f:
        if f.read(4) != gguf_loader.GGUF_MAGIC:
            raise ModelNotFoundError(f"{path} is not a GGUF file (unsupported file type)")
    g = gguf_loader.read_gguf(path)
    emb = g.tensors.get("token_embd.weight")
    if emb is None:
        raise ModelNotFoundError(f"{path}: GGUF has no token_embd.weight")
    config = gguf_loader.config_from_gguf(g.metadata, n_vocab_tensor=emb.shape[0],
                                          has_output="output.weight" in g.tensors)
    return gguf_loader.with_rope_freq_factors(g, config)
