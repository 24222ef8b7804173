"""The embeddings workload of `jaxserve bench` (a pooling engine, --runner=pooling): seeded
inputs of exact token lengths embedded by the engine, best of `repeats` timed runs after an
untimed warm-up (compilations, allocations); with a sentence-transformers directory, the same
token ids through sentence-transformers (torch, float32, this host) in the same process, timed
the same way, their throughput ratio and the lowest cosine between the two embeddings."""

from __future__ import annotations

import os
import time
from typing import Callable, Sequence

import numpy as np

from jaxserve.tools import require


def token_inputs(num: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """`num` seeded inputs of exactly `length` token ids below vocab_size."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, length).tolist() for _ in range(num)]


def best_of(fn: Callable[[], np.ndarray], repeats: int) -> tuple[float, np.ndarray]:
    """fn's fastest wall time of `repeats` runs after one untimed, and its last result."""
    out = fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def engine_embedder(llm) -> Callable[[Sequence[list[int]]], np.ndarray]:
    """The pooling LLM's embeddings of token id inputs, one row each."""
    def embed(inputs):
        prompts = [{"prompt_token_ids": ids} for ids in inputs]
        return np.stack([o.embedding for o in llm.embed(prompts, use_tqdm=False)])
    return embed


def sentence_transformers_embedder(model_dir: str, batch_size: int
                                   ) -> Callable[[Sequence[list[int]]], np.ndarray]:
    """sentence-transformers' embeddings of the same token ids (its modules' forward on the
    tokenized batch: the ids are given, so both sides embed exactly the same tokens)."""
    torch = require("torch", "bench-reference")
    SentenceTransformer = require("sentence_transformers", "bench-reference").SentenceTransformer
    st = SentenceTransformer(model_dir, device="cpu").float().eval()

    def embed(inputs):
        rows = []
        with torch.inference_mode():
            for start in range(0, len(inputs), batch_size):
                batch = inputs[start:start + batch_size]
                longest = max(len(ids) for ids in batch)
                ids = torch.zeros((len(batch), longest), dtype=torch.long)
                mask = torch.zeros_like(ids)
                for i, row in enumerate(batch):  # right padding, masked
                    ids[i, :len(row)] = torch.tensor(row)
                    mask[i, :len(row)] = 1
                out = st({"input_ids": ids, "attention_mask": mask})
                rows.append(out["sentence_embedding"].float().numpy())
        return np.concatenate(rows)
    return embed


def run_embeddings(llm, inputs: Sequence[list[int]], *, repeats: int = 2,
                   reference_dir: str | None = None, reference_batch_size: int = 16) -> dict:
    """The report: embeddings/s and tokens/s of the engine (and of sentence-transformers on
    `reference_dir`, with the ratio and the lowest cosine, when given)."""
    tokens = sum(len(ids) for ids in inputs)
    seconds, got = best_of(lambda: engine_embedder(llm)(inputs), repeats)
    rep = {"inputs": len(inputs), "tokens": tokens, "repeats": repeats,
           "cpus": os.cpu_count(), "load_average": list(os.getloadavg()),
           "jaxserve": {"seconds": seconds, "embeddings_per_s": len(inputs) / seconds,
                        "tokens_per_s": tokens / seconds}}
    if reference_dir is not None:
        import torch

        embed = sentence_transformers_embedder(reference_dir, reference_batch_size)
        ref_seconds, want = best_of(lambda: embed(inputs), repeats)
        cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
        rep["sentence_transformers"] = {
            "seconds": ref_seconds, "embeddings_per_s": len(inputs) / ref_seconds,
            "tokens_per_s": tokens / ref_seconds, "batch_size": reference_batch_size,
            "torch_threads": torch.get_num_threads()}
        rep["speedup"] = ref_seconds / seconds
        rep["min_cosine"] = float(cos.min())
    return rep


def format_embeddings(rep: dict) -> str:
    lines = [f"Embeddings: {rep['inputs']} inputs, {rep['tokens']} tokens, best of "
             f"{rep['repeats']} (load average {', '.join(f'{x:.2f}' for x in rep['load_average'])}"
             f"; {rep['cpus']} CPUs)"]
    for name in ("jaxserve", "sentence_transformers"):
        if name in rep:
            r = rep[name]
            lines.append(f"  {name:<22}{r['embeddings_per_s']:>10.2f} embeddings/s"
                         f"{r['tokens_per_s']:>12.1f} tokens/s{r['seconds']:>9.2f} s")
    if "speedup" in rep:
        lines.append(f"  jaxserve / sentence-transformers: x{rep['speedup']:.2f}, lowest cosine "
                     f"{rep['min_cosine']:.6f}")
    return "\n".join(lines)
