"""The pooling runner (LoadConfig.runner "pooling", engine/pooling.py) against its references:
tiny seeded Qwen3 (last token, normalised) and Llama (mean) decoders saved as
sentence-transformers models embed as sentence-transformers does, and a
Qwen2ForSequenceClassification's logits are transformers', for inputs longer than a prefill
chunk (chunks of 32 tokens, pages of 8) in batches mixing lengths; prefix hits serve last-token
pooling and are skipped by mean pooling. One engine per checkpoint (module fixtures)."""

from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from pooling_models import (write_causal_lm, write_classifier,  # noqa: E402
                            write_sentence_transformer)

from jaxserve.engine.pooling import Pooler, check_dimensions, embedding_at  # noqa: E402
from jaxserve.llm import LLM  # noqa: E402
from jaxserve.weights.pooling import PoolingSpec  # noqa: E402

ENGINE = dict(runner="pooling", page_size=8, max_num_batched_tokens=32, max_num_seqs=4,
              num_pages=96, attention_backend="cpu")
# 1 to 150 tokens (one per byte, plus the special token): most cross several 32-token chunks.
TEXTS = ["x", "hello world", "a" * 40, "the quick brown fox jumps over the lazy dog " * 3,
         "tiny", "".join(chr(65 + i % 26) for i in range(149))]
PREFIX = "a shared prefix of several pages, long enough to span them all. " * 2


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


class Reference:
    """sentence-transformers' embeddings of one text at a time (no padding involved)."""

    def __init__(self, directory: str):
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(directory, device="cpu")
        self.model.tokenizer.pad_token = "<|endoftext|>"

    def embed(self, texts: list[str]) -> np.ndarray:
        return np.stack([self.model.encode([t], convert_to_numpy=True)[0] for t in texts])


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def embedder(request, tmp_path_factory):
    directory = write_sentence_transformer(
        str(tmp_path_factory.mktemp("pooling") / request.param), request.param)
    return request.param, LLM(directory, **ENGINE), Reference(directory)


def test_embeddings_equal_sentence_transformers(embedder):
    family, llm, reference = embedder
    outs = llm.embed(TEXTS, use_tqdm=False)
    lengths = [len(o.prompt_token_ids) for o in outs]
    assert max(lengths) > 4 * ENGINE["max_num_batched_tokens"] and min(lengths) <= 3
    got = np.stack([o.embedding for o in outs])
    want = reference.embed(TEXTS)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert cosines(got, want).min() >= 0.99999
    # Normalised by the checkpoint's Normalize module (qwen3), raw means (llama).
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5) == (family == "qwen3")
    # Score: the cosine of the two embeddings, one query against every document.
    scores = llm.score(TEXTS[1], TEXTS)
    np.testing.assert_allclose(scores, cosines(want[1][None], want), atol=1e-5)
    ranked = np.argsort(scores)[::-1]
    assert list(ranked) == list(np.argsort(cosines(want[1][None], want))[::-1])


def test_prefix_hits(embedder):
    """Texts sharing pages of prefix: last-token pooling takes the cached pages and still
    equals the reference; mean pooling computes every token (no hit) and equals it too."""
    family, llm, reference = embedder
    texts = [PREFIX + "first ending", PREFIX + "and a second, different ending"]
    llm.embed(texts[:1], use_tqdm=False)
    before = llm.stats()["prefix_cache_hits"]
    got = np.stack([o.embedding for o in llm.embed(texts, use_tqdm=False)])
    hits = llm.stats()["prefix_cache_hits"] - before
    assert (hits > 0) == (family == "qwen3")
    assert cosines(got, reference.embed(texts)).min() >= 0.99999


def test_pooler_combines_chunks_and_restarts_after_preemption():
    """Pooler.record by hand: a mean over chunks of 3 and 2 tokens; a sequence preempted after
    its first chunk and recomputed from token 0 pools its second pass only; a chunk overtaken
    since planning (its sequence no longer running) is not read."""
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.core.sequence import Request, Sequence, SequenceStatus
    from jaxserve.core.step_plan import ScheduledChunk, StepPlan

    pooler = Pooler(PoolingSpec(pooling_type="mean", normalize=False), hidden_size=2)
    request = Request("r", [5] * 5, SamplingParams())
    seq = Sequence(0, request, [5] * 5, 5, status=SequenceStatus.RUNNING)

    def step(start: int, n: int, sums, counts) -> None:
        plan = StepPlan(chunks=[ScheduledChunk(seq, start, n)])
        zeros = np.zeros((1, 2), np.float32)
        pooler.record(plan, {"sum": np.array([sums], np.float32), "count": np.array([counts]),
                             "first": zeros, "last": zeros})
        if seq.status is SequenceStatus.RUNNING:
            seq.num_computed_tokens = start + n

    step(0, 3, [100.0, 100.0], 3)  # the first pass, then preempted: recomputed from 0
    seq.num_computed_tokens = 0
    step(0, 3, [3.0, 6.0], 3)
    seq.status = SequenceStatus.WAITING  # overtaken: a plan for it still in flight is not read
    step(3, 2, [50.0, 50.0], 2)
    seq.status = SequenceStatus.RUNNING
    step(3, 2, [2.0, 4.0], 2)
    np.testing.assert_allclose(pooler.take("r"), [1.0, 2.0])
    assert pooler.take("r") is None  # taken once


def test_cls_pooling_and_flags_over_the_checkpoint(embedder):
    """--pooling_type=cls and --pooling_normalize override the checkpoint's modules: the first
    token's final hidden state (sentence-transformers' token embeddings), here not normalised
    (the Qwen3's first token is its text's first byte: no BOS state shared by every text)."""
    family, llm, reference = embedder
    if family != "qwen3":
        pytest.skip("one checkpoint is enough")
    tokens = reference.model.encode(TEXTS, output_value="token_embeddings",
                                    convert_to_numpy=False)
    want = np.stack([t[0].numpy() for t in tokens])
    cls = LLM(llm.engine.config.load.model, pooling_type="cls", pooling_normalize="off",
              **ENGINE)
    got = np.stack([o.embedding for o in cls.embed(TEXTS, use_tqdm=False)])
    assert len({round(float(v[0]), 4) for v in want}) > 3  # the texts' first tokens differ
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_warmup_compiles_the_pooling_steps(embedder):
    """Warm-up's jobs (listed, not compiled here) are every step shape and the page copies,
    and no sampling call: a pooling step samples nothing."""
    _, llm, _ = embedder
    jobs = [job[1] for job in llm.engine.runner._warmup_jobs(llm.engine.buckets, False)]
    steps = [what for what in jobs if what.startswith("step of")]
    assert len(steps) == len(llm.engine.buckets.step_shapes(ENGINE["page_size"])) > 1
    assert not any(what.startswith("sampling") for what in jobs)


def test_generation_endpoints_and_wrong_tasks(embedder):
    _, llm, _ = embedder
    with pytest.raises(ValueError, match="classify"):
        llm.classify(["a"])
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed(["a"], dimensions=16)  # no Matryoshka declared
    with pytest.raises(ValueError, match="prompt 1 has 1024 tokens"):
        llm.embed(["a", "b" * 1023])  # with its special token: the whole context


def test_matryoshka_dimensions():
    """Truncated, then normalised again; only to declared sizes."""
    spec = PoolingSpec(matryoshka=True, matryoshka_dimensions=(2, 4))
    v = np.array([3.0, 4.0, 12.0, 0.0], np.float32)
    np.testing.assert_allclose(embedding_at(v, spec, 2), [0.6, 0.8])
    for bad in (3, 0, 8, "2"):
        with pytest.raises(ValueError, match="dimensions"):
            check_dimensions(spec, bad, 4)
    check_dimensions(PoolingSpec(matryoshka=True), 3, 4)  # any size up to the full one


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    directory = write_classifier(str(tmp_path_factory.mktemp("pooling") / "classifier"))
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(directory).eval()
    return LLM(directory, **ENGINE), model


def test_classification_equals_transformers(classifier):
    import torch

    llm, model = classifier
    outs = llm.classify(TEXTS, use_tqdm=False)
    for out in outs:
        with torch.no_grad():
            want = model(torch.tensor([out.prompt_token_ids])).logits[0].numpy()
        np.testing.assert_allclose(out.logits, want, atol=1e-4)
        np.testing.assert_allclose(out.probs.sum(), 1.0, rtol=1e-6)
        assert out.label == model.config.id2label[int(np.argmax(want))]
    assert len({o.label for o in outs}) > 1  # the head separates them: the test can fail
    with pytest.raises(ValueError, match="embed"):
        llm.embed(["a"])
    with pytest.raises(ValueError, match="runner='pooling'"):  # it has no language-model head
        LLM(llm.engine.config.load.model, runner="generate")


def test_reranker_by_yes_no_tokens(tmp_path_factory):
    """A causal LM scoring by its last token's logit of "y" against "n" (Qwen3-Reranker's
    form): classify gives that difference, score its sigmoid over the joined pair."""
    import torch
    import transformers

    directory = write_causal_lm(str(tmp_path_factory.mktemp("pooling") / "reranker"))
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    llm = LLM(directory, classifier_from_tokens="n,y", **ENGINE)
    yes, no = (llm.get_tokenizer().backend.token_to_id(t) for t in "yn")

    def reference(ids: list[int]) -> float:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].numpy()
        return float(logits[yes] - logits[no])

    outs = llm.classify(TEXTS, use_tqdm=False)
    np.testing.assert_allclose([o.logits[0] for o in outs],
                               [reference(o.prompt_token_ids) for o in outs], atol=1e-4)
    query, docs = "which fox?", ["the quick brown fox", "a lazy dog", "nothing at all"]
    encode = llm.get_tokenizer().encode
    want = [1 / (1 + np.exp(-reference(encode(query) + encode(d)))) for d in docs]
    np.testing.assert_allclose(llm.score(query, docs), want, atol=1e-5)
    import httpx
    from serving import serve_app

    from jaxserve.server import AsyncEngine, ServerConfig, build_app

    aengine = AsyncEngine(llm.engine)
    try:
        with serve_app(build_app(aengine, ServerConfig())) as url:
            body = httpx.post(url + "/v1/rerank", json={"query": query, "documents": docs,
                                                        "return_documents": False},
                              timeout=60).json()
            assert [r["index"] for r in body["results"]] == list(np.argsort(want)[::-1])
            np.testing.assert_allclose([r["relevance_score"] for r in body["results"]],
                                       sorted(want, reverse=True), atol=1e-5)
            assert "document" not in body["results"][0]
            r = httpx.post(url + "/score", json={"text_1": "a", "text_2": ["b", "x" * 2000]},
                           timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == "text_2", r.text
    finally:
        aengine.shutdown()


def test_generation_engine_refuses_pooling():
    import types

    generating = types.SimpleNamespace(served_model=types.SimpleNamespace(pooling=None))
    llm = LLM.from_engine(generating)
    for call in (llm.embed, llm.classify):
        with pytest.raises(ValueError, match="runner='pooling'"):
            call(["a"])


def test_a_pooling_engine_refuses_lora_by_name(embedder):
    """The pooling step has no adapter stack: enable_lora is refused at start, not a
    TypeError at the first step."""
    _, llm, _ = embedder
    with pytest.raises(ValueError, match="runner='pooling' takes no LoRA adapters"):
        LLM(llm.engine.config.load.model, **ENGINE, enable_lora=True, scan_layers="off")


# ------------------------------------------------------------------------------- the server
@pytest.fixture
def pooling_server(embedder):
    from serving import serve_app

    from jaxserve.server import AsyncEngine, ServerConfig, build_app

    family, llm, reference = embedder
    aengine = AsyncEngine(llm.engine)
    with serve_app(build_app(aengine, ServerConfig(max_prompts_per_request=8))) as url:
        yield url, llm.engine.config.load.model, reference
    aengine.shutdown()


def test_openai_embeddings(pooling_server):
    """The openai client's embeddings.create (it asks for base64 and decodes it), float
    bodies, token id inputs, usage, and 400s naming the field; /pooling."""
    import base64

    import httpx
    import openai

    url, name, reference = pooling_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    texts = TEXTS[:4]
    got = client.embeddings.create(model=name, input=texts)
    want = reference.embed(texts)
    assert [d.index for d in got.data] == [0, 1, 2, 3]
    assert cosines(np.array([d.embedding for d in got.data]), want).min() >= 0.99999
    assert got.usage.prompt_tokens == got.usage.total_tokens > 100
    one = client.embeddings.create(model=name, input=texts[1], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, got.data[1].embedding, atol=1e-6)
    ids = [client.embeddings.create(model=name, input=[1, 2, 3, 4]).data[0].embedding,
           client.embeddings.create(model=name, input=[[1, 2, 3, 4]]).data[0].embedding]
    np.testing.assert_allclose(ids[0], ids[1], atol=1e-6)

    def error(path: str, body: dict) -> dict:
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == 400, r.text
        return r.json()["error"]

    assert error("/v1/embeddings", {"input": []})["param"] == "input"
    assert error("/v1/embeddings", {"input": 5})["param"] == "input"
    assert error("/v1/embeddings", {"input": [[1, 2], "a"]})["param"] == "input"
    assert error("/v1/embeddings", {"input": [10**6]})["param"] == "input"
    assert error("/v1/embeddings", {"input": ["a"] * 9})["param"] == "input"
    assert error("/v1/embeddings", {"input": "a", "encoding_format": "hex"})["param"] \
        == "encoding_format"
    assert error("/v1/embeddings", {"input": "a", "dimensions": 16})["param"] == "dimensions"
    assert error("/v1/completions", {"prompt": "a"})["code"] == "wrong_runner"
    assert error("/classify", {"input": "a"})["code"] == "wrong_task"
    # /pooling: the pooler's output per input (here the embedding), float or base64.
    pooled = httpx.post(url + "/pooling", json={"input": texts[:2]}, timeout=60).json()
    assert [(d["index"], d["object"]) for d in pooled["data"]] == [(0, "pooling"), (1, "pooling")]
    for d, w in zip(pooled["data"], want):
        assert cosines(np.array(d["data"]), w) >= 0.99999
    raw = httpx.post(url + "/pooling", json={"input": texts[2], "encoding_format": "base64"},
                     timeout=60).json()["data"][0]["data"]
    assert cosines(np.frombuffer(base64.b64decode(raw), "<f4"), want[2]) >= 0.99999
    assert pooled["usage"]["prompt_tokens"] > 0
    assert error("/pooling", {"input": []})["param"] == "input"


def test_score_and_rerank(pooling_server):
    import httpx

    url, name, reference = pooling_server
    docs = TEXTS[:5]
    want = cosines(reference.embed([TEXTS[3]]), reference.embed(docs))
    score = httpx.post(url + "/score", json={"text_1": TEXTS[3], "text_2": docs},
                       timeout=60).json()
    np.testing.assert_allclose([d["score"] for d in score["data"]], want, atol=1e-5)
    for path in ("/rerank", "/v1/rerank"):
        body = httpx.post(url + path, json={"query": TEXTS[3], "documents": docs, "top_n": 3},
                          timeout=60).json()
        assert [r["index"] for r in body["results"]] == list(np.argsort(-want)[:3])
        assert body["results"][0]["document"]["text"] == TEXTS[3]
    bad = httpx.post(url + "/score", json={"text_1": ["a", "b"], "text_2": ["c"] * 3})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_1"


def test_generation_model_refuses_pooling_endpoints():
    import httpx
    from serving import serve_app
    from tiny_model import tiny_loaded

    from jaxserve.config import EngineConfig
    from jaxserve.engine import LLMEngine
    from jaxserve.server import ServerConfig, build_app

    engine = LLMEngine(EngineConfig.from_options(model="tiny", num_pages=16, page_size=8,
                                                 attention_backend="xla"), tiny_loaded())
    with serve_app(build_app(engine, ServerConfig())) as url:
        for path, body in (("/v1/embeddings", {"input": "a"}), ("/rerank", {
                "query": "a", "documents": ["b"]}), ("/classify", {"input": "a"}),
                           ("/score", {"text_1": "a", "text_2": "b"})):
            r = httpx.post(url + path, json=body, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_runner", r.text


def test_classify_endpoint(classifier):
    import httpx
    from serving import serve_app

    from jaxserve.server import AsyncEngine, ServerConfig, build_app

    llm, model = classifier
    want = [o.probs for o in llm.classify(TEXTS[:3], use_tqdm=False)]
    aengine = AsyncEngine(llm.engine)
    try:
        with serve_app(build_app(aengine, ServerConfig())) as url:
            body = httpx.post(url + "/classify", json={"input": TEXTS[:3]}, timeout=60).json()
            assert [d["index"] for d in body["data"]] == [0, 1, 2]
            np.testing.assert_allclose([d["probs"] for d in body["data"]], want, atol=1e-6)
            assert [d["label"] for d in body["data"]] == [
                model.config.id2label[int(np.argmax(p))] for p in want]
            assert body["usage"]["prompt_tokens"] == sum(len(t.encode()) for t in TEXTS[:3])
            pooled = httpx.post(url + "/pooling", json={"input": TEXTS[:3]}, timeout=60).json()
            np.testing.assert_allclose(  # a classifier's pooler output: its logits
                [d["data"] for d in pooled["data"]],
                [o.logits for o in llm.classify(TEXTS[:3], use_tqdm=False)], atol=1e-5)
            r = httpx.post(url + "/v1/embeddings", json={"input": "a"}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_task"
            r = httpx.post(url + "/rerank", json={"query": "a", "documents": ["b"]}, timeout=60)
            assert r.status_code == 400 and "labels" in r.json()["error"]["message"]
    finally:
        aengine.shutdown()


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_pooling_step_compiles_for_tpu(generation):
    """The pooling runner's step (runtime/pooling.py) compiles for TPU targets with the Pallas
    kernels over a bf16 pool (libtpu's compile-only topologies), its outputs [S, H] float32."""
    from test_tpu_step_compile import LLAMA_128, PAGE, _on
    from tpu_topology import abstract, tpu_device

    from jaxserve import backends
    from jaxserve.runtime.batch import build_batch, warmup_plan
    from jaxserve.runtime.buckets import Buckets
    from jaxserve.runtime.pooling import PoolingRunner, _jitted_pool_step
    from jaxserve.weights.random_init import random_model

    device = tpu_device(generation)
    runner = PoolingRunner(LLAMA_128, random_model(LLAMA_128, dtype="bfloat16").params,
                           num_pages=64, page_size=PAGE, dtype="bfloat16",
                           backend=backends.get("pallas-tpu"))
    buckets = Buckets.for_engine(8, 64, LLAMA_128.max_position_embeddings // PAGE,
                                 query_block=1, packed=True)
    shape = buckets.step_shapes(PAGE)[-1]
    batch, _, _ = build_batch(warmup_plan(shape, buckets, PAGE), buckets, PAGE)
    step = _jitted_pool_step(runner.cfg, runner.backend, runner.mesh)
    from pallas_kernels.tpu import jax_kernel

    with jax_kernel.compile_target(device):
        compiled = step.lower(_on(runner.params, device), pool=_on(runner.pool, device),
                              batch=_on(dataclasses.replace(batch, sampling=None), device),
                              feed=abstract((2 * buckets.seqs[-1],), np.int32, device)).compile()
    pooled = compiled.out_info[1]["pooled"]
    rows = batch.attn.seq_lens.shape[0]
    assert pooled["last"].shape == (rows, LLAMA_128.hidden_size)
    assert pooled["sum"].dtype == np.float32
    assert "tpu_custom_call" in compiled.as_text()


def test_batch_file_embeddings(embedder, tmp_path):
    """`jaxserve batch` lines for /v1/embeddings: the server's bodies and answers; a completion
    line on a pooling model gets the server's 400."""
    import json

    from jaxserve.batch_file import run_batch

    _, llm, reference = embedder
    lines = [{"custom_id": "a", "method": "POST", "url": "/v1/embeddings",
              "body": {"input": TEXTS[:2]}},
             {"custom_id": "b", "method": "POST", "url": "/v1/embeddings",
              "body": {"input": TEXTS[3], "encoding_format": "base64"}},
             {"custom_id": "c", "method": "POST", "url": "/v1/embeddings", "body": {"input": 7}},
             {"custom_id": "d", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "a"}}]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = run_batch(llm.engine, str(source), str(target))
    assert (summary.succeeded, summary.failed) == (2, 2)
    out = {r["custom_id"]: r["response"] for r in map(json.loads, target.read_text().splitlines())}
    got = [d["embedding"] for d in out["a"]["body"]["data"]]
    assert cosines(np.array(got), reference.embed(TEXTS[:2])).min() >= 0.99999
    import base64

    b64 = np.frombuffer(base64.b64decode(out["b"]["body"]["data"][0]["embedding"]), "<f4")
    assert cosines(b64, reference.embed(TEXTS[3:4])[0]) >= 0.99999
    assert out["c"]["status_code"] == 400 and out["c"]["body"]["error"]["param"] == "input"
    assert out["d"]["body"]["error"]["code"] == "wrong_runner"


def test_disconnect_aborts_pooling_requests(embedder):
    """A client that goes away before its embeddings are done aborts every input of its
    request: with the engine paused, the aborts come only from the disconnect."""
    from serving import serve_app

    from jaxserve.server import AsyncEngine, ServerConfig, build_app

    aengine = AsyncEngine(embedder[1].engine)
    config = ServerConfig(enable_weight_updates=True, api_key="k")  # for /pause
    with serve_app(build_app(aengine, config)) as url:
        _aborted_by_disconnect(url)
    aengine.shutdown()


def _aborted_by_disconnect(url: str) -> None:
    import time

    import httpx

    http = httpx.Client(base_url=url, headers={"Authorization": "Bearer k"}, timeout=60)
    before = http.get("/debug/stats").json()["num_aborted_total"]
    assert http.post("/pause").status_code == 200
    try:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/embeddings", json={"input": TEXTS[:3]}, timeout=1.0)
        deadline = time.monotonic() + 10
        while True:
            stats = http.get("/debug/stats").json()
            if stats["num_aborted_total"] == before + 3 and stats["waiting"] == 0:
                break
            assert time.monotonic() < deadline, f"the disconnect aborted nothing: {stats}"
            time.sleep(0.05)
    finally:
        http.post("/resume")
    done = http.post("/v1/embeddings", json={"input": TEXTS[:2]})
    assert done.status_code == 200 and len(done.json()["data"]) == 2
