"""Embeddings per second: jaxserve's pooling runner against sentence-transformers, in one run
on the same checkpoint, inputs and dtype (float32), each warmed up first; outputs compared.

    python scripts/bench_embeddings.py --inputs 64 --tokens 512
    python scripts/bench_embeddings.py --model /path/to/sentence-transformers-dir

Without --model it writes a seeded random Qwen3 decoder (--layers, --hidden) saved as a
sentence-transformers model (last-token pooling, Normalize) with a byte-level tokenizer, so
each input is exactly --tokens tokens (random letters, then <|endoftext|>). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np


def write_model(directory: str, layers: int, hidden: int) -> str:
    import tokenizers
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors

    from jaxserve.tokenizer import Tokenizer

    backend = tokenizers.Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(
        sorted(pre_tokenizers.ByteLevel.alphabet()))}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    backend.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", 256)])
    torch.manual_seed(0)
    heads = hidden // 64
    config = transformers.Qwen3Config(
        vocab_size=32768, hidden_size=hidden, intermediate_size=3 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1),
        head_dim=64, max_position_embeddings=4096, tie_word_embeddings=True)
    raw = os.path.join(directory, "hf")
    transformers.Qwen3Model(config).eval().float().save_pretrained(raw)
    Tokenizer(backend, bos_token_id=None, eos_token_ids=[256], chat_template=None).save(raw)
    st = os.path.join(directory, "st")
    SentenceTransformer(modules=[modules.Transformer(raw),
                                 modules.Pooling(hidden, pooling_mode="lasttoken"),
                                 modules.Normalize()], device="cpu").save(st)
    return st


def timed(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a sentence-transformers directory (default: a random one)")
    ap.add_argument("--inputs", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=512, help="tokens per input (random model)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--max_num_batched_tokens", type=int, default=2048)
    ap.add_argument("--batch_size", type=int, default=16, help="sentence-transformers' batch")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer

    from jaxserve.llm import LLM

    work = tempfile.mkdtemp(prefix="bench_embeddings_")
    model = args.model or write_model(work, args.layers, args.hidden)
    rng = np.random.default_rng(0)
    texts = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz "), args.tokens - 1))
             for _ in range(args.inputs)]

    st = SentenceTransformer(model, device="cpu")
    if st.tokenizer.pad_token is None:
        st.tokenizer.pad_token = st.tokenizer.eos_token or "<|endoftext|>"
    # No prefix cache: repeated inputs would be served from it (last-token pooling takes hits).
    llm = LLM(model, runner="pooling", max_num_seqs=args.inputs, enable_prefix_caching=False,
              max_num_batched_tokens=args.max_num_batched_tokens)
    encode = lambda: st.encode(texts, batch_size=args.batch_size,  # noqa: E731
                               convert_to_numpy=True)
    embed = lambda: np.stack([o.embedding for o in llm.embed(texts, use_tqdm=False)])  # noqa: E731
    encode(), embed()  # warm-up: compiles, allocations
    st_seconds, want = timed(encode, args.repeats)
    js_seconds, got = timed(embed, args.repeats)
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    print(json.dumps({
        "inputs": args.inputs, "tokens_per_input": len(llm.get_tokenizer().encode(texts[0])),
        "model": args.model or f"random qwen3, {args.layers} layers, hidden {args.hidden}",
        "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
        "sentence_transformers_per_s": round(args.inputs / st_seconds, 2),
        "jaxserve_per_s": round(args.inputs / js_seconds, 2),
        "speedup": round(st_seconds / js_seconds, 2), "min_cosine": float(cos.min())}))


if __name__ == "__main__":
    main()
