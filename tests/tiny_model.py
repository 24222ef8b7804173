"""A tiny seeded random Llama-family model with a byte-level tokenizer, for tests of engine and
server behaviour where the real model adds nothing (robustness, faults, fuzzing): it loads in
milliseconds and compiles in seconds. Its text is gibberish, but greedy decoding is
deterministic, so outputs can be compared run to run."""

from __future__ import annotations

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from jaxserve.config import ModelConfig
from jaxserve.tokenizer import Tokenizer
from jaxserve.weights import LoadedModel

EOS = "<|endoftext|>"
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def tiny_tokenizer() -> Tokenizer:
    """Byte-level BPE without merges: one token per byte (ids 0-255), then the EOS token."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([EOS])
    eos = backend.token_to_id(EOS)
    return Tokenizer(backend, bos_token_id=None, eos_token_ids=[eos], chat_template=CHAT_TEMPLATE)


def tiny_loaded(seed: int = 0, vocab_size: int = 320, max_len: int = 256, *, h: int = 32,
                inter: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                d: int = 8) -> LoadedModel:
    """h: hidden size, inter: MLP width, heads and kv_heads of head dim d."""
    tokenizer = tiny_tokenizer()
    cfg = ModelConfig(vocab_size=vocab_size, hidden_size=h, intermediate_size=inter,
                      num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=d,
                      max_position_embeddings=max_len, tie_word_embeddings=True,
                      eos_token_ids=tuple(tokenizer.eos_token_ids))
    rng = np.random.default_rng(seed)

    def w(*shape, scale=0.3):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    params = {"embed": w(vocab_size, h, scale=1.0), "final_norm": np.ones(h, np.float32),
              "layers": {"attn_norm": np.ones((layers, h), np.float32),
                         "mlp_norm": np.ones((layers, h), np.float32),
                         "wq": w(layers, h, heads * d), "wk": w(layers, h, kv_heads * d),
                         "wv": w(layers, h, kv_heads * d), "wo": w(layers, heads * d, h),
                         "w_gate": w(layers, h, inter), "w_up": w(layers, h, inter),
                         "w_down": w(layers, inter, h)}}
    return LoadedModel(config=cfg, params=params, tokenizer=tokenizer, fingerprint=f"tiny-{seed}",
                       source="tests/tiny_model.py")


def failing_on(call: int, real, error: BaseException):
    """A stand-in for `real` that raises `error` on its call-th call and otherwise calls it
    (fault injection); `.calls` counts the calls."""
    def wrapper(*args, **kwargs):
        wrapper.calls += 1
        if wrapper.calls == call:
            raise error
        return real(*args, **kwargs)

    wrapper.calls = 0
    return wrapper
