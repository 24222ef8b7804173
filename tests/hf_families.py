"""Tiny seeded Hugging Face checkpoints of the model families jaxserve serves, built with
transformers (the reference) for parity tests: Mistral (sliding window on every layer), Gemma
(GeGLU, scaled embeddings, 1 + weight norms), Gemma 2 (soft-capping, query_pre_attn_scalar,
alternating sliding and full layers, sandwich norms), Gemma 3 text (q/k norm, local and global
rope bases, a sliding-window pattern) and a Qwen2 with sliding layers from max_window_layers on. Two layers, hidden 64, f32; norm weights are drawn around
their identity (ones, or zeros for Gemma's 1 + weight) so that every norm matters, and query and
key projections scaled up so that attention is far from uniform.

`family_model(name)` -> (transformers model, ModelConfig, params) and a LoadedModel of it with a
word-level tokenizer ("t<i>" per id) for engine tests; StepLogits runs hand-made step plans
through the runner's forward and returns full logits rows; transformers_greedy is the greedy
reference engine tests compare tokens with (tensor_parallel_tokens_match for a 2-device engine)."""

from __future__ import annotations

import functools

import numpy as np

WINDOW = 12  # tokens: a few pages of 8, crossed by chunks of 32
TINY = dict(vocab_size=211, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES = ("mistral", "gemma", "gemma2", "gemma3", "qwen2-window")


def _hf_config(name: str):
    import transformers

    if name == "mistral":
        return transformers.MistralConfig(**TINY, sliding_window=WINDOW, rope_theta=1e4,
                                          tie_word_embeddings=False)
    if name == "qwen2-window":  # layer 0 full, layer 1 sliding (from max_window_layers on)
        return transformers.Qwen2Config(**TINY, use_sliding_window=True, sliding_window=WINDOW,
                                        max_window_layers=1, tie_word_embeddings=True)
    if name == "gemma":
        return transformers.GemmaConfig(**TINY, head_dim=16, hidden_act="gelu_pytorch_tanh")
    if name == "gemma2":  # layer 0 sliding, layer 1 full; caps low enough to bend scores, logits
        return transformers.Gemma2Config(**TINY, head_dim=16, sliding_window=WINDOW,
                                         query_pre_attn_scalar=24, attn_logit_softcapping=1.5,
                                         final_logit_softcapping=0.5)
    if name == "gemma3":  # sliding layer 0 (local base 1e4), full layer 1 (global, linear-scaled)
        return transformers.Gemma3TextConfig(
            **TINY, head_dim=24, sliding_window=WINDOW, query_pre_attn_scalar=20,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    raise ValueError(name)


def seeded_model(cls, hf_cfg, scaled: dict[str, float] | None = None):
    """transformers model `cls(hf_cfg)` in f32 eval mode, seeded, with every norm weight drawn
    around its identity (ones, or zeros for Gemma's 1 + weight) and the query and key projections
    scaled up (scores of a few units, not near zero: the softmax, its window and soft cap all
    matter); scaled: {parameter-name part: factor} multiplied too (a mixture's routers, so that
    choices are clear, and its experts, so that they weigh in the residual stream)."""
    import torch

    torch.manual_seed(0)
    model = cls(hf_cfg).eval().float()
    with torch.no_grad():
        for name, w in model.named_parameters():
            if name.endswith("norm.weight"):
                w.add_(torch.randn_like(w) * 0.3)
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                w.mul_(8.0)
            for part, factor in (scaled or {}).items():
                if part in name:
                    w.mul_(factor)
    return model


def tp_greedy(script: str, *args: str, devices: int = 2):
    """The last stdout line of `script` (python -c, given args) run on `devices` virtual CPU
    devices, read as JSON: a tensor-parallel engine's outputs, from a process of its own."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@functools.cache
def family_model(name: str):
    """(transformers model in f32 eval mode, ModelConfig, params) of a seeded tiny checkpoint,
    loaded through our config and tensor readers."""
    import transformers

    from jaxserve.weights import config_from_hf, params_from_hf_state_dict

    hf_cfg = _hf_config(name)
    cls = {"mistral": transformers.MistralForCausalLM, "gemma": transformers.GemmaForCausalLM,
           "gemma2": transformers.Gemma2ForCausalLM,
           "gemma3": transformers.Gemma3ForCausalLM,
           "qwen2-window": transformers.Qwen2ForCausalLM}[name]
    model = seeded_model(cls, hf_cfg)
    cfg = config_from_hf(hf_cfg.to_dict())
    tensors = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return model, cfg, params_from_hf_state_dict(cfg, tensors)


def family_loaded(name: str):
    """A LoadedModel of family_model(name), with a word-level tokenizer."""
    from jaxserve.weights import LoadedModel
    from jaxserve.weights.random_init import numbered_tokenizer

    _, cfg, params = family_model(name)
    return LoadedModel(config=cfg, params=params,
                       tokenizer=numbered_tokenizer(cfg.vocab_size, TINY["eos_token_id"]),
                       fingerprint=f"tiny-{name}", source="tests/hf_families.py")


def transformers_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """The transformers model's greedy continuation of `prompt` (no cache: the plain forward
    each step)."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
            ids.append(int(np.argmax(logits.numpy())))
    return ids[len(prompt):]


def greedy_reference(name: str, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers_greedy of family_model(name), cached."""
    return list(_greedy_reference(name, tuple(prompt), max_tokens))


@functools.cache
def _greedy_reference(name: str, prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    return tuple(transformers_greedy(family_model(name)[0], prompt, max_tokens))


_TP_ENGINE_SCRIPT = """
import json, sys
from jaxserve.config import EngineConfig
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.llm import LLM
from jaxserve.weights import load_model
config = EngineConfig.from_options(page_size=8, max_num_batched_tokens=32, max_num_seqs=4,
                                   num_pages=int(sys.argv[3]), attention_backend="xla",
                                   tensor_parallel_size=2)
llm = LLM.from_engine(LLMEngine(config, load_model(sys.argv[1])))
outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[2])],
                    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
print(json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def tensor_parallel_tokens_match(model, directory: str, *, num_pages: int):
    """An engine with tensor_parallel_size=2 (xla backend, pages of 8, chunks of 32, its own
    process on two virtual CPU devices) loading the checkpoint in `directory`: its 6 greedy
    tokens for a 7- and a 40-token prompt are transformers' (`model`)."""
    import json

    prompts = [[5, 9, 31, 77, 120, 4, 8], [int(t) for t in range(40, 80)]]
    got = tp_greedy(_TP_ENGINE_SCRIPT, directory, json.dumps(prompts), str(num_pages))
    assert got == [transformers_greedy(model, p, 6) for p in prompts]


class StepLogits:
    """Runs steps through the runner and returns the full logits rows of sampled positions."""

    def __init__(self, cfg, params, page_size, backend, num_pages: int = 64,
                 quantization: str = "none"):
        from jaxserve.runtime.batch import Buckets
        from jaxserve.runtime.runner import ModelRunner

        from jaxserve import backends

        self.backend = backends.get(backend)
        self.runner = ModelRunner(cfg, params, num_pages=num_pages, page_size=page_size,
                                  backend=self.backend, quantization=quantization)
        self.page_size = page_size
        self.buckets = Buckets.for_engine(8, 128, 32)

    def step(self, plan) -> np.ndarray:
        import jax

        from jaxserve.model import llama
        from jaxserve.runtime.batch import build_batch

        batch, rows, _ = build_batch(plan, self.buckets, self.page_size)
        runner = self.runner
        # Same forward as the jitted step, but returning logits for comparison.
        pool, hidden = llama.forward(runner.params, runner.pool, jax.numpy.asarray(batch.token_ids),
                                     jax.tree_util.tree_map(jax.numpy.asarray, batch.attn),
                                     cfg=runner.cfg, backend=self.backend)
        runner.pool = pool
        logits = llama.logits(runner.params, hidden[batch.logits_indices], runner.cfg)
        return np.asarray(logits)[:rows]


def crossing_chunk_logits_match(model, cfg, params, backend: str, tables, num_pages: int = 64):
    """A 24-token seeded prompt run in pages of 8 as 8 tokens, then a chunk of 16 (crossing a
    small window), then one decode step: the chunk's last and the decode's logits are
    transformers', within 1e-4. tables: the sequence's page tables, group 0's first (one a
    layer group)."""
    import torch

    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.core.sequence import Request, Sequence
    from jaxserve.core.step_plan import ScheduledChunk, StepPlan

    prompt = [int(t) for t in np.random.default_rng(1).integers(3, cfg.vocab_size, 24)]
    seq = Sequence(0, Request("r", prompt, SamplingParams(temperature=0)), list(prompt), 24)
    seq.page_ids, seq.group_page_ids = list(tables[0]), [list(t) for t in tables[1:]]
    runner = StepLogits(cfg, params, 8, backend, num_pages=num_pages)
    runner.step(StepPlan([ScheduledChunk(seq, 0, 8, [])]))
    ours = [runner.step(StepPlan([ScheduledChunk(seq, 8, 16, [seq])]))[0]]
    seq.token_ids.append(5)
    ours.append(runner.step(StepPlan([ScheduledChunk(seq, 24, 1, [seq])]))[0])
    with torch.no_grad():
        ref = model(torch.tensor([prompt + [5]])).logits[0, -2:].numpy()
    np.testing.assert_allclose(np.stack(ours), ref, atol=1e-4, rtol=1e-4)


def chunks_then_decode_logits_match(model, cfg, params, backend: str, *, num_pages: int,
                                    pages_per_table: int, decode_steps: int,
                                    release_window: bool = False):
    """A 64-token seeded prompt run in pages of 8 as two prefill chunks of 32 (the first samples
    nothing), then `decode_steps` decode steps, pages out of order with a table per layer group:
    the second chunk's last and every decode step's logits are transformers', within 1e-4.
    release_window: pages before a windowed model's window leave the table (the scratch page 0
    instead), as the KV manager releases them."""
    import torch

    from jaxserve.core.kv_groups import groups_of
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.core.sequence import Request, Sequence
    from jaxserve.core.step_plan import ScheduledChunk, StepPlan

    page, chunk = 8, 32
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(3, cfg.vocab_size, 2 * chunk)]
    seq = Sequence(0, Request("r", prompt, SamplingParams(temperature=0)), list(prompt),
                   len(prompt))
    pages = [int(p) for p in rng.permutation(np.arange(1, num_pages))]  # non-contiguous
    n = pages_per_table
    seq.page_ids = pages[:n]
    seq.group_page_ids = [pages[n * g:n * g + n] for g in range(1, groups_of(cfg).num_groups)]
    runner = StepLogits(cfg, params, page, backend, num_pages=num_pages)

    def release(position):
        if release_window and cfg.kv_window is not None:
            for i in range(max(0, position - cfg.kv_window + 1) // page):
                seq.page_ids[i] = 0

    release(0)
    first = runner.step(StepPlan([ScheduledChunk(seq, 0, chunk, [])]))
    assert first.shape[0] == 0  # a chunk that ends no prompt samples nothing
    release(chunk)
    ours = [runner.step(StepPlan([ScheduledChunk(seq, chunk, chunk, [seq])]))[0]]
    decode = [int(t) for t in rng.integers(3, cfg.vocab_size, decode_steps)]
    for tok in decode:
        seq.token_ids.append(tok)
        release(seq.num_tokens - 1)
        ours.append(runner.step(StepPlan([ScheduledChunk(seq, seq.num_tokens - 1, 1, [seq])]))[0])
    with torch.no_grad():
        ref = model(torch.tensor([prompt + decode])).logits[0, len(prompt) - 1:].numpy()
    np.testing.assert_allclose(np.stack(ours), ref, atol=1e-4, rtol=1e-4)
    return seq
