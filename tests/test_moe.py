"""Mixtures of experts (Mixtral, Qwen3-MoE) match transformers: tiny seeded checkpoints written by
transformers' save_pretrained (per-expert tensors, as on the hub) and loaded from their
directories, two layers, hidden 64, 4 experts of which 2 a token. The Qwen3-MoE has its second
layer dense (mlp_only_layers) and comes with norm_topk_prob off and on (the same weights).
Logits within 1e-4 through the step function on the cpu and xla backends (pages of 8, prefill
chunks of 32, then decode), and the engine's greedy tokens equal transformers' for several
requests at once. moe.py itself is checked against a per-token loop, its megablox grouped
matmul (the TPU's) in Pallas's interpreter against ragged_dot, and a Qwen3-30B-A3B-shaped
sparse layer compiles for v5e and v6e with it (libtpu's compile-only topologies)."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_families import (TINY, StepLogits, chunks_then_decode_logits_match,  # noqa: E402
                         seeded_model, tensor_parallel_tokens_match, transformers_greedy)
from skips import need_backend  # noqa: E402
from jaxserve.backends.cpu import kernels as cpu_kernels  # noqa: E402
from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.core.sampling_params import SamplingParams  # noqa: E402
from jaxserve.core.sequence import Request, Sequence  # noqa: E402
from jaxserve.core.step_plan import ScheduledChunk, StepPlan  # noqa: E402
from jaxserve.engine.llm_engine import LLMEngine  # noqa: E402
from jaxserve.llm import LLM  # noqa: E402
from jaxserve.weights import load_model  # noqa: E402

PAGE, CHUNK = 8, 32
MODELS = ("mixtral", "qwen3_moe", "qwen3_moe-norm")
BACKENDS = ("cpu", "xla")


def _hf_model(name: str):
    moe = dict(num_experts_per_tok=2, hidden_act="silu", tie_word_embeddings=False)
    if name == "mixtral":
        cfg = transformers.MixtralConfig(**{**TINY, "intermediate_size": 48}, **moe,
                                         num_local_experts=4)
        cls = transformers.MixtralForCausalLM
    else:  # layer 0 sparse, layer 1 dense (with its own, wider MLP)
        # -int8: every matmul's inputs a multiple of int8's groups of 32
        int8 = name.endswith("-int8")
        cfg = transformers.Qwen3MoeConfig(**{**TINY, "intermediate_size": 96 if int8 else 112},
                                          **moe, num_experts=4,
                                          moe_intermediate_size=64 if int8 else 40, head_dim=16,
                                          mlp_only_layers=[1],
                                          norm_topk_prob=name.endswith("-norm"))
        cls = transformers.Qwen3MoeForCausalLM
    # routers: clear choices, far from uniform; experts' outputs (x27) weigh in the residual
    return seeded_model(cls, cfg, {"gate.weight": 30.0, ".experts.": 3.0})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """name -> (transformers model, its directory as save_pretrained writes it, with a
    tokenizer), each made once."""
    from jaxserve.weights.random_init import numbered_tokenizer

    @functools.cache
    def make(name: str):
        directory = str(tmp_path_factory.mktemp(name))
        model = _hf_model(name)
        model.save_pretrained(directory)
        numbered_tokenizer(TINY["vocab_size"], TINY["eos_token_id"]).save(directory)
        return model, directory

    return make


def _reference_mlp(x, router, gate, up, down, k, normalize):
    """One token at a time, expert by expert, in float64: the MoE MLP as written down."""
    out = np.zeros_like(x, np.float64)
    for t, row in enumerate(x.astype(np.float64)):
        logits = row @ router.T
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        chosen = np.argsort(-probs)[:k]
        weights = probs[chosen] / (probs[chosen].sum() if normalize else 1.0)
        for e, w in zip(chosen, weights):
            g, u = row @ gate[e], row @ up[e]
            out[t] += w * ((g / (1 + np.exp(-g)) * u) @ down[e])
    return out


@pytest.mark.parametrize("normalize,t", [(False, 13), (True, 13), (False, 2), (True, 2)])
def test_sparse_mlp_equals_a_per_token_loop(normalize, t):
    """route + run_experts over t tokens, 5 experts, top-2, against the loop: 13 tokens run the
    grouped matmuls (one expert chosen by no token: an empty group), 2 tokens (4 pairs, fewer
    than the experts) gather each pair's expert."""
    import jax

    from jaxserve.config import ModelConfig
    from jaxserve.model import moe

    rng = np.random.default_rng(0)
    h, i, e = 16, 24, 5
    x = rng.standard_normal((t, h)).astype(np.float32)
    router = rng.standard_normal((e, h)).astype(np.float32)
    x[:, 0], router[4] = 3.0, 0.0
    router[4, 0] = -50.0  # expert 4's logit is -150 for every token: never chosen
    gate, up = (rng.standard_normal((e, h, i)).astype(np.float32) * 0.3 for _ in range(2))
    down = rng.standard_normal((e, i, h)).astype(np.float32) * 0.3
    cfg = ModelConfig(vocab_size=8, hidden_size=h, intermediate_size=8, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8, num_experts=e,
                      num_experts_per_tok=2, moe_intermediate_size=i, norm_topk_prob=normalize)
    lp = moe.fuse_experts({"router": router.T, "experts_gate": gate, "experts_up": up,
                           "experts_down": down})
    gathered = jax.jit(lambda *args: moe.gathered_experts(*args, jax.nn.silu))
    grouped = jax.jit(lambda x, lp: moe.sparse_mlp(cfg, x, lp, jax.nn.silu))
    compiled = grouped.lower(x, lp).compile().as_text()  # for this CPU: one path kept
    assert (" sort(" in compiled) == (t * 2 > e)  # the grouped path sorts the pairs
    got = grouped(x, lp)
    weights, chosen = moe.route(x @ router.T, 2, normalize)
    assert 4 not in np.asarray(chosen)
    np.testing.assert_allclose(
        np.asarray(gathered(x, weights, chosen, lp["experts_gate_up"], lp["experts_down"])),
        np.asarray(got), atol=2e-5, rtol=2e-5)
    want = _reference_mlp(x, router, gate, up, down, 2, normalize)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)


def test_config_reads_experts_and_dense_layers(checkpoint):
    """Qwen3-MoE's config (as transformers writes it, and with the hub's num_experts name):
    experts, top-k, widths, renormalisation and which layers are sparse; Mixtral's always
    renormalise. A decode token counts its routed experts' FLOPs, not all of them."""
    import json

    from jaxserve.weights import config_from_hf

    with open(f"{checkpoint('qwen3_moe')[1]}/config.json") as f:
        raw = json.load(f)
    cfg = config_from_hf(raw)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
            cfg.intermediate_size, cfg.norm_topk_prob, cfg.qk_norm) == (4, 2, 40, 112, False, True)
    assert [cfg.layer_is_sparse(i) for i in range(2)] == [True, False]
    hub = {k: v for k, v in raw.items() if k != "num_local_experts"}
    stepped = config_from_hf({**hub, "num_experts": 4, "mlp_only_layers": [],
                              "decoder_sparse_step": 2, "num_hidden_layers": 4})
    assert [stepped.layer_is_sparse(i) for i in range(4)] == [False, True, False, True]
    h = cfg.hidden_size
    dense = dataclasses.replace(cfg, num_experts=0, mlp_only_layers=())
    moe_mlp = h * 4 + 3 * h * 2 * 40  # router, then 2 experts of 40 columns
    assert cfg.flops_per_token() - dense.flops_per_token() == 2 * (moe_mlp - 3 * h * 112)
    mixtral = load_model(checkpoint("mixtral")[1], lazy=True).config
    assert mixtral.norm_topk_prob and mixtral.moe_intermediate_size == 48
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        dataclasses.replace(cfg, num_experts_per_tok=5)
    with pytest.raises(ValueError, match="mlp_only_layers"):
        dataclasses.replace(cfg, mlp_only_layers=(2,))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", MODELS)
def test_logits_match_transformers(checkpoint, name, backend):
    """Two prefill chunks of 32 then 4 decode steps, pages out of order; the model loaded
    lazily (layer by layer, as the runner places it) from its directory."""
    need_backend(backend)
    model, directory = checkpoint(name)
    loaded = load_model(directory, lazy=True)
    chunks_then_decode_logits_match(model, loaded.config, loaded.params, backend, num_pages=32,
                                    pages_per_table=10, decode_steps=4)


def test_renormalising_the_chosen_experts_changes_the_logits(checkpoint):
    """Same weights, norm_topk_prob off and on: transformers' logits differ well beyond the
    tolerance the test above holds each of them to."""
    ids = torch.tensor([[5, 9, 31, 77, 120, 4]])
    with torch.no_grad():
        off, on = (checkpoint(n)[0](ids).logits.numpy() for n in ("qwen3_moe", "qwen3_moe-norm"))
    assert np.abs(off - on).max() > 1e-2


@pytest.mark.parametrize("name,backend", [("mixtral", "cpu"), ("qwen3_moe", "xla")])
def test_engine_greedy_tokens_match_transformers(checkpoint, name, backend, monkeypatch):
    """Three requests at once, two of them longer than a prefill chunk (chunked prefill beside
    another's decode), 10 greedy tokens each, the model loaded eagerly: transformers' tokens.
    One family a backend (each engine compiles its own steps); the logits test above runs
    every family on both. The cpu backend's token buckets start at 1, so the short request's
    lone decode steps run 2 (token, expert) pairs through its packed experts' grouped matmul
    (backends/cpu/packing.py); the xla backend's take the gathered experts."""
    from jaxserve.backends.cpu.packing import PanelExperts
    from jaxserve.model import moe

    need_backend(backend)
    rows, gathered, real = [], moe.gathered_experts, PanelExperts.grouped_matmul
    monkeypatch.setattr(PanelExperts, "grouped_matmul",
                        lambda self, x, *a: rows.append(len(x)) or real(self, x, *a))
    monkeypatch.setattr(moe, "gathered_experts",
                        lambda x, *a: rows.append(-len(x)) or gathered(x, *a))
    model, directory = checkpoint(name)
    config = EngineConfig.from_options(page_size=PAGE, max_num_batched_tokens=CHUNK,
                                       max_num_seqs=4, num_pages=40, attention_backend=backend)
    llm = LLM.from_engine(LLMEngine(config, load_model(directory)))
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(3, TINY["vocab_size"], n)] for n in (7, 45, 70)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == transformers_greedy(model, prompt, 10)
    llm.engine.scheduler.check_invariants()
    # A decode step's pairs: through the packed kernel (cpu) or the gathered experts (xla).
    assert (2 in rows) if backend == "cpu" else any(r < 0 for r in rows)


def _dequantized(params) -> dict:
    """params with every weight quantization='int8' quantizes (the layers' projections and
    experts, the head) replaced by its dequantized float values, stacked as the loaders stack
    them (a LayerStack: some weights are in some layers only)."""
    from jaxserve.model.llama import layer_of
    from jaxserve.model.quantize import Int8Weight, quantize_head, quantize_layer
    from jaxserve.weights.layer_stack import LayerStack

    def floats(w):
        return np.swapaxes(w.dequantize(), -1, -2) if isinstance(w, Int8Weight) else w

    stacked = params["layers"]
    layers = [{k: floats(v) for k, v in quantize_layer(layer_of(stacked, i), "int8").items()}
              for i in range(len(stacked["attn_norm"]))]
    shapes = {k: v.shape for layer in layers for k, v in layer.items()}
    restacked = {k: LayerStack([functools.partial(np.asarray, layer[k]) if k in layer else None
                                for layer in layers], (len(layers), *shape), np.float32)
                 for k, shape in shapes.items()}
    return {**params, "layers": restacked,
            "lm_head": floats(quantize_head(params, "int8")["lm_head"])}


@pytest.mark.parametrize("backend", BACKENDS)
def test_int8_experts_give_their_dequantized_weights_logits(checkpoint, backend):
    """quantization='int8' quantizes the experts too, the router staying float: through a
    prefill chunk and decode steps the logits are those of the same model whose quantized
    weights are replaced by their dequantized values, within 1e-4 (the cpu backend's packed
    int8 expert kernel; XLA dequantizing the chosen experts, or the whole stack for a grouped
    step), and not the float model's."""
    from jaxserve.model.quantize import Int8Weight

    need_backend(backend)
    loaded = load_model(checkpoint("qwen3_moe-int8")[1])
    rng = np.random.default_rng(3)
    prompt = [int(t) for t in rng.integers(3, TINY["vocab_size"], CHUNK + 5)]

    def logits(params, quantization):
        seq = Sequence(0, Request("r", prompt, SamplingParams(temperature=0)), list(prompt),
                       len(prompt))
        seq.page_ids = list(range(1, 9))
        runner = StepLogits(loaded.config, params, PAGE, backend, num_pages=16,
                            quantization=quantization)
        experts = runner.runner.params["layers"][0]["experts_gate_up"]
        assert isinstance(experts, Int8Weight) or getattr(experts, "scale", None) is not None \
            or quantization == "none"
        runner.step(StepPlan([ScheduledChunk(seq, 0, CHUNK, [])]))  # samples nothing
        out = [runner.step(StepPlan([ScheduledChunk(seq, CHUNK, 5, [seq])]))[0]]
        for tok in (7, 11, 13):
            seq.token_ids.append(tok)
            out.append(runner.step(StepPlan([ScheduledChunk(seq, seq.num_tokens - 1, 1,
                                                            [seq])]))[0])
        return np.stack(out)

    int8 = logits(loaded.params, "int8")
    np.testing.assert_allclose(int8, logits(_dequantized(loaded.params), "none"), atol=1e-4,
                               rtol=1e-4)
    assert np.abs(int8 - logits(loaded.params, "none")).max() > 1e-3


def test_bf16_experts_run_on_amx_tiles(checkpoint):
    """quantization='bf16' on the cpu backend packs the experts as AMX tiles too (the router
    stays float): through a prefill chunk and decode steps the logits stay within bfloat16's
    rounding of the float model's, and the greedy choice is the same."""
    if not cpu_kernels.amx_bf16_available():
        pytest.skip("AMX-BF16 unavailable")
    loaded = load_model(checkpoint("qwen3_moe-int8")[1])
    rng = np.random.default_rng(4)
    prompt = [int(t) for t in rng.integers(3, TINY["vocab_size"], CHUNK + 5)]

    def logits(quantization):
        seq = Sequence(0, Request("r", prompt, SamplingParams(temperature=0)), list(prompt),
                       len(prompt))
        seq.page_ids = list(range(1, 9))
        runner = StepLogits(loaded.config, loaded.params, PAGE, "cpu", num_pages=16,
                            quantization=quantization)
        runner.step(StepPlan([ScheduledChunk(seq, 0, CHUNK, [])]))
        out = [runner.step(StepPlan([ScheduledChunk(seq, CHUNK, 5, [seq])]))[0]]
        for tok in (7, 11, 13):
            seq.token_ids.append(tok)
            out.append(runner.step(StepPlan([ScheduledChunk(seq, seq.num_tokens - 1, 1,
                                                            [seq])]))[0])
        experts = runner.runner.params["layers"][0]["experts_gate_up"]
        return np.stack(out), experts.panels.dtype

    bf16, tiles = logits("bf16")
    f32, panels = logits("none")
    assert (tiles, panels) == (np.uint16, np.float32)
    # measured: 4e-3 at most, on logits up to 0.6 (x and the weights rounded to bfloat16)
    assert 1e-6 < np.abs(bf16 - f32).max() < 2e-2
    np.testing.assert_array_equal(bf16.argmax(-1), f32.argmax(-1))


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_compile_targets_hold_the_experts(checkpoint, quantization):
    """`jaxserve compile`'s abstract params are the tree the runner places for a model with a
    sparse and a dense layer: experts in layer 0 (int8 ones [E, out, in]), the dense MLP in
    layer 1."""
    import jax

    from jaxserve import backends
    from jaxserve.runtime import abstract
    from jaxserve.runtime.runner import ModelRunner

    int8 = quantization == "int8"
    loaded = load_model(checkpoint("qwen3_moe-int8" if int8 else "qwen3_moe")[1], lazy=True)
    runner = ModelRunner(loaded.config, loaded.params, num_pages=4, page_size=PAGE,
                         dtype="bfloat16", backend=backends.get("pallas-tpu"),  # a TPU target's
                         quantization=quantization)
    placed = abstract.abstract_params(loaded.config, runner.mesh, "bfloat16", quantization)
    shapes = lambda tree: jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), tree)  # noqa: E731
    assert shapes(placed) == shapes(runner.params)
    layers = runner.params["layers"]
    assert layers[0]["experts_gate_up"].shape == ((4, 128, 64) if int8 else (4, 64, 80))
    assert "w_gate_up" in layers[1]
    assert abstract.bytes_per_device(placed) == sum(
        x.nbytes for x in jax.tree_util.tree_leaves(runner.params))


def test_tensor_parallel_keeps_transformers_tokens(checkpoint):
    """tensor_parallel_size=2 on two virtual CPU devices (its own process): attention and the
    dense layer sharded, every expert on both devices, no sum across them for the sparse
    layer's output. Greedy tokens = transformers'."""
    tensor_parallel_tokens_match(*checkpoint("qwen3_moe"), num_pages=40)


def test_megablox_grouped_matmul_equals_ragged_dot():
    """moe._megablox (the TPU's grouped matmul) in Pallas's interpreter: 150 rows (padded to
    two row tiles of 128), an empty group, and 20 rows past the last group (expert
    parallelism's pairs routed elsewhere): ragged_dot's result, those rows 0."""
    import jax
    import jax.numpy as jnp

    from jaxserve.model import moe

    rng = np.random.default_rng(4)
    lhs = jnp.asarray(rng.standard_normal((150, 16)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((4, 16, 24)), jnp.float32)
    sizes = jnp.array([40, 0, 70, 20], jnp.int32)
    got = np.asarray(jax.jit(lambda *a: moe._megablox(*a, interpret=True))(lhs, rhs, sizes))
    np.testing.assert_allclose(got, np.asarray(jax.lax.ragged_dot(lhs, rhs, sizes)),
                               atol=1e-4, rtol=1e-4)
    assert np.all(got[130:] == 0) and np.all(np.abs(got[:130]).sum(axis=1) > 0)


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_experts_compile_for_tpu_with_megablox(generation):
    """A Qwen3-30B-A3B-shaped sparse layer (hidden 2048, 128 experts of 768 columns, top 8,
    bf16) lowered for a TPU chip runs megablox's Pallas kernel (Mosaic compiles it) for a
    decode step of 8 tokens (64 pairs: on the CPU each pair's expert is gathered) and a step
    of 256, with every expert and with an expert-parallel device's 32; lowered for this CPU,
    no Pallas call. Int8 experts compile too: a decode step with none, the step of 256 with
    megablox."""
    import jax
    import jax.numpy as jnp

    from jaxserve.config import ModelConfig
    from jaxserve.model import moe
    from jaxserve.model.quantize import Int8Weight
    from tpu_topology import abstract, tpu_device

    device = tpu_device(generation)
    h, inter, e = 2048, 768, 128
    cfg = ModelConfig(vocab_size=8, hidden_size=h, intermediate_size=8, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8, num_experts=e,
                      num_experts_per_tok=8, moe_intermediate_size=inter)
    run = jax.jit(lambda x, lp: moe.sparse_mlp(cfg, x, lp, jax.nn.silu, lambda y: y))
    for experts in (e, e // 4):
        lp = {"router": (e, h), "experts_gate_up": (experts, h, 2 * inter),
              "experts_down": (experts, inter, h)}
        lp = {k: abstract(v, jnp.bfloat16, device) for k, v in lp.items()}
        if experts < e:
            lp["expert_ids"] = abstract((experts,), jnp.int32, device)
        for tokens in (8, 256):
            text = run.lower(abstract((tokens, h), jnp.bfloat16, device), lp).compile().as_text()
            assert "tpu_custom_call" in text, (experts, tokens)
    cpu = jax.ShapeDtypeStruct((8, h), jnp.bfloat16)
    lp = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in lp.items()}
    assert "tpu_custom_call" not in run.lower(cpu, lp).compile().as_text()
    # int8 experts: a decode step dequantizes its chosen ones (no kernel), a larger one runs
    # megablox on the dequantized stack
    int8 = lambda out, inp: Int8Weight(abstract((e, out, inp), jnp.int8, device), *(  # noqa: E731
        abstract((e, out, inp // 32), jnp.float16, device) for _ in range(2)))
    lp = {"router": abstract((e, h), jnp.bfloat16, device),
          "experts_gate_up": int8(2 * inter, h), "experts_down": int8(h, inter)}
    for tokens, kernel in ((8, False), (256, True)):
        text = run.lower(abstract((tokens, h), jnp.bfloat16, device), lp).compile().as_text()
        assert ("tpu_custom_call" in text) == kernel, tokens


@pytest.mark.parametrize("m,sizes", [(150, [40, 0, 70, 20]), (64, [0] * 7 + [60]),
                                     (2048, [64] * 31 + [0]), (5, [0, 0, 0])])
def test_tiled_grouped_matmul_equals_ragged_dot(m, sizes):
    """moe.tiled_grouped_matmul (the CPU's grouped matmul): groups that share row tiles, empty
    groups, one group of all rows, rows past the last group (0), no rows in any group."""
    import jax
    import jax.numpy as jnp

    from jaxserve.model import moe

    rng = np.random.default_rng(len(sizes))
    lhs = jnp.asarray(rng.standard_normal((m, 16)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), 16, 24)), jnp.float32)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    got = np.asarray(jax.jit(moe.tiled_grouped_matmul)(lhs, rhs, group_sizes))
    np.testing.assert_allclose(got, np.asarray(jax.lax.ragged_dot(lhs, rhs, group_sizes)),
                               atol=1e-4, rtol=1e-4)
    assert np.all(got[sum(sizes):] == 0)
