"""Embeddings per second against sentence-transformers on a seeded random Qwen3-Embedding-shaped
model: writes the decoder (--layers, --hidden) as a sentence-transformers model (last-token
pooling, Normalize, byte-level tokenizer), then runs `jaxserve bench --runner=pooling
--compare_sentence_transformers` on it (jaxserve/tools/bench/embeddings.py measures); other
arguments go to the bench.

    python scripts/bench_embeddings.py --num_prompts=64 --input_len=512 --max_num_batched_tokens=2048
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    args, bench_args = ap.parse_known_args()
    model = write_model(tempfile.mkdtemp(prefix="bench_embeddings_"), args.layers, args.hidden)
    sys.exit(subprocess.call([sys.executable, "-m", "jaxserve.cli.main", "bench",
                              "--runner=pooling", f"--model={model}",
                              "--compare_sentence_transformers", *bench_args]))


if __name__ == "__main__":
    main()
