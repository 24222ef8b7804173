"""Models from outside the tree: `jaxserve.register_model(architecture, model)` and the loading of
a Hugging Face directory whose config.json names a registered architecture.

    class MyLlama(nnx.Module):                   # a flax NNX module ...
        def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs): ...
        def __call__(self, token_ids, metadata, attention): ...   # -> hidden f[T, H]
    jaxserve.register_model("MyLlamaForCausalLM", MyLlama)

    def my_llama(params, token_ids, metadata, attention): ...     # ... or a pure function
    jaxserve.register_model("MyLlamaForCausalLM", my_llama)

The engine does the rest: paging (model/custom.py gives the model `attention`), scheduling,
the LM head and sampling, and placement on its mesh (runtime/custom_model.py). A module is built
abstractly (nnx.eval_shape) and its parameters are filled from the checkpoint: by default the
parameter at path `model.layers.0.self_attn.q_proj.kernel` is the tensor
`model.layers.0.self_attn.q_proj.weight` transposed (`default_weight`); `weights=` replaces the
rule. A function's params are the checkpoint's tensors by name, as stored. The LM head is the
checkpoint's `lm_head.weight` ([V, H]), or the embedding when the config ties them (`lm_head=`
names another tensor); the model returns the final (normed) hidden states.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import os
from typing import Any, Callable, Mapping

import numpy as np

from jaxserve.config import ModelConfig

_REGISTRY: dict[str, "RegisteredModel"] = {}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True, eq=False)
class RegisteredModel:
    architecture: str
    model: Any  # an nnx.Module subclass, or a function (params, token_ids, metadata, attention)
    is_module: bool
    weights: Callable | None  # module: (param path, checkpoint) -> array; None: default_weight
    partition: Callable | None  # function: (tensor name, shape) -> PartitionSpec | None
    config: Callable | None  # config.json (dict) -> ModelConfig; None: read_config
    lm_head: str | None  # the head tensor [V, H]; None: lm_head.weight, or the tied embedding

    @functools.lru_cache(maxsize=None)
    def abstract(self, cfg: ModelConfig):
        """(graphdef, parameter State of ShapeDtypeStructs) of the module built for cfg, on a
        one-device mesh with the engine's axis names (so that its partition annotations are
        checked and kept: NNX shards annotated variables as they are made)."""
        import jax
        from flax import nnx
        from jax.sharding import Mesh

        mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("dp", "tp"))
        try:
            with jax.set_mesh(mesh):
                module = nnx.eval_shape(lambda: self.model(cfg, rngs=nnx.Rngs(0)))
        except Exception as e:
            raise ValueError(f"building the registered module {self.model.__name__}(config, "
                             f"rngs=...) failed (partition annotations may name the engine's "
                             f"mesh axes 'tp' and 'dp' only): {type(e).__name__}: {e}") from e
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)
        if jax.tree_util.tree_leaves(rest):
            names = sorted(_dotted(p) for p, _ in jax.tree_util.tree_flatten_with_path(rest)[0])
            raise ValueError(f"the registered module {self.model.__name__} holds state other "
                             f"than nnx.Param ({names[:4]}): a served module holds its "
                             "weights only (no rngs, caches or batch statistics)")
        return graphdef, params

    def call(self, cfg: ModelConfig, params, token_ids, metadata, attention):
        """The model on its params: hidden f[T, H]."""
        if not self.is_module:
            return self.model(params, token_ids, metadata, attention)
        from flax import nnx

        return nnx.merge(self.abstract(cfg)[0], params)(token_ids, metadata, attention)

    def partition_specs(self, params) -> list:
        """The PartitionSpec of each leaf of params["model"], in tree_leaves order: the
        module's annotations (nnx.with_partitioning), a function's `partition` rule."""
        import jax
        from jax.sharding import PartitionSpec as P

        if self.is_module:
            from flax import nnx

            return jax.tree_util.tree_leaves(nnx.get_partition_spec(params),
                                             is_leaf=lambda x: isinstance(x, P))
        rule = self.partition or (lambda name, shape: None)
        return [P() if (s := rule(name, x.shape)) is None else P(*s)
                for name, x in sorted(params.items())]


def _dotted(path) -> str:
    """A key path in a State or dict -> "model.layers.0.self_attn.q_proj.kernel"."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", ""))) for k in path
                    if getattr(k, "name", None) != "value")


def register_model(architecture: str, model, *, weights: Callable | None = None,
                   partition: Callable | None = None, config: Callable | None = None,
                   lm_head: str | None = None) -> None:
    """Serve checkpoints whose config.json names `architecture` with `model`: a flax NNX module
    class built as model(config: ModelConfig, rngs=nnx.Rngs) and called as
    module(token_ids, metadata, attention), or a function model(params, token_ids, metadata,
    attention); either returns the final hidden states f[T, H] (model/custom.py says what
    metadata and attention are). weights: (module parameter path, checkpoint) -> array, for a
    module whose parameters do not follow default_weight's naming; partition: (tensor name,
    shape) -> PartitionSpec over the mesh axis "tp" (or None: replicated), a function's
    sharding (a module's is its nnx.with_partitioning annotations); config: config.json as a
    dict -> ModelConfig (default: read_config); lm_head: the head tensor's name."""
    if not isinstance(architecture, str) or not architecture.isidentifier():
        raise ValueError(f"register_model: the architecture must be a name as config.json's "
                         f"'architectures' lists it (e.g. 'MyLlamaForCausalLM'), got "
                         f"{architecture!r}")
    from jaxserve.weights.hf_loader import _ARCHITECTURES

    if architecture in _ARCHITECTURES:
        raise ValueError(f"register_model: {architecture!r} is a built-in architecture; "
                         "register yours under its own name")
    is_module = _is_nnx_module(model)
    if is_module:
        if partition is not None:
            raise ValueError("register_model: partition= is a function's sharding; a module's "
                             "is its nnx.with_partitioning annotations")
        _check_signature(model.__init__, "(self, config, *, rngs)", None, None, rngs=None)
        if not any("__call__" in vars(c) for c in model.__mro__):  # (else: its metaclass's)
            raise TypeError(f"register_model: {model.__name__} defines no __call__(self, "
                            "token_ids, metadata, attention)")
        _check_signature(model.__call__, "(self, token_ids, metadata, attention)",
                         None, None, None, None)
    elif callable(model) and not isinstance(model, type):
        if weights is not None:
            raise ValueError("register_model: weights= maps a module's parameters; a "
                             "function's params are the checkpoint's tensors by name")
        _check_signature(model, "(params, token_ids, metadata, attention)",
                         None, None, None, None)
    else:
        raise TypeError(f"register_model: model must be a flax nnx.Module subclass or a "
                        f"function (params, token_ids, metadata, attention) -> hidden states, "
                        f"got {model!r}")
    entry = RegisteredModel(architecture, model, is_module, weights, partition, config, lm_head)
    known = _REGISTRY.get(architecture)
    if known is not None and _fields(known) != _fields(entry):
        raise ValueError(f"register_model: {architecture!r} is already registered to "
                         f"{known.model!r} (the compiled steps of this process keep it)")
    _REGISTRY.setdefault(architecture, entry)


def _fields(entry: RegisteredModel) -> tuple:
    return tuple(getattr(entry, f.name) for f in dataclasses.fields(entry))


def _is_nnx_module(model) -> bool:
    if not isinstance(model, type):
        return False
    from flax import nnx

    if issubclass(model, nnx.Module):
        return True
    raise TypeError(f"register_model: the class {model.__name__} is not a flax nnx.Module")


def _check_signature(fn, expected: str, *args, **kwargs) -> None:
    """A TypeError naming the expected signature unless fn takes args and kwargs."""
    sig = inspect.signature(fn)
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"register_model: {getattr(fn, '__qualname__', fn)} must take "
                        f"{expected}; its signature is {sig} ({e})") from None


def lookup(architecture: str) -> RegisteredModel | None:
    return _REGISTRY.get(architecture)


def registered_names() -> list[str]:
    return sorted(_REGISTRY)


# --- loading -----------------------------------------------------------------------------------

def architecture_of(directory: str) -> RegisteredModel | None:
    """The registered model a Hugging Face directory's config.json names; None for a built-in
    one (or none named: the built-in loader reads model_type); a clear error for an
    architecture neither knows."""
    from jaxserve.weights.hf_loader import _ARCHITECTURES
    from jaxserve.weights.pooling import causal_lm_name

    with open(os.path.join(directory, "config.json")) as f:
        try:
            archs = json.load(f).get("architectures") or []
        except (json.JSONDecodeError, AttributeError):
            return None  # the built-in loader says what is wrong with it
    if not archs or any(causal_lm_name(a) in _ARCHITECTURES for a in archs):
        return None
    if not any(a in _REGISTRY for a in archs):
        _load_plugins()
    entry = next((_REGISTRY[a] for a in archs if a in _REGISTRY), None)
    if entry is None:
        raise ValueError(f"unsupported architecture {archs!r}: built in are "
                         f"{sorted(_ARCHITECTURES)}; registered (jaxserve.register_model) "
                         f"{registered_names() or 'none'}")
    return entry


PLUGIN_GROUP = "jaxserve.models"


def _load_plugins() -> None:
    """Installed packages' entry points in group "jaxserve.models" (as vLLM's plugins), each a
    function that calls register_model, called once when a checkpoint names an architecture
    not yet registered: so `jaxserve serve` serves an out-of-tree model its package installs."""
    from importlib.metadata import entry_points

    for point in entry_points(group=PLUGIN_GROUP):
        if point.name not in _PLUGINS_LOADED:
            _PLUGINS_LOADED.add(point.name)
            point.load()()


_PLUGINS_LOADED: set[str] = set()


def read_config(c: dict, architecture: str) -> ModelConfig:
    """A Llama-shaped config.json's sizes -> ModelConfig (what paging and the head need; the
    registered model reads what else it needs from it, rope_theta and rms_norm_eps included),
    read as the built-in loader reads them (hf_loader.decoder_fields); intermediate_size
    defaults to hidden_size."""
    from jaxserve.weights.hf_loader import decoder_fields

    try:
        c = {**c, "intermediate_size": c.get("intermediate_size") or c["hidden_size"]}
        return ModelConfig(**decoder_fields(c, architecture))
    except KeyError as e:
        raise ValueError(f"config.json of {architecture!r} has no {e.args[0]!r}; give "
                         "register_model a config= that reads it") from None


def default_weight(path: str, checkpoint: Mapping[str, np.ndarray]) -> np.ndarray:
    """A module parameter from the checkpoint tensor of the same dotted name: an nnx.Linear's
    `kernel` [in, out] is `weight` [out, in] transposed, an nnx.Embed's `embedding` and an
    nnx.RMSNorm's `scale` are `weight`, anything else has the parameter's own name."""
    module, _, leaf = path.rpartition(".")
    if leaf == "kernel":
        w = checkpoint[f"{module}.weight"]
        return w.T if w.ndim == 2 else w
    if leaf in ("embedding", "scale"):
        return checkpoint[f"{module}.weight"]
    return checkpoint[path]


class _Checkpoint(Mapping):
    """The checkpoint's tensors by name, remembering which were read."""

    def __init__(self, tensors: dict):
        self._tensors, self.read = tensors, set()

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._tensors:
            raise KeyError(name)
        self.read.add(name)
        return self._tensors[name]

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def load_hf_dir(directory: str, entry: RegisteredModel, dtype=np.float32):
    """A Hugging Face directory of a registered architecture -> LoadedModel whose params are
    {"lm_head": f[V, H], "model": the module's parameter State, or the function's tensors}."""
    from jaxserve.tokenizer import Tokenizer
    from jaxserve.weights import LoadedModel
    from jaxserve.weights.hf_loader import read_safetensors, safetensors_files, with_stop_tokens

    with open(os.path.join(directory, "config.json")) as f:
        c = json.load(f)
    cfg = (entry.config or functools.partial(read_config, architecture=entry.architecture))(c)
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"register_model's config= must return a ModelConfig, got {cfg!r}")
    if len({cfg.layer_window(i) for i in range(cfg.num_layers)}) > 1:
        raise ValueError(f"{entry.architecture}: mixed sliding-window and full layers are not "
                         "supported for a registered model")
    cfg, tokenizer = with_stop_tokens(cfg, directory, Tokenizer.from_hf_dir(directory))
    cfg = dataclasses.replace(cfg, architecture=entry.architecture)
    h = hashlib.sha256(json.dumps(cfg.fingerprint_fields(), sort_keys=True,
                                  default=str).encode())
    tensors: dict[str, np.ndarray] = {}
    for fn in safetensors_files(directory):
        tensors.update(read_safetensors(fn, digest=h, float_dtype=dtype))
    checkpoint = _Checkpoint(tensors)
    head_name = entry.lm_head or ("model.embed_tokens.weight" if cfg.tie_word_embeddings
                                  else "lm_head.weight")
    if head_name not in tensors:
        raise ValueError(f"{directory}: no LM head tensor {head_name!r} (register_model's "
                         "lm_head= names it)")
    head = np.asarray(tensors[head_name])
    if head.shape != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(f"{head_name}: shape {head.shape} != (vocab, hidden) "
                         f"{(cfg.vocab_size, cfg.hidden_size)}")
    if entry.is_module:
        model = _module_params(entry, cfg, checkpoint, dtype)
        unused = sorted(set(tensors) - checkpoint.read - {head_name})
        unused = [n for n in unused if not n.endswith(_IGNORED_SUFFIXES)]
        if unused:
            raise ValueError(f"checkpoint tensors the module {entry.model.__name__} does not "
                             f"use (a parameter missing, or another name?): {unused[:8]}")
    else:  # every tensor by name, the head's too where it is the (tied) embedding
        shared = cfg.tie_word_embeddings and entry.lm_head is None
        model = {n: t for n, t in tensors.items()
                 if not n.endswith(_IGNORED_SUFFIXES) and (shared or n != head_name)}
    return LoadedModel(config=cfg, params={"lm_head": head, "model": model},
                       tokenizer=tokenizer, fingerprint=h.hexdigest(),
                       source=os.path.abspath(directory))


def _module_params(entry: RegisteredModel, cfg: ModelConfig, checkpoint: _Checkpoint, dtype):
    """The module's abstract parameters filled from the checkpoint by its weights rule."""
    import jax

    rule = entry.weights or default_weight

    def fill(path, abstract):
        name = _dotted(path)
        try:
            x = np.asarray(rule(name, checkpoint))
        except KeyError as e:
            raise ValueError(f"the checkpoint has no tensor {e.args[0]!r} for the module's "
                             f"parameter {name!r} (register_model's weights= maps them)") from None
        if x.shape != tuple(abstract.shape):
            raise ValueError(f"parameter {name!r}: the checkpoint gives shape {x.shape}, the "
                             f"module {entry.model.__name__} has {tuple(abstract.shape)}")
        return np.asarray(x, dtype if jax.numpy.issubdtype(x.dtype, np.floating) else x.dtype)

    return jax.tree_util.tree_map_with_path(fill, entry.abstract(cfg)[1])
