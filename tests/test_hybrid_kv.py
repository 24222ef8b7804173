"""Layer groups of the KV pool (core/kv_groups.py): one page table per group, a sliding group
releasing its pages before its window. Host-only checks of the grouping and the scheduler's
page counts, then tiny seeded Gemma 3 (a 6-layer local/global pattern) and Qwen2
(max_window_layers) checkpoints in the engine: greedy tokens equal to transformers' through
chunked prefill, prefix hits, preemption and forks, with every page back afterwards."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.kv_groups import group_layers
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.sequence import Request

PAGE, WINDOW, CHUNK = 8, 12, 32


def test_layers_are_grouped_by_kind_in_groups_of_the_fewest():
    """Gemma 3 4B's 34 layers (5 local, 1 global, repeated): groups of 5, the full one first,
    six sliding ones the last of which has 4 layers; a model of one kind is one group."""
    gemma3 = tuple(None if i % 6 == 5 else 1024 for i in range(34))
    groups = group_layers(gemma3)
    assert groups.size == 5 and groups.windows == (None,) + (1024,) * 6
    assert groups.layers[0] == (5, 11, 17, 23, 29) and groups.layers[-1] == (30, 31, 32, 33)
    assert sorted(i for g in groups.layers for i in g) == list(range(34))
    assert all(groups.layers[g][s] == i for i, (g, s) in enumerate(groups.slot_of))
    assert group_layers((None,) * 30).num_groups == 1 and group_layers((None,) * 30).size == 30
    assert group_layers((4096,) * 8).windows == (4096,)
    qwen2 = group_layers((None, None, 64, 64, 64, 64))  # max_window_layers=2
    assert qwen2.size == 2 and qwen2.windows == (None, 64, 64)


def _scheduler(num_pages, group_windows, prefix=True):
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=CHUNK)
    cache = CacheConfig(page_size=PAGE, enable_prefix_caching=prefix, watermark=0.0)
    return Scheduler(config, cache, num_pages=num_pages, max_model_len=512, eos_token_ids=(2,),
                     model_fingerprint="m", group_windows=group_windows)


def _run(sched, requests, token=7, check=None):
    """Drive the scheduler to the end with a fixed sampled token; returns the steps run."""
    for r in requests:
        sched.add_request(r)
    steps = 0
    while sched.has_unfinished():
        plan = sched.schedule()
        sched.update(plan, [token] * len(plan.sample_rows))
        sched.check_invariants()
        if check is not None:
            check(sched)
        steps += 1
        assert steps < 2000
    return steps


def _request(rid, prompt, max_tokens, n=1):
    return Request(rid, list(prompt), SamplingParams(temperature=0, max_tokens=max_tokens,
                                                     ignore_eos=True, n=n))


def test_a_request_too_long_for_every_layer_fits_by_groups_and_returns_every_page():
    """One full and two sliding groups, 40 usable pages: 150 tokens need 19 pages a group, 57
    on every layer, but the sliding groups hold a window and a chunk (at most 7 pages each, 33
    in all): admitted, finished, and every page back. Each sliding table keeps only a leading run
    released; the full table keeps all."""
    sched = _scheduler(41, (None, WINDOW, WINDOW), prefix=False)
    peak = []

    def check(s):
        for seq in s.running:
            full, *sliding = s.kv.tables(seq)
            assert all(full)
            for table in sliding:
                assert sum(map(bool, table)) <= -(-(WINDOW - 1 + CHUNK) // PAGE) + 1
        peak.append(s.kv.referenced_pages_per_group(s.live_sequences()))
        assert sum(peak[-1]) == s.pool.num_referenced  # each referenced page in one group

    _run(sched, [_request("a", range(3, 103), 50)], check=check)
    assert 3 * -(-150 // PAGE) > 40
    assert max(p[0] for p in peak) == -(-149 // PAGE)
    assert max(max(p[1:]) for p in peak) <= 7
    assert sched.pool.num_referenced == 0 and sched.stats()["referenced_pages_per_group"] == [0, 0, 0]
    assert sched.counters["num_finished_total"] == 1 and sched.counters["num_rejected_total"] == 0


def test_prefix_hits_need_the_full_groups_pages_and_the_sliding_groups_last_window():
    """A second request sharing a 64-token prefix finds 7 pages (its last token is computed):
    the full group's 7 pages, the sliding group's from the page its window starts in (the
    earlier entries 0, released). Forks (n = 2) share every group's pages."""
    sched = _scheduler(64, (None, WINDOW))
    prefix = list(range(3, 67))
    _run(sched, [_request("a", prefix + [90], 4)])
    seq = _request("b", prefix + [91, 92], 4, n=2)
    sched.add_request(seq)
    plan = sched.schedule()
    s = seq.sequences[0]
    assert s.num_cached_tokens == 64
    first = (64 - WINDOW + 1) // PAGE  # the first page the query at 64 reads
    assert all(s.page_ids[:8]) and s.group_page_ids[0][:first] == [0] * first
    assert all(s.group_page_ids[0][first:8])
    sched.update(plan, [7] * len(plan.sample_rows))
    a, b = seq.sequences
    assert [bool(p) for p in b.group_page_ids[0]] == [bool(p) for p in a.group_page_ids[0]]
    per_group = sched.stats()["referenced_pages_per_group"]  # shared pages counted once
    assert per_group[0] == len(set(a.page_ids) | set(b.page_ids))
    assert sum(per_group) == sched.pool.num_referenced
    _run(sched, [])
    sched.check_invariants()
    assert sched.pool.num_referenced == 0


def test_a_hit_is_the_longest_prefix_every_group_covers():
    """Cached pages offered by hand: the full group has pages 0..8 of a 10-page prompt, the
    sliding group (window 12) 5..7. A hit of 9 pages would need the sliding group's 7 and 8
    (the window of the query at 72), so the hit is 8 pages: the full group's 0..7, the sliding
    group's 6 and 7 after released entries. Without the full group's page 3, no hit."""
    from jaxserve.core.kv_manager import KVManager
    from jaxserve.core.page_pool import PagePool
    from jaxserve.core.prefix_cache import PrefixCache
    from jaxserve.core.sequence import Sequence

    def setup(full_pages, sliding_pages):
        pool = PagePool(64)
        cache = PrefixCache(pool, PAGE, "m")
        kv = KVManager(pool, PAGE, cache, group_windows=(None, WINDOW))
        tokens = list(range(3, 84))  # 81 tokens: at most 10 pages hit
        keys = cache.chain_keys(tokens, None, 10)
        offered = {}
        for g, indices in enumerate((full_pages, sliding_pages)):
            for i in indices:
                (page,) = pool.allocate(1)
                cache.insert(cache.group_key(keys[i], g), page)
                pool.decref(page)  # unreferenced, findable
                offered[g, i] = page
        seq = Sequence(0, _request("r", tokens, 4), tokens, len(tokens))
        return kv, seq, offered

    kv, seq, offered = setup(range(9), (5, 6, 7))
    hit = kv.find_prefix(seq, None)
    assert hit.num_pages == 8 and hit.pages == [offered[0, i] for i in range(8)]
    assert hit.group_pages == ([0] * 6 + [offered[1, 6], offered[1, 7]],)
    kv.admit(seq, None, hit)
    kv.check([seq])
    assert seq.num_computed_tokens == 64 and kv.pool.num_referenced == 10
    kv, seq, _ = setup([i for i in range(9) if i != 3], (5, 6, 7))
    assert kv.find_prefix(seq, None).num_pages == 0


def test_accounting_reports_pages_and_bytes_per_group():
    """kv_budget for a Gemma-3-4B-shaped model (34 layers, 4 KV heads of 256, bf16, 5 local
    layers of window 1024 to 1 global): at 4K and 32K tokens a request holds 256 and 2048
    full-group pages plus 65 in each of six sliding groups, pages of 5 layers: 63% and 82%
    fewer bytes than every page on every layer. The memory plan counts a request's pages
    over its groups; Prometheus shows the referenced pages per group."""
    from prometheus_client import generate_latest

    from jaxserve.engine.memory_plan import MemoryPlan
    from jaxserve.server.metrics import ServerMetrics
    from jaxserve.tools import kv_budget as kvb

    arch = kvb.KVArchitecture(34, 4, 256, 2)
    windows = [None if i % 6 == 5 else 1024 for i in range(34)]
    out = kvb.analyse(arch, lengths=[4096, 32768], page_sizes=[16], layer_windows=windows)
    at_4k, at_32k = out["lengths"]["layer_groups"]
    assert [g["pages"] for g in at_4k["groups"]] == [256] + [65] * 6
    assert [g["pages"] for g in at_32k["groups"]] == [2048] + [65] * 6
    page_bytes = 16 * 2 * 5 * 4 * 256 * 2  # a page: 16 tokens of 5 layers
    assert at_4k["bytes"] == 646 * page_bytes and at_4k["every_page_kept_bytes"] == 4096 * 139264
    assert round(1 - at_4k["bytes"] / at_4k["every_page_kept_bytes"], 2) == 0.63
    assert round(1 - at_32k["bytes"] / at_32k["every_page_kept_bytes"], 2) == 0.82
    assert "layer_groups" not in kvb.analyse(arch, lengths=[4096], layer_windows=[None] * 34)[
        "lengths"]

    plan = MemoryPlan(budget_bytes=0, weight_bytes=0, activation_peak_bytes=0, runtime_bytes=0,
                      margin_bytes=0, page_bytes=page_bytes, page_size=16, num_pages=2585,
                      group_windows=(None,) + (1024,) * 6)
    assert plan.pages_per_group(32768) == [2048] + [65] * 6 and plan.max_requests(32768) == 1
    assert "2048 (full) + 65 (window 1024)" in plan.describe(32768)

    metrics = ServerMetrics()
    metrics._engine.stats = {"referenced_pages_per_group": [7, 3]}
    text = generate_latest(metrics.registry).decode()
    assert 'jaxserve:kv_referenced_pages_by_group{group="1"} 3.0' in text


# ---- the engine on tiny seeded checkpoints ----------------------------------------------------

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)


@functools.cache
def _model(name):
    """(transformers model, LoadedModel) of a seeded checkpoint: Gemma 3 with layers local,
    local, global twice (groups of 2: one full, two sliding), or Qwen2 with one full layer
    and two sliding ones (groups of 1)."""
    from jaxserve.weights import LoadedModel, config_from_hf, params_from_hf_state_dict
    from jaxserve.weights.random_init import numbered_tokenizer

    torch.manual_seed(0)
    if name == "gemma3":
        cfg = transformers.Gemma3TextConfig(
            **TINY, num_hidden_layers=6, head_dim=16, sliding_window=WINDOW,
            query_pre_attn_scalar=16, layer_types=["sliding_attention"] * 2 + ["full_attention"]
            + ["sliding_attention"] * 2 + ["full_attention"])
        model = transformers.Gemma3ForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**TINY, num_hidden_layers=3, use_sliding_window=True,
                                       sliding_window=WINDOW, max_window_layers=1)
        model = transformers.Qwen2ForCausalLM(cfg)
    model = model.eval().float()
    with torch.no_grad():
        for param_name, w in model.named_parameters():
            if param_name.endswith("norm.weight"):
                w.add_(torch.randn_like(w) * 0.3)
            if param_name.endswith(("q_proj.weight", "k_proj.weight")):
                w.mul_(6.0)  # scores far from uniform: the window matters
    ours = config_from_hf(cfg.to_dict())
    params = params_from_hf_state_dict(ours, {k: v.detach().numpy()
                                              for k, v in model.state_dict().items()})
    loaded = LoadedModel(config=ours, params=params, tokenizer=numbered_tokenizer(211, 2),
                         fingerprint=f"hybrid-{name}", source="tests/test_hybrid_kv.py")
    return model, loaded


@functools.cache
def _reference(name, prompt: tuple, max_tokens: int) -> list[int]:
    model = _model(name)[0]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            ids.append(int(torch.argmax(model(torch.tensor([ids]), use_cache=False).logits[0, -1])))
    return ids[len(prompt):]


@pytest.mark.parametrize("name,groups", [("gemma3", 3), ("qwen2", 3)])
def test_greedy_parity_through_prefix_hits_preemption_forks_and_lookahead(name, groups):
    """Three requests sharing a 40-token prefix (cached), one of them with n = 2 forks, each
    several windows long (prompt + 12 tokens, prefill chunks of 32), in a pool too small for
    all at once: preemption. Qwen2's engine also speculates (prompt lookup, k = 3) on a fourth
    request repeating a phrase: verification chunks reserve lookahead pages in every group and
    return the unused ones in every group. Every output equals transformers' greedy tokens;
    afterwards no page is referenced and the invariants hold."""
    from jaxserve.config import EngineConfig
    from jaxserve.core.kv_groups import groups_of
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.llm import LLM

    _, loaded = _model(name)
    assert groups_of(loaded.config).num_groups == groups
    spec = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                   "adaptive": False}} if name == "qwen2" else {}
    config = EngineConfig.from_options(page_size=PAGE, max_num_batched_tokens=CHUNK,
                                       max_num_seqs=4, num_pages=28, attention_backend="xla",
                                       **spec)
    llm = LLM.from_engine(LLMEngine(config, loaded))
    rng = np.random.default_rng(5)
    prefix = [int(t) for t in rng.integers(3, 211, 40)]
    prompts = [prefix + [int(t) for t in rng.integers(3, 211, n)] for n in (3, 11, 21)]
    params = [_greedy(12), _greedy(12, n=2), _greedy(12)]
    if spec:
        prompts.append([int(t) for t in rng.integers(3, 211, 7)] * 5)
        params.append(_greedy(12))
    llm.generate([{"prompt_token_ids": prompts[0]}], _greedy(2), use_tqdm=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out, sp in zip(prompts, outs, params):
        assert len(out.outputs) == sp.n
        for o in out.outputs:
            assert list(o.token_ids) == _reference(name, tuple(prompt), 12)
    sched = llm.engine.scheduler
    assert sched.counters["prefix_cache_hits"] >= 4 * PAGE
    assert sched.counters["num_preempted_total"] > 0
    assert llm.stats()["spec_draft_tokens"] > 0 or not spec
    sched.check_invariants()
    assert sched.pool.num_referenced == 0
    assert llm.stats()["referenced_pages_per_group"] == [0] * groups


def _greedy(max_tokens, n=1):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n)
