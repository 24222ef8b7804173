"""Weights loaded onto 1, 2 and 4 virtual CPU devices from each checkpoint format, as a script
(XLA_FLAGS must name the device count before JAX starts; tests/test_shard_load.py runs it):

    python tests/shard_load_cases.py DIR  ->  {"runs": {"gguf-tp2": {"outputs", "leaves"}, ...}}

One tiny Qwen2 model (4 query heads over 2 KV heads, q/k/v biases, an untied head) is written
as GGUF (Q8_0), then from what that loads as a Hugging Face safetensors directory and an orbax
checkpoint, so all three hold the same weights. Each is served greedily at TP 1, 2 (KV heads
sharded) and 4 (KV heads repeated), GGUF and safetensors read one layer at a time and the
orbax one restored straight into the devices' shardings and fused there ("read_as" names the
lazy loader's type); "leaves" lists each weight's global shape and the bytes
each device holds of it.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402
from test_weights import write_hf_tokenizer, write_tiny_gguf  # noqa: E402

import jax  # noqa: E402

from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.core.sampling_params import SamplingParams  # noqa: E402
from jaxserve.engine import LLMEngine  # noqa: E402
from jaxserve.llm import LLM  # noqa: E402
from jaxserve.weights import load_model, save_orbax  # noqa: E402

OPTIONS = dict(model="unused", attention_backend="xla", page_size=4, num_pages=32,
               max_num_seqs=2, max_num_batched_tokens=16, huge_pages=False)
HF_NAMES = {"wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
            "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight",
            "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
            "w_down": "mlp.down_proj.weight", "bq": "self_attn.q_proj.bias",
            "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias",
            "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight"}


def write_hf(loaded, directory: str) -> None:
    """The loaded params as a Hugging Face directory (weights [out, in]): Qwen2 with q/k/v
    biases, else Llama."""
    c, p = loaded.config, loaded.params
    tensors = {"model.embed_tokens.weight": p["embed"], "model.norm.weight": p["final_norm"],
               "lm_head.weight": p["lm_head"].T}
    for name, stacked in p["layers"].items():
        for i, w in enumerate(stacked):
            tensors[f"model.layers.{i}.{HF_NAMES[name]}"] = w.T if w.ndim == 2 else w
    os.makedirs(directory)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
              os.path.join(directory, "model.safetensors"))
    arch = "Qwen2ForCausalLM" if c.attention_bias else "LlamaForCausalLM"
    config = {"architectures": [arch], "vocab_size": c.vocab_size,
              "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
              "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
              "num_key_value_heads": c.num_kv_heads, "rope_theta": c.rope_theta,
              "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings":
              c.max_position_embeddings, "tie_word_embeddings": False,
              "bos_token_id": c.bos_token_id, "eos_token_id": list(c.eos_token_ids)}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    write_hf_tokenizer(directory)


def leaves(engine) -> dict:
    """Each weight's global shape and the bytes of it on each device."""
    flat = jax.tree_util.tree_flatten_with_path(engine.runner.params)[0]
    return {jax.tree_util.keystr(path): {"shape": list(x.shape), "nbytes": x.nbytes,
                                         "per_device": [s.data.nbytes
                                                        for s in x.addressable_shards]}
            for path, x in flat}


def read_as(params) -> str:
    """The type of a lazy load's params (orbax) or layer weights (GGUF, safetensors)."""
    return type(params["layers"]["wq"] if isinstance(params, dict) else params).__name__


def main() -> None:
    root = sys.argv[1]
    gguf = os.path.join(root, "tiny.gguf")
    write_tiny_gguf(gguf, "qwen2", "Q8_0", tie=False)
    reference = load_model(gguf)
    write_hf(reference, os.path.join(root, "hf"))
    save_orbax(os.path.join(root, "orbax"), reference)
    prompts = [[5, 9, 40, 41, 42, 7], [100, 3, 3, 8]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = {}
    for source in ("gguf", "hf", "orbax"):
        # lazy: GGUF and safetensors layers are read one at a time as the runner places them,
        # the orbax checkpoint is restored by the runner straight into the shardings
        loaded = load_model(os.path.join(root, {"gguf": "tiny.gguf"}.get(source, source)),
                            lazy=True)
        for tp in (1, 2, 4):
            engine = LLMEngine(EngineConfig.from_options(**OPTIONS, tensor_parallel_size=tp),
                               loaded)
            outs = LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)
            runs[f"{source}-tp{tp}"] = {"outputs": [o.outputs[0].token_ids for o in outs],
                                        "leaves": leaves(engine),
                                        "read_as": read_as(loaded.params),
                                        "weight_bytes_per_device":
                                        engine.stats()["weight_bytes_per_device"]}
    print(json.dumps({"runs": runs, "config": {
        "num_heads": reference.config.num_heads, "num_kv_heads": reference.config.num_kv_heads,
        "head_dim": reference.config.head_dim, "hidden_size": reference.config.hidden_size}}))


if __name__ == "__main__":
    main()
