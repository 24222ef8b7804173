"""The pooling endpoints of a pooling engine (runner "pooling", engine/pooling.py):
POST /v1/embeddings (OpenAI's: input a string, a list of strings, a list of token ids or a list
of such lists; encoding_format float or base64; dimensions; usage), /score and /v1/score
(text_1 against text_2, each a string or a list), /rerank, /v1/rerank (Jina's and Cohere's
shape: query, documents, top_n, return_documents), /classify and /pooling (the pooler's output
per input, either task). Bodies are pydantic models
(strict JSON, a bad field a 400 naming it); a generation engine answers them with a 400, as a
pooling engine answers the generation endpoints (app.py). Scores: an embedding model's cosine,
a one-label classifier's sigmoid of the pair's logit (sentence-transformers' CrossEncoder)."""

from __future__ import annotations

import base64
import dataclasses
import time
import uuid
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import Request
from pydantic import Field, ValidationError

from jaxserve.core.sampling_params import SamplingParams

from jaxserve.engine.pooling import (check_dimensions, embedding_at, normalized, sigmoid,
                                     softmax)
from jaxserve.json_models import JsonObject, first_error, one_error
from jaxserve.server.disconnect import unless_disconnected
from jaxserve.server.json_io import parse_body
from jaxserve.server.protocol import APIError

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
Texts = Annotated[list[str], Field(min_length=1)]
Inputs = Annotated[str | TokenIds | Texts | Annotated[list[TokenIds], Field(min_length=1)],
                   one_error("must be a string, a list of strings, a list of token ids or a "
                             "list of such lists")]


class EmbeddingRequest(JsonObject):
    input: Inputs
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None


class ScoreRequest(JsonObject):
    text_1: Annotated[str | Texts, one_error("must be a string or a list of strings")]
    text_2: Annotated[str | Texts, one_error("must be a string or a list of strings")]
    model: str | None = None


class RerankRequest(JsonObject):
    query: str
    documents: Texts
    model: str | None = None
    top_n: Annotated[int, Field(ge=1)] | None = None
    return_documents: bool = True


class ClassifyRequest(JsonObject):
    input: Inputs
    model: str | None = None


class PoolingRequest(JsonObject):
    input: Inputs
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"


@dataclasses.dataclass(frozen=True)
class PoolingPrompts:
    """What the app's submit takes: the engine prompts (a pooling engine sets their params)."""

    prompts: list[dict]
    params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    model: str | None = None  # the model a request names: a pooling model serves no adapter


# The task each endpoint needs (score and rerank: either, checked by `scores`).
_TASKS = {"embeddings": "embed", "classify": "classify"}


def _validated(model: type[JsonObject], body: Any) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        error = first_error(e)
        raise APIError(str(error), param=error.param, code=error.code) from None


def _usage(outputs) -> dict:
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def _embedding_json(vector: np.ndarray, encoding_format: str):
    if encoding_format == "base64":  # OpenAI's: little-endian float32 bytes
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]


def check_runner(served, needed: str) -> None:
    """APIError unless the served model (engine/client.py's ServedModel) serves `needed`: an
    endpoint's name ("embeddings", "classify", "score", "rerank", or a generation kind)."""
    spec = served.pooling
    if needed not in ("embeddings", "classify", "score", "rerank", "pooling"):
        if spec is not None:
            raise APIError(f"this model pools (--runner=pooling): it serves /v1/embeddings, "
                           f"/score, /rerank, /classify and /pooling, not {needed}s",
                           code="wrong_runner")
        return
    if spec is None:
        raise APIError(f"this model generates: {needed} needs a pooling model (serve it "
                       "with --runner=pooling)", code="wrong_runner")
    if _TASKS.get(needed, spec.task) != spec.task:
        raise APIError(f"this model's task is {spec.task!r}, not {needed}", code="wrong_task")


def model_name(request, ctx) -> str:
    name = request.model or ctx.model_names[0]
    if name not in ctx.served_names:
        raise APIError(f"The model `{name}` does not exist. Served: {list(ctx.served_names)}",
                       param="model", code="model_not_found", status=404)
    return name


def prompts_of(items, field: str, ctx, max_prompts: int) -> list[dict]:
    """Strings or token id lists -> engine prompts; a 400 naming the field otherwise."""
    if isinstance(items, str) or (items and isinstance(items[0], int)):
        items = [items]
    if len(items) > max_prompts:
        raise APIError(f"'{field}' holds {len(items)} inputs; at most max_prompts_per_request="
                       f"{max_prompts} are accepted", param=field, code="too_many_prompts")
    prompts = []
    for i, item in enumerate(items):
        ids = ctx.tokenizer.encode(item) if isinstance(item, str) else list(item)
        where = f"{field}[{i}]" if len(items) > 1 else field
        if not ids:
            raise APIError(f"'{where}' is empty", param=field, code="invalid_value")
        bad = [t for t in ids if t >= ctx.vocab_size]
        if bad:
            raise APIError(f"'{where}' holds token ids outside [0, {ctx.vocab_size}): "
                           f"{bad[:5]}", param=field, code="invalid_value")
        if len(ids) >= ctx.max_model_len:
            raise APIError(f"'{where}' has {len(ids)} tokens; this model takes fewer than "
                           f"{ctx.max_model_len}", param=field, code="context_length_exceeded")
        prompts.append({"prompt_token_ids": ids,
                        "prompt": item if isinstance(item, str) else None})
    return prompts


@dataclasses.dataclass(frozen=True)
class EmbeddingsParsed(PoolingPrompts):
    """A /v1/embeddings body checked against the served model: its prompts and options."""

    model: str = ""
    dimensions: int | None = None
    encoding_format: str = "float"


def parse_embeddings(body: Any, ctx, served, max_prompts: int) -> EmbeddingsParsed:
    """A /v1/embeddings body (the server's and batch files'); APIError naming the field."""
    check_runner(served, "embeddings")
    parsed = _validated(EmbeddingRequest, body)
    name = model_name(parsed, ctx)
    if parsed.dimensions is not None:
        try:
            check_dimensions(served.pooling, parsed.dimensions, served.hidden_size)
        except ValueError as e:
            raise APIError(str(e), param="dimensions", code="invalid_value") from None
    return EmbeddingsParsed(prompts_of(parsed.input, "input", ctx, max_prompts), model=name,
                            dimensions=parsed.dimensions,
                            encoding_format=parsed.encoding_format)


def embeddings_response(parsed: EmbeddingsParsed, outs: list, spec) -> dict:
    """OpenAI's embeddings body of the finished engine outputs, in input order."""
    data = []
    for i, out in enumerate(outs):
        vector = embedding_at(out.pooled, spec, parsed.dimensions)
        data.append({"object": "embedding", "index": i,
                     "embedding": _embedding_json(vector, parsed.encoding_format)})
    return {**_header("embd", parsed.model), "data": data, "usage": _usage(outs)}


def _header(kind: str, name: str) -> dict:
    return {"id": f"{kind}-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": name}


def add_pooling_routes(app, aengine, ctx, *, read_body, off_loop, submit, cache_salt,
                       max_prompts: int) -> None:
    """The routes above on `app`. ctx: the server's ProtocolContext (model names, tokenizer,
    context); submit(PoolingPrompts, salt): the app's, an engine RequestGroup or an APIError."""
    served = aengine.served_model
    spec = served.pooling

    async def collect(group) -> list:
        final = [None] * group.size
        async for index, out in group:
            if out.error is not None:
                raise APIError(f"the request failed: {out.error}", status=500,
                               type="internal_error", code="request_failed")
            if out.finished:
                final[index] = out
        return final

    async def pooled(prompts: list[dict], request) -> list:
        """The finished outputs of `prompts`, in order; a client that goes away first aborts
        them all (a 499, which nobody reads), as the generation endpoints do."""
        group = await submit(PoolingPrompts(prompts), cache_salt(request))
        work = await unless_disconnected(collect(group), request, group)
        if work is None:
            raise APIError("the client disconnected", status=499, code="client_disconnected")
        return work.result()

    async def parse(request, model: type[JsonObject], needed: str):
        body = await off_loop(parse_body, await read_body(request))
        check_runner(served, needed)
        parsed = _validated(model, body)
        return parsed, model_name(parsed, ctx)

    def inputs(items, field: str) -> list[dict]:
        return prompts_of(items, field, ctx, max_prompts)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        body = await off_loop(parse_body, await read_body(request))
        parsed = await off_loop(parse_embeddings, body, ctx, served, max_prompts)
        return embeddings_response(parsed, await pooled(parsed.prompts, request), spec)

    async def scores(request, pairs: list[tuple[str, str]],
                     field: str) -> tuple[list[float], list]:
        """Each (query, document) pair's score, and the engine outputs it took; `field`: the
        body's field that a refused input is named by."""
        if spec.task == "classify":
            if spec.head.shape[0] != 1:
                raise APIError("scoring needs an embedding model or a one-label classifier; "
                               f"this one has {spec.head.shape[0]} labels", code="wrong_task")
            prompts = await off_loop(lambda: inputs(
                [ctx.tokenizer.backend.encode(q, d).ids for q, d in pairs], field))
            outs = await pooled(prompts, request)
            return [float(sigmoid(o.pooled[0])) for o in outs], outs
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        outs = await pooled(await off_loop(inputs, texts, field), request)
        vectors = {t: normalized(o.pooled) for t, o in zip(texts, outs)}
        return [float(vectors[q] @ vectors[d]) for q, d in pairs], outs

    async def score(request: Request):
        parsed, name = await parse(request, ScoreRequest, "score")
        first = [parsed.text_1] if isinstance(parsed.text_1, str) else parsed.text_1
        second = [parsed.text_2] if isinstance(parsed.text_2, str) else parsed.text_2
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise APIError(f"text_1 has {len(first)} texts for the {len(second)} of text_2 "
                           "(give one, or as many)", param="text_1", code="invalid_value")
        values, outs = await scores(request, list(zip(first, second)), "text_2")
        return {**_header("score", name), "usage": _usage(outs), "data": [
            {"index": i, "object": "score", "score": s} for i, s in enumerate(values)]}

    async def rerank(request: Request):
        parsed, name = await parse(request, RerankRequest, "rerank")
        values, outs = await scores(request, [(parsed.query, d) for d in parsed.documents],
                                    "documents")
        order = sorted(range(len(values)), key=lambda i: -values[i])[:parsed.top_n]
        results = [{"index": i, "relevance_score": values[i],
                    **({"document": {"text": parsed.documents[i]}}
                       if parsed.return_documents else {})} for i in order]
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": name, "results": results,
                "usage": _usage(outs)}

    @app.post("/classify")
    async def classify(request: Request):
        parsed, name = await parse(request, ClassifyRequest, "classify")
        outs = await pooled(await off_loop(inputs, parsed.input, "input"), request)
        data = []
        for i, out in enumerate(outs):
            probs = softmax(out.pooled)
            data.append({"index": i, "label": spec.labels[int(np.argmax(probs))],
                         "probs": [float(p) for p in probs], "num_classes": len(probs)})
        return {**_header("classify", name), "data": data, "usage": _usage(outs)}

    @app.post("/pooling")
    async def pooling(request: Request):
        """The pooler's output per input as the engine made it: the embedding (normalised
        where the model normalises, full size) or a classifier's logits."""
        parsed, name = await parse(request, PoolingRequest, "pooling")
        outs = await pooled(await off_loop(inputs, parsed.input, "input"), request)
        data = [{"index": i, "object": "pooling",
                 "data": _embedding_json(out.pooled, parsed.encoding_format)}
                for i, out in enumerate(outs)]
        return {**_header("pool", name), "data": data, "usage": _usage(outs)}

    for path in ("/score", "/v1/score"):
        app.post(path)(score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path)(rerank)
