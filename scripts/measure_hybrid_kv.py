"""KV held per request and requests that fit one pool, on a small seeded model of Gemma 3's
layer pattern (5 local layers of window 128 to 1 global, 12 layers): run it on a checkout with
layer groups and on one without to compare (docs/usage.md: the defaults for the bytes per
request, --lengths= --prompt=2048 --max_tokens=64 for the requests at once). PYTHONPATH picks
the checkout (the script's own folder comes first on sys.path, not the working directory).
Prints one JSON line.

  PYTHONPATH=. python scripts/measure_hybrid_kv.py [--kv_cache_bytes=N] [--requests=24]
      [--prompt=1024] [--max_tokens=16] [--lengths=4096,8192]
"""

from __future__ import annotations

import dataclasses
import json
import sys

from absl import app, flags

flags.DEFINE_integer("kv_cache_bytes", 48 << 20, "The KV pool's bytes (one budget for both).")
flags.DEFINE_integer("requests", 24, "Requests submitted at once.")
flags.DEFINE_integer("prompt", 1024, "Prompt tokens of each request.")
flags.DEFINE_integer("max_tokens", 16, "Tokens generated per request.")
flags.DEFINE_string("lengths", "4096,8192", "Lengths at which one request's KV bytes are read.")
FLAGS = flags.FLAGS


def model():
    import transformers

    from jaxserve.weights import config_from_hf
    from jaxserve.weights.random_init import random_model

    pattern = (["sliding_attention"] * 5 + ["full_attention"]) * 2
    hf = transformers.Gemma3TextConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=12,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=128,
        layer_types=pattern, max_position_embeddings=16384, bos_token_id=1, eos_token_id=2,
        pad_token_id=0)
    # random_model draws no q/k or sandwich norms: Gemma 3's layers and windows without them
    cfg = dataclasses.replace(config_from_hf(hf.to_dict()), qk_norm=False, sandwich_norms=False)
    return random_model(cfg, seed=0)


def engine(loaded, **options):
    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine

    config = EngineConfig.from_options(page_size=16, max_num_seqs=64, max_num_batched_tokens=512,
                                       enable_prefix_caching=False, attention_backend="cpu",
                                       **options)
    return LLMEngine(config, loaded)


def main(argv):
    del argv
    import numpy as np

    from jaxserve.core.sampling_params import SamplingParams

    loaded = model()
    rng = np.random.default_rng(0)
    out = {}
    # One request's KV at each length: the pages in its tables (every group's) once it decodes
    # (the chunks' transient pages before a window are released by then).
    lengths = [int(n) for n in FLAGS.lengths.split(",") if n]
    e = engine(loaded, num_pages=1 + 2 * max(lengths) // 16 * 2) if lengths else None
    for n in lengths:
        page_bytes = e.runner.memory_stats()["kv_page_bytes_per_device"]
        e.add_request({"prompt_token_ids": [int(t) for t in rng.integers(3, 512, n)]},
                      SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        held = 0
        while e.has_unfinished():
            e.step()
            for seq in e.scheduler.running:
                if seq.num_computed_tokens > n:
                    tables = [seq.page_ids, *getattr(seq, "group_page_ids", [])]
                    held = max(held, sum(1 for t in tables for p in t if p))
        out[f"kv_bytes_at_{n}"] = held * page_bytes
    # Requests of prompt + max_tokens at once in a pool of kv_cache_bytes.
    e = engine(loaded, kv_cache_bytes=FLAGS.kv_cache_bytes)
    for _ in range(FLAGS.requests):
        e.add_request({"prompt_token_ids": [int(t) for t in rng.integers(3, 512, FLAGS.prompt)]},
                      SamplingParams(temperature=0, max_tokens=FLAGS.max_tokens, ignore_eos=True))
    most = 0
    while e.has_unfinished():
        e.step()
        most = max(most, e.stats()["running"])
    stats = e.stats()
    page_bytes = e.runner.memory_stats()["kv_page_bytes_per_device"]
    out.update(num_pages=e.num_pages, page_bytes=page_bytes, most_running=most,
               preemptions=stats["preemptions"], kv_pool_bytes=stats["kv_pool_bytes"])
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(app.run(main))
