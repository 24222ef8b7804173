"""A mixture of experts against a dense model of the same active parameters, and against
transformers, in one run (issue 46's figures). Two seeded checkpoints are written with
transformers' save_pretrained into a temporary directory:

  moe    Qwen3-MoE-shaped: --layers layers, hidden --hidden, --experts experts of --moe_inter
         columns, top --top_k (norm_topk_prob), q/k norms
  dense  Qwen3 of the same attention, its MLP --top_k x --moe_inter columns wide: the MoE's
         active parameters (a token's experts; the router's E x H aside)

Printed, one line each:
  single-stream decode tok/s (greedy, ignore_eos, the first token's time taken out, best of
    --repeats after an untimed run) of jaxserve on each model, and their ratio (goal >= 0.7)
  offline throughput (output tok/s) of --batch requests of --prompt_tokens prompt and
    --output_tokens greedy tokens on the MoE: jaxserve's LLM.generate vs transformers'
    model.generate on the same checkpoint (one batch, equal lengths, no padding)
and that both give the same greedy tokens for the first request.

  python scripts/bench_moe.py [--attention_backend=cpu] [--quantization=int8] [--hidden=512 ...]
"""

from __future__ import annotations

import os
import tempfile
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("attention_backend", "auto", "jaxserve's backend: auto, cpu, xla.")
flags.DEFINE_enum("quantization", "none", ["none", "int8", "bf16"], "jaxserve's weights (both models; "
                  "transformers stays float32).")
flags.DEFINE_integer("layers", 4, "Decoder layers.")
flags.DEFINE_integer("hidden", 512, "Hidden size.")
flags.DEFINE_integer("experts", 32, "Experts per sparse layer.")
flags.DEFINE_integer("top_k", 4, "Experts a token is routed to.")
flags.DEFINE_integer("moe_inter", 256, "Columns of one expert.")
flags.DEFINE_integer("vocab", 8192, "Vocabulary size.")
flags.DEFINE_integer("prompt_tokens", 32, "Prompt length.")
flags.DEFINE_integer("decode_tokens", 128, "Single-stream tokens generated.")
flags.DEFINE_integer("batch", 16, "Offline requests.")
flags.DEFINE_integer("output_tokens", 64, "Offline tokens generated per request.")
flags.DEFINE_integer("repeats", 3, "Timed runs; the best is reported.")


def _write(directory: str, moe: bool) -> str:
    """A seeded checkpoint (see the module docstring) in directory/moe or directory/dense."""
    import torch
    import transformers

    from jaxserve.weights.random_init import numbered_tokenizer

    shape = dict(vocab_size=FLAGS.vocab, hidden_size=FLAGS.hidden, num_hidden_layers=FLAGS.layers,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=FLAGS.hidden // 8,
                 max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1,
                 eos_token_id=2, pad_token_id=0)
    if moe:
        cfg = transformers.Qwen3MoeConfig(**shape, num_experts=FLAGS.experts,
                                          num_experts_per_tok=FLAGS.top_k, norm_topk_prob=True,
                                          moe_intermediate_size=FLAGS.moe_inter,
                                          intermediate_size=FLAGS.top_k * FLAGS.moe_inter)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        cfg = transformers.Qwen3Config(**shape, intermediate_size=FLAGS.top_k * FLAGS.moe_inter)
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval().float()
    path = os.path.join(directory, "moe" if moe else "dense")
    model.save_pretrained(path)
    numbered_tokenizer(FLAGS.vocab, 2).save(path)
    return path


def _prompts(n: int) -> list[list[int]]:
    return [[3 + (97 * i + 31 * j) % (FLAGS.vocab - 3) for j in range(FLAGS.prompt_tokens)]
            for i in range(n)]


def _best(fn) -> float:
    times = []
    for _ in range(FLAGS.repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _decode_tok_s(llm) -> float:
    """Single-stream decode tok/s, the first token's time (prompt processing) taken out."""
    from jaxserve import SamplingParams

    prompt = [{"prompt_token_ids": _prompts(1)[0]}]
    n = FLAGS.decode_tokens
    run = lambda k: llm.generate(  # noqa: E731
        prompt, SamplingParams(max_tokens=k, temperature=0, ignore_eos=True), use_tqdm=False)
    run(n)  # compiles
    first, whole = _best(lambda: run(1)), _best(lambda: run(n))
    return (n - 1) / (whole - first)


def _offline_jaxserve(llm) -> tuple[float, list[int]]:
    from jaxserve import SamplingParams

    prompts = [{"prompt_token_ids": p} for p in _prompts(FLAGS.batch)]
    params = SamplingParams(max_tokens=FLAGS.output_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)  # compiles
    seconds = _best(lambda: llm.generate(prompts, params, use_tqdm=False))
    return FLAGS.batch * FLAGS.output_tokens / seconds, list(outs[0].outputs[0].token_ids)


def _offline_transformers(path: str) -> tuple[float, list[int]]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    ids = torch.tensor(_prompts(FLAGS.batch))
    gen = dict(max_new_tokens=FLAGS.output_tokens, min_new_tokens=FLAGS.output_tokens,
               do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    with torch.no_grad():
        out = model.generate(ids, **gen)
        seconds = _best(lambda: model.generate(ids, **gen))
    return FLAGS.batch * FLAGS.output_tokens / seconds, out[0, ids.shape[1]:].tolist()


def main(argv):
    del argv
    import torch

    from jaxserve import LLM

    options = dict(attention_backend=FLAGS.attention_backend, enable_prefix_caching=False,
                   quantization=FLAGS.quantization,
                   max_num_seqs=max(FLAGS.batch, 1), max_num_batched_tokens=512)
    with tempfile.TemporaryDirectory() as directory:
        moe_path, dense_path = _write(directory, True), _write(directory, False)
        moe_llm = LLM(model=moe_path, **options)
        moe_decode = _decode_tok_s(moe_llm)
        ours, our_tokens = _offline_jaxserve(moe_llm)
        del moe_llm
        dense_decode = _decode_tok_s(LLM(model=dense_path, **options))
        theirs, their_tokens = _offline_transformers(moe_path)
    print(f"shape: {FLAGS.layers} layers, hidden {FLAGS.hidden}, {FLAGS.experts} experts top "
          f"{FLAGS.top_k} of {FLAGS.moe_inter} columns vs dense MLP "
          f"{FLAGS.top_k * FLAGS.moe_inter}; backend {FLAGS.attention_backend}, quantization "
          f"{FLAGS.quantization}; torch threads "
          f"{torch.get_num_threads()}")
    print(f"single-stream decode tok/s: moe {moe_decode:.1f}, dense {dense_decode:.1f}, "
          f"ratio {moe_decode / dense_decode:.2f} (goal >= 0.7)")
    print(f"offline output tok/s ({FLAGS.batch} x {FLAGS.prompt_tokens} prompt + "
          f"{FLAGS.output_tokens} out, moe): jaxserve {ours:.1f}, transformers {theirs:.1f}, "
          f"ratio {ours / theirs:.2f}")
    print(f"first request's greedy tokens equal: {our_tokens == their_tokens}")


if __name__ == "__main__":
    app.run(main)
