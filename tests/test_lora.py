"""LoRA serving (issue 58): a tiny seeded Llama and Qwen2 (transformers) and three random PEFT
adapters of different ranks (one rsLoRA), every B nonzero. In one batch mixing the base and
each adapter, every request's greedy tokens equal transformers + PEFT's for its adapter and its
prompt logprobs are within 1e-4, on the cpu and xla backends, with chunked prefill, more
adapters than device slots (LRU), prefix hits and preemption in a small pool. Unsupported
adapters are refused by name. One engine per (family, backend), shared by the module."""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest

from hf_families import TINY, seeded_model, tp_greedy, transformers_greedy

pytest.importorskip("peft")

MAX_TOKENS = 6
PAGE = 8
# (name, r, lora_alpha, use_rslora, target modules)
ADAPTERS = (("attn", 8, 16, False, ["q_proj", "k_proj", "v_proj", "o_proj"]),
            ("all-rs", 4, 8, True, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                    "up_proj", "down_proj"]),
            ("mlp", 16, 32, False, ["gate_proj", "up_proj", "down_proj"]))


def _hf_model(family: str):
    import transformers

    if family == "llama":
        cfg = transformers.LlamaConfig(**TINY, tie_word_embeddings=False)
        return seeded_model(transformers.LlamaForCausalLM, cfg)
    cfg = transformers.Qwen2Config(**TINY, tie_word_embeddings=True)  # q, k, v biases
    return seeded_model(transformers.Qwen2ForCausalLM, cfg)


def _peft(base, directory: str, seed: int, **lora_options):
    """A PEFT model over a copy of `base` with random A and B (init_lora_weights=False),
    saved to `directory`."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base),
                           LoraConfig(init_lora_weights=False, **lora_options)).eval()
    model.save_pretrained(directory)
    return model


@functools.cache
def _family(family: str, root: str):
    """(base transformers model, LoadedModel, {adapter name: (LoRARequest, peft model)})."""
    from jaxserve import LoRARequest
    from jaxserve.weights import LoadedModel, config_from_hf, params_from_hf_state_dict
    from jaxserve.weights.random_init import numbered_tokenizer

    base = _hf_model(family)
    cfg = config_from_hf(base.config.to_dict())
    tensors = {k: v.detach().numpy() for k, v in base.state_dict().items()}
    loaded = LoadedModel(config=cfg, params=params_from_hf_state_dict(cfg, tensors),
                         tokenizer=numbered_tokenizer(cfg.vocab_size, TINY["eos_token_id"]),
                         fingerprint=f"tiny-lora-{family}", source="tests/test_lora.py")
    adapters = {}
    for i, (name, r, alpha, rs, targets) in enumerate(ADAPTERS):
        path = f"{root}/{family}-{name}"
        model = _peft(base, path, seed=i + 1, r=r, lora_alpha=alpha, use_rslora=rs,
                      target_modules=targets)
        adapters[name] = (LoRARequest(name, i + 1, path), model)
    return base, loaded, adapters


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("lora"))


@functools.cache
def _engine(family: str, backend: str, root: str):
    """max_loras=2 for 3 adapters (LRU swaps), chunks of 16 tokens, a pool that preempts."""
    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.llm import LLM

    _, loaded, _ = _family(family, root)
    config = EngineConfig.from_options(
        attention_backend=backend, page_size=PAGE, max_num_batched_tokens=16, max_num_seqs=4,
        num_pages=10, enable_lora=True, max_loras=2, max_lora_rank=16, scan_layers="off")
    return LLM.from_engine(LLMEngine(config, loaded))


def _prompts(n: int, length: int = 20, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, TINY["vocab_size"], length)] for _ in range(n)]


def _reference(model, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    """(greedy tokens, logprob of each prompt token after the first) of a transformers model."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].double()
    logprobs = torch.log_softmax(logits, -1).numpy()
    return (transformers_greedy(model, prompt, MAX_TOKENS),
            logprobs[np.arange(len(prompt) - 1), prompt[1:]])


def _generate(llm, prompts, loras, prompt_logprobs: int | None = 0):
    """Greedy, with prompt logprobs unless None (which prefix hits need): most tests' steps then
    share their compiled shapes."""
    from jaxserve import SamplingParams

    sampling = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                              prompt_logprobs=prompt_logprobs)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False,
                        lora_request=loras)


FAMILIES_BACKENDS = [("llama", "cpu"), ("llama", "xla"), ("qwen2", "xla"), ("qwen2", "cpu")]


@pytest.mark.parametrize("family,backend", FAMILIES_BACKENDS)
def test_mixed_batch_matches_peft(family, backend, root):
    """Base and three adapters in one batch, more adapters than slots, chunked prefill and
    preemption: tokens equal PEFT's, prompt logprobs within 1e-4."""
    base, _, adapters = _family(family, root)
    llm = _engine(family, backend, root)
    names = [None, "attn", "all-rs", "mlp"]
    prompts = _prompts(len(names), seed=1)
    loras = [None if n is None else adapters[n][0] for n in names]
    before = llm.engine.stats()["num_preempted_total"]
    outs = _generate(llm, prompts, loras)
    assert llm.engine.stats()["num_preempted_total"] > before, "the pool was meant to preempt"
    base_tokens = [_reference(base, p)[0] for p in prompts]
    for name, prompt, out, base_ref in zip(names, prompts, outs, base_tokens):
        tokens, logprobs = _reference(base if name is None else adapters[name][1], prompt)
        assert list(out.outputs[0].token_ids) == tokens, name
        if name is not None:  # the adapter matters: the test could fail
            assert tokens != base_ref or not np.allclose(
                logprobs, _reference(base, prompt)[1], atol=1e-3), name
        ours = np.array([lp[t] for lp, t in zip(out.prompt_logprobs[1:], prompt[1:])])
        np.testing.assert_allclose(ours, logprobs, atol=1e-4, err_msg=str(name))


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_prefix_pages_are_per_adapter(backend, root):
    """The same prompt under two adapters shares no page; under the same adapter it does."""
    base, _, adapters = _family("llama", root)
    llm = _engine("llama", backend, root)
    prompt = _prompts(1, length=3 * PAGE + 3, seed=2)[0]
    _generate(llm, [prompt], adapters["attn"][0], None)
    again = _generate(llm, [prompt], adapters["attn"][0], None)[0]
    assert again.num_cached_tokens == 3 * PAGE  # the same adapter's full pages
    for lora, model in ((adapters["mlp"][0], adapters["mlp"][1]), (None, base)):
        out = _generate(llm, [prompt], lora, None)[0]  # attn's pages are still cached
        assert out.num_cached_tokens == 0, lora
        assert list(out.outputs[0].token_ids) == _reference(model, prompt)[0]
    assert list(again.outputs[0].token_ids) == _reference(adapters["attn"][1], prompt)[0]


def test_placing_an_adapter_compiles_nothing(root):
    """Swapping adapters through the two slots runs the step compiled already, and each
    request still gets its own adapter's tokens."""
    _, _, adapters = _family("llama", root)
    llm = _engine("llama", "xla", root)
    runner = llm.engine.runner
    _generate(llm, _prompts(3, seed=4), [adapters[n][0] for n in ("attn", "all-rs", "mlp")])
    compiled = runner._step._cache_size()
    prompt = _prompts(1, seed=5)[0]
    for name in ("mlp", "attn", "all-rs", "mlp"):  # each evicts the least recently used
        out = _generate(llm, [prompt], adapters[name][0])[0]
        assert list(out.outputs[0].token_ids) == _reference(adapters[name][1], prompt)[0]
    assert runner._step._cache_size() == compiled


class _Seq:  # what LoRASlots reads of a sequence
    def __init__(self, adapter: int):
        from jaxserve.core.sequence import Request

        self.request = Request("r", [1], None, lora_int_id=adapter)


def test_slots_least_recently_used_and_never_a_running_one():
    from jaxserve.core.lora import LoRASlots
    from jaxserve.core.step_plan import ScheduledChunk, StepPlan

    slots = LoRASlots(2)

    def step(*adapters, running=()):
        seqs = [_Seq(a) for a in adapters]
        plan = StepPlan([ScheduledChunk(s, 0, 1) for s in seqs])
        loads = slots.stamp(plan, [*seqs, *running])
        return [c.lora_slot for c in plan.chunks], loads

    assert step(0, 1, 2) == ([0, 1, 2], [(1, 1), (2, 2)])
    assert step(2) == ([2], [])  # 1 is now the least recently used
    assert step(3) == ([1], [(1, 3)])
    keep = _Seq(2)
    assert not slots.admits(_Seq(4).request, [keep, _Seq(3)])  # both slots run
    assert slots.admits(_Seq(3).request, [keep, _Seq(3)]) and slots.admits(_Seq(0).request, [])
    # 3 is the most recent but 2 runs: 3's slot goes
    assert step(4, running=[keep]) == ([1], [(1, 4)])
    with pytest.raises(ValueError, match="max_loras=2"):
        step(5, running=[keep, _Seq(4)])


def test_without_lora_the_step_is_the_plain_one():
    """enable_lora off: no adapter argument, no slot array in the batch."""
    from tiny_model import tiny_loaded

    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.runtime.batch import build_batch

    engine = LLMEngine(EngineConfig.from_options(attention_backend="xla", num_pages=16,
                                                 page_size=8), tiny_loaded())
    assert engine.runner.lora is None and engine.runner._adapters == {}
    assert engine.lora is None and not engine.buckets.lora
    engine.add_request({"prompt_token_ids": [5, 6, 7]})
    plan = engine.scheduler.schedule()
    assert build_batch(plan, engine.buckets, 8)[0].lora_slots is None
    with pytest.raises(ValueError, match="enable_lora"):
        engine.add_request({"prompt_token_ids": [5]}, lora_request=_request("x", "/nowhere"))


def _request(name, path, int_id=99):
    from jaxserve import LoRARequest

    return LoRARequest(name, int_id, path)


@pytest.mark.parametrize("what,options,error", [
    ("dora", dict(r=4, target_modules=["q_proj"], use_dora=True), "DoRA"),
    ("embedding", dict(r=4, target_modules=["embed_tokens", "q_proj"]), "embed_tokens"),
    ("head", dict(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]),
     "modules_to_save"),
    ("rank", dict(r=32, target_modules=["q_proj"]), "max_lora_rank=16"),
])
def test_unsupported_adapters_are_refused_by_name(what, options, error, root):
    base, _, _ = _family("llama", root)
    path = f"{root}/refused-{what}"
    _peft(base, path, seed=0, **options)
    llm = _engine("llama", "xla", root)
    with pytest.raises(ValueError, match=error):
        _generate(llm, _prompts(1), _request(what, path, int_id=50 + len(what)))
    assert not llm.engine.has_unfinished()


def test_adapter_of_another_base_is_refused(root):
    import transformers

    other = seeded_model(transformers.LlamaForCausalLM,
                         transformers.LlamaConfig(**{**TINY, "num_hidden_layers": 3},
                                                  tie_word_embeddings=False))
    path = f"{root}/refused-base"
    _peft(other, path, seed=0, r=4, target_modules=["q_proj", "down_proj"])
    llm = _engine("llama", "xla", root)
    with pytest.raises(ValueError, match="layer 2 of a base model with 2 layers"):
        _generate(llm, _prompts(1), _request("other", path, int_id=77))


_TP_SCRIPT = """
import json, sys
from jaxserve import LLM, LoRARequest, SamplingParams
llm = LLM(sys.argv[1], attention_backend="xla", tensor_parallel_size=2, page_size=8,
          max_num_batched_tokens=16, max_num_seqs=8, num_pages=24, enable_lora=True,
          max_loras=2, max_lora_rank=16, scan_layers="off")
loras = [None if p is None else LoRARequest(*p) for p in json.loads(sys.argv[3])]
outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[2])],
                    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False,
                    lora_request=loras)
print(json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def test_tensor_parallel_2_matches_peft(root):
    """Tensor parallelism 2 (two virtual CPU devices, its own process): the adapters sharded as
    their projections, base and three adapters in one batch over two slots give PEFT's tokens."""
    from jaxserve.weights.random_init import numbered_tokenizer

    base, _, adapters = _family("llama", root)
    directory = f"{root}/llama-base"
    base.save_pretrained(directory)
    numbered_tokenizer(TINY["vocab_size"], TINY["eos_token_id"]).save(directory)
    names = [None, "attn", "all-rs", "mlp"]
    prompts = _prompts(len(names), seed=6)
    loras = [None if n is None else [n, adapters[n][0].lora_int_id, adapters[n][0].lora_path]
             for n in names]
    import json

    got = tp_greedy(_TP_SCRIPT, directory, json.dumps(prompts), json.dumps(loras))
    for name, prompt, tokens in zip(names, prompts, got):
        assert tokens == _reference(base if name is None else adapters[name][1], prompt)[0], name


@pytest.fixture(scope="module")
def served(root):
    """One engine loop for the server tests: --lora_modules attn and mlp over two device slots,
    max_cpu_loras=2 (a third adapter drops the least recently used one from the host)."""
    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.server import AsyncEngine

    _, loaded, adapters = _family("llama", root)
    modules = tuple(f"{n}={adapters[n][0].lora_path}" for n in ("attn", "mlp"))
    config = EngineConfig.from_options(
        model="tiny-llama", attention_backend="xla", page_size=PAGE, max_num_batched_tokens=16,
        max_num_seqs=4, num_pages=10, enable_lora=True, max_loras=2, max_lora_rank=16,
        max_cpu_loras=2, scan_layers="off", lora_modules=modules)
    aengine = AsyncEngine(LLMEngine(config, loaded))
    yield aengine
    aengine.shutdown()


def _completion_tokens(url: str, name: str, prompt, headers=None) -> list[int]:
    import httpx

    body = {"model": name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return [int(w[1:]) for w in response.json()["choices"][0]["text"].split()]


def test_server_serves_adapters_by_model_name(root, served):
    """--lora_modules: each adapter listed in /v1/models with its base as parent and chosen by
    a request's "model" (PEFT's tokens); an unknown one is a 404 naming it. Without
    --allow_runtime_lora_updates there is no loading endpoint."""
    import httpx
    from serving import serve_app

    from jaxserve.server import ServerConfig, build_app

    base, _, adapters = _family("llama", root)
    prompt = _prompts(1, seed=7)[0]
    with serve_app(build_app(served, ServerConfig())) as url:
        listed = {m["id"]: m for m in httpx.get(f"{url}/v1/models").json()["data"]}
        assert listed["attn"]["parent"] == listed["mlp"]["parent"] == "tiny-llama"
        assert "parent" not in listed["tiny-llama"]
        for name, model in (("attn", adapters["attn"][1]), ("mlp", adapters["mlp"][1]),
                            ("tiny-llama", base)):
            assert _completion_tokens(url, name, prompt) == _reference(model, prompt)[0], name
        missing = httpx.post(f"{url}/v1/completions", json={"model": "nope", "prompt": prompt})
        assert missing.status_code == 404 and "nope" in missing.json()["error"]["message"]
        off = httpx.post(f"{url}/v1/load_lora_adapter",
                         json={"lora_name": "x", "lora_path": adapters["attn"][0].lora_path})
        assert off.status_code == 404


def test_runtime_lora_loading_and_unloading(root, served):
    """--allow_runtime_lora_updates behind a key: an adapter loaded over HTTP serves PEFT's
    tokens by its name (a third adapter past max_cpu_loras=2 is re-read when used again);
    a wrong key is a 401, a bad path, a refused adapter or a name already loaded a 400; an
    unload while a request streams under the adapter lets it finish with the adapter's tokens,
    after which the name 404s and the engine drops it."""
    import json

    import httpx
    from serving import serve_app

    from hf_families import transformers_greedy
    from jaxserve.server import ServerConfig, build_app

    base, _, adapters = _family("llama", root)
    auth = {"Authorization": "Bearer k"}
    prompt = _prompts(1, seed=8)[0]
    rs_path = adapters["all-rs"][0].lora_path
    with serve_app(build_app(served, ServerConfig(api_key="k",
                                                  allow_runtime_lora_updates=True))) as url:
        def post(path, body, headers=auth):
            return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=120)

        load = {"lora_name": "rs", "lora_path": rs_path}
        assert post("/v1/load_lora_adapter", load, {"Authorization": "Bearer no"}
                    ).status_code == 401
        assert post("/v1/load_lora_adapter", load).status_code == 200
        listed = {m["id"]: m for m in httpx.get(f"{url}/v1/models", headers=auth).json()["data"]}
        assert listed["rs"]["parent"] == "tiny-llama" and listed["rs"]["root"] == rs_path
        for name in ("rs", "attn", "mlp", "rs"):  # three adapters, two on the host
            want = _reference(adapters["all-rs" if name == "rs" else name][1], prompt)[0]
            assert _completion_tokens(url, name, prompt, auth) == want, name
        again = post("/v1/load_lora_adapter", load)
        assert again.status_code == 400 and "'rs'" in again.json()["error"]["message"]
        bad = post("/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": f"{root}/nowhere"})
        assert bad.status_code == 400 and f"{root}/nowhere" in bad.json()["error"]["message"]
        _peft(base, f"{root}/rank32", seed=0, r=32, target_modules=["q_proj"])
        refused = post("/v1/load_lora_adapter", {"lora_name": "big", "lora_path": f"{root}/rank32"})
        assert refused.status_code == 400 and "max_lora_rank" in refused.json()["error"]["message"]
        assert post("/v1/unload_lora_adapter", {"lora_name": "nope"}).status_code == 404

        # Unloaded while a request streams under it (the engine paused after its first token,
        # so that it is still running): the request finishes with rs's tokens.
        n = 48  # within the pool's 80 tokens
        body = {"model": "rs", "prompt": prompt, "max_tokens": n, "temperature": 0,
                "ignore_eos": True, "stream": True}
        text = ""
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=auth,
                          timeout=120) as stream:
            lines = (line for line in stream.iter_lines() if line.startswith("data: {"))
            text += json.loads(next(lines)[6:])["choices"][0]["text"]
            asyncio_run(served.pause())
            unload = post("/v1/unload_lora_adapter", {"lora_name": "rs"})
            asyncio_run(served.resume())
            assert unload.status_code == 200 and unload.json()["requests_in_flight"] == 1
            for line in lines:
                text += json.loads(line[6:])["choices"][0]["text"]
        assert [int(w[1:]) for w in text.split()] == transformers_greedy(
            adapters["all-rs"][1], prompt, n)
        gone = post("/v1/completions", {"model": "rs", "prompt": prompt, "max_tokens": 1})
        assert gone.status_code == 404 and "rs" in gone.json()["error"]["message"]
        ids = served.engine.lora.modules
        assert "rs" not in {m["id"] for m in httpx.get(f"{url}/v1/models", headers=auth
                                                       ).json()["data"]}
        loaded_ids = asyncio_run(served.call(lambda engine: engine.list_loras()))
        assert loaded_ids == {m.lora_int_id for m in ids.values()}  # rs dropped, slot freed
        assert post("/v1/unload_lora_adapter", {"lora_name": "rs"}).status_code == 404
    with pytest.raises(ValueError, match="allow_runtime_lora_updates"):
        ServerConfig(allow_runtime_lora_updates=True)  # no key: refuses to start
    tenants = ServerConfig(api_keys=(("a", "t1"), ("b", "t2")), operator_keys=("op",),
                           allow_runtime_lora_updates=True)
    with serve_app(build_app(served, tenants)) as url:
        load = {"lora_name": "rs", "lora_path": rs_path}
        tenant = httpx.post(f"{url}/v1/load_lora_adapter", json=load,
                            headers={"Authorization": "Bearer a"})
        assert tenant.status_code == 403  # it changes what every tenant is served
        operator = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "attn"},
                              headers={"Authorization": "Bearer op"})
        assert operator.status_code == 200 and operator.json()["requests_in_flight"] == 0


def asyncio_run(coroutine):
    import asyncio

    return asyncio.run(coroutine)


def test_remove_lora_lets_its_requests_finish(root):
    """LLMEngine.remove_lora while a request runs under the adapter: the request finishes
    with its tokens; the adapter is dropped, and its slot freed, once it has."""
    _, _, adapters = _family("llama", root)
    engine = _engine("llama", "xla", root).engine
    lora = adapters["attn"][0]
    engine.add_lora(lora)  # registered already if an earlier test used it: False then
    assert lora.lora_int_id in engine.list_loras()
    prompt = _prompts(1, seed=9)[0]
    from jaxserve import SamplingParams

    request = engine.add_request({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), lora_request=lora)
    outs = engine.step()
    assert engine.remove_lora(lora.lora_int_id)
    assert lora.lora_int_id not in engine.list_loras()
    assert lora.lora_int_id in engine.lora._registered  # still running under it
    while engine.has_unfinished():
        outs += engine.step()
    final = [o for o in outs if o.request_id == request.request_id and o.finished][0]
    assert list(final.outputs[0].token_ids) == _reference(adapters["attn"][1], prompt)[0]
    assert lora.lora_int_id not in engine.list_loras()
    assert lora.lora_int_id not in engine.lora._registered
    assert lora.lora_int_id not in engine.lora.slots._adapter_in.values()
    assert not engine.remove_lora(lora.lora_int_id)
    assert engine.add_lora(lora) and lora.lora_int_id in engine.list_loras()


def test_host_keeps_max_cpu_loras_never_a_live_one(root):
    """max_cpu_loras=1: the least recently used adapter no live request runs under leaves the
    host, and is read again from its path when used."""
    from jaxserve.config import LoRAConfig
    from jaxserve.engine.lora import LoRAAdapters

    _, loaded, adapters = _family("llama", root)
    host = LoRAAdapters(LoRAConfig(enable_lora=True, max_loras=1, max_lora_rank=16,
                                   max_cpu_loras=1), loaded.config)

    class Live:  # the engine's live requests' adapters
        ids: set = set()

        def lora_ids(self):
            return set(self.ids)

    live = Live()
    attn, rs, mlp = (adapters[n][0] for n in ("attn", "all-rs", "mlp"))
    first = host.register(attn, live)
    live.ids = {attn.lora_int_id}
    host.register(mlp, live)
    assert list(host._host) == [attn.lora_int_id, mlp.lora_int_id]  # attn is live: kept
    live.ids = set()
    host.register(rs, live)
    assert list(host._host) == [rs.lora_int_id]
    again = host.register(attn, live)
    assert again is not first and again.fingerprint == first.fingerprint
    assert list(host._host) == [attn.lora_int_id]
    assert host.list_loras(live) == {attn.lora_int_id, rs.lora_int_id, mlp.lora_int_id}


def test_batch_lines_run_under_the_adapter_they_name(root, tmp_path):
    """`jaxserve batch` lines whose "model" names an adapter (--lora_modules: the context's
    served adapters) run under it; no model is the base; an unknown one is a 404 line."""
    import dataclasses
    import json

    from jaxserve.batch_file import run_batch
    from jaxserve.server.protocol import ProtocolContext
    from jaxserve.server.served_adapters import ServedAdapters

    base, _, adapters = _family("llama", root)
    engine = _engine("llama", "xla", root).engine
    ctx = dataclasses.replace(ProtocolContext.for_engine(engine), adapters=ServedAdapters(
        (adapters["attn"][0], adapters["mlp"][0])))
    prompts = _prompts(3, seed=10)
    names = ["attn", None, "mlp", "nope"]
    lines = []
    for i, (name, prompt) in enumerate(zip(names, [*prompts, prompts[0]])):
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, **({"model": name} if name else {})}
        lines.append(json.dumps({"custom_id": str(i), "method": "POST",
                                 "url": "/v1/completions", "body": body}))
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    summary = run_batch(engine, str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), ctx=ctx)
    assert (summary.succeeded, summary.failed) == (3, 1)
    results = [json.loads(line)["response"]
               for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    for name, prompt, response in zip(names, prompts, results):
        text = response["body"]["choices"][0]["text"]
        model = base if name is None else adapters[name][1]
        assert [int(w[1:]) for w in text.split()] == _reference(model, prompt)[0], name
    assert results[3]["status_code"] == 404


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_the_step_with_adapters_compiles_for_tpu(generation):
    """The engine step with a LoRA stack (3 slots, rank 16) and per-token slots compiles for a
    TPU (libtpu's compile-only topology, the Pallas backend, bf16; nothing runs)."""
    import dataclasses

    import jax
    from test_accelerator_lowering import CONFIG
    from tpu_topology import abstract, tpu_device

    from jaxserve import backends
    from jaxserve.runtime.batch import build_batch, warmup_plan
    from jaxserve.runtime.buckets import Buckets
    from jaxserve.runtime.runner import ModelRunner, jitted_step
    from jaxserve.weights.random_init import random_model

    device = tpu_device(generation)
    page = 16
    runner = ModelRunner(CONFIG, random_model(CONFIG, dtype="bfloat16").params, num_pages=64,
                         page_size=page, dtype="bfloat16", backend=backends.get("pallas-tpu"),
                         lora=(3, 16))
    pages = CONFIG.max_position_embeddings // page
    buckets = dataclasses.replace(Buckets.for_engine(8, 64, pages, packed=True), lora=True)
    batch, _, _ = build_batch(warmup_plan(buckets.step_shapes(page)[-1], buckets, page),
                              buckets, page)
    on = functools.partial(jax.tree_util.tree_map, lambda x: abstract(np.shape(x), x.dtype, device))
    compiled = jitted_step(runner.cfg, runner.backend, runner.mesh).lower(
        on(runner.params), pool=on(runner.pool),
        batch=on(dataclasses.replace(batch, sampling=None)),
        feed=abstract((2 * buckets.seqs[-1],), np.int32, device), lora=on(runner.lora)).compile()
    assert "tpu_custom_call" in compiled.as_text()  # the Pallas attention, compiled by Mosaic
    lora_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(runner.lora))
    assert compiled.memory_analysis().argument_size_in_bytes > lora_bytes > 0
