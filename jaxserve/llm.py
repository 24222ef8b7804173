"""The offline Python API, in the shape vLLM users know: LLM(...).generate / .chat."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from jaxserve.chat import Conversation
from jaxserve.config import EngineConfig
from jaxserve.core.lora import LoRARequest
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine import LLMEngine, Prompt, make_engine
from jaxserve.engine.pooling import (PoolingOutput, embedding_at, normalized, sigmoid,
                                     softmax)
from jaxserve.json_models import FieldError
from jaxserve.tokenizer import ChatTemplateError

Messages = list[dict[str, Any]]


class LLM:
    """`LLM(model="smollm2-135m", **engine_options)`: EngineConfig.from_options's flat options."""

    def __init__(self, model: str = "smollm2-135m", **engine_options: Any):
        self.engine = make_engine(EngineConfig.from_options(model=model, **engine_options))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """The offline API over an engine built elsewhere (e.g. from a LoadedModel)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt through the scheduler together; one RequestOutput per prompt, in order.
        lora_request: the LoRA adapter of every prompt, or one per prompt (None: the base
        model); the engine needs enable_lora.
        All prompts are validated before any runs, as the server validates them: a bad one raises
        ValueError (TypeError for a parameter that is not SamplingParams) naming its index, and
        runs nothing.
        use_tqdm: a progress bar (default: when there is more than one prompt)."""
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params[{i}] is {type(p).__name__}, not SamplingParams")
            p.validate()
            self.engine.check_params(p)  # logit_bias ids, the grammar (compiled and cached)
        tokenized = [self.engine.tokenize(p) for p in prompts]  # raises before anything is queued
        for i, ((_, ids), p) in enumerate(zip(tokenized, params)):
            self._check_context(i, len(ids), p)
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        elif len(lora_request) != len(prompts):
            raise ValueError(f"got {len(lora_request)} lora requests for {len(prompts)} prompts")
        else:
            loras = list(lora_request)
        # An adapter travels in the prompt, as a server's does (LLMEngine.add_request reads it).
        added = self._add_all([{"prompt_token_ids": ids, "prompt": text}
                               | ({} if lora is None else {"lora_request": lora})
                               for (text, ids), lora in zip(tokenized, loras)], params)
        if use_tqdm is None:  # a progress bar for more than one prompt, as vLLM shows
            use_tqdm = len(added) > 1
        return self._run(added, use_tqdm)

    def _add_all(self, prompts: list[dict], params: Sequence[SamplingParams | None]) -> list[str]:
        """Queue every (checked) prompt; their request ids. If one is refused, none stays."""
        added: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                added.append(self.engine.add_request(prompt, p).request_id)
        except BaseException:
            for rid in added:
                self.engine.abort(rid)
            raise
        return added

    def _check_context(self, i: int, prompt_tokens: int, params: SamplingParams) -> None:
        """The server's rule: an explicit max_tokens past the context is refused (None runs to
        the context's end)."""
        limit = self.engine.max_model_len
        if params.max_tokens is not None and prompt_tokens + params.max_tokens > limit:
            raise ValueError(f"prompt {i}: {prompt_tokens} tokens + max_tokens "
                             f"{params.max_tokens} exceed max_model_len {limit}; lower "
                             "max_tokens, or give None to generate up to the context's end")

    def chat(self, messages: Messages | list[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | None = None, *, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Apply the chat template (the model's, or `chat_template`) to one conversation or a
        list of them, and generate. Messages, tools and the template's fields are validated as
        the server validates a chat body (jaxserve/chat.py): text parts are joined, content None
        is empty, and a bad field raises ValueError naming it (FieldError.param) before anything
        runs. Tools reach the template as given (the server also writes them into the prompt of
        a template that renders none)."""
        single = not messages or isinstance(messages[0], dict)
        conversations = [messages] if single else list(messages)
        prompts = []
        for i, conversation in enumerate(conversations):
            try:
                chat = Conversation.validated(
                    messages=conversation, tools=tools, add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    chat_template_kwargs=chat_template_kwargs)
                text = chat.render(self.engine.tokenizer, chat_template=chat_template)
            except (FieldError, ChatTemplateError) as e:  # both name the field (param)
                where = "" if single else f"conversation {i}: "
                raise FieldError(f"{where}{e}", e.param) from None
            prompts.append({"prompt_token_ids": self.engine.tokenizer.encode(
                text, add_special_tokens=False), "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(request_ids)
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(request_ids), desc="requests", unit="req")
        try:
            while pending:
                if not self.engine.has_unfinished():
                    raise RuntimeError(f"engine stopped with {len(pending)} request(s) unfinished")
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        final[out.request_id] = out
                        pending.discard(out.request_id)
                        if bar is not None:
                            bar.update(1)
        finally:  # an exception (or Ctrl-C) leaves no request of this call behind
            for rid in pending:
                self.engine.abort(rid)
            if bar is not None:
                bar.close()
        return [final[rid] for rid in request_ids]

    # ---- pooling models (runner="pooling", engine/pooling.py)
    def embed(self, prompts: Prompt | Sequence[Prompt], *, dimensions: int | None = None,
              use_tqdm: bool | None = None) -> list[PoolingOutput]:
        """One embedding per prompt, in order (float32; normalised where the model is;
        `dimensions`: Matryoshka truncation where the model declares it)."""
        spec = self._pooling("embed")
        outs = self._pool(prompts, use_tqdm)
        for out in outs:
            out.embedding = embedding_at(out.data, spec, dimensions)
        return outs

    def classify(self, prompts: Prompt | Sequence[Prompt], *,
                 use_tqdm: bool | None = None) -> list[PoolingOutput]:
        """A sequence classifier's class logits and probabilities per prompt, in order."""
        spec = self._pooling("classify")
        outs = self._pool(prompts, use_tqdm)
        for out in outs:
            out.logits, out.probs = out.data, softmax(out.data)
            out.label = spec.labels[int(np.argmax(out.data))]
        return outs

    def score(self, queries: str | Sequence[str], documents: str | Sequence[str], *,
              use_tqdm: bool | None = None) -> list[float]:
        """Relevance of each document to its query (one query for all documents, or one each):
        an embedding model's cosine similarity; a one-label classifier's sigmoid of the pair's
        logit (sentence-transformers' CrossEncoder), tokenized as the tokenizer joins a pair."""
        single = [queries] if isinstance(queries, str) else list(queries)
        docs = [documents] if isinstance(documents, str) else list(documents)
        if len(single) == 1:
            single = single * len(docs)
        if len(single) != len(docs):
            raise ValueError(f"got {len(single)} queries for {len(docs)} documents")
        spec = self._pooling("score")
        if spec.task == "classify":
            if spec.head.shape[0] != 1:
                raise ValueError("score: a classifier scores pairs with one label only, this "
                                 f"one has {spec.head.shape[0]}")
            pairs = [{"prompt_token_ids": self.engine.tokenizer.backend.encode(q, d).ids}
                     for q, d in zip(single, docs)]
            return [sigmoid(o.data[0]) for o in self._pool(pairs, use_tqdm)]
        unique = list(dict.fromkeys(single + docs))
        vectors = {t: normalized(o.data) for t, o in zip(unique, self._pool(unique, use_tqdm))}
        return [float(vectors[q] @ vectors[d]) for q, d in zip(single, docs)]

    def _pooling(self, task: str):
        """The served model's PoolingSpec, or ValueError unless it serves `task`."""
        spec = self.engine.served_model.pooling
        if spec is None:
            raise ValueError(f"{task}: this engine generates; build it with runner='pooling'")
        if spec.task != task and task != "score":
            raise ValueError(f"{task}: this model's task is {spec.task!r}")
        return spec

    def _pool(self, prompts, use_tqdm: bool | None) -> list[PoolingOutput]:
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        tokenized = [self.engine.tokenize(p) for p in prompts]  # raises before anything runs
        limit = self.engine.max_model_len
        for i, (_, ids) in enumerate(tokenized):  # the scheduler's one token past the prompt
            if len(ids) >= limit:
                raise ValueError(f"prompt {i} has {len(ids)} tokens; a pooling model takes "
                                 f"fewer than max_model_len {limit}")
        added = self._add_all([{"prompt_token_ids": ids, "prompt": text}
                               for text, ids in tokenized], [None] * len(tokenized))
        outs = self._run(added, len(added) > 1 if use_tqdm is None else use_tqdm)
        failed = [o for o in outs if o.pooled is None]
        if failed:
            raise RuntimeError(f"request {failed[0].request_id} failed: {failed[0].error}")
        return [PoolingOutput(o.request_id, o.prompt_token_ids, o.pooled) for o in outs]

    def stats(self) -> dict:
        return self.engine.stats()

    # ---- reinforcement learning (docs/rl.md): the engine's RolloutControl (engine/client.py),
    # LLMEngine's or DataParallelEngine's over every replica
    def update_weights(self, weights) -> None:
        """Replace the weights in place, without compiling: (name, array) pairs or a mapping in
        the checkpoint's Hugging Face names and layout (numpy, JAX or torch; whole layers, or
        all), or a tree like params_like(). The prefix cache is forgotten."""
        self.engine.update_weights(weights)

    def params_like(self) -> dict:
        """The engine's params as jax.ShapeDtypeStruct: structure, shapes, dtypes, shardings."""
        return self.engine.params_like()

    def pause(self) -> None:
        self.engine.pause()

    def resume(self) -> None:
        self.engine.resume()

    def sleep(self, level: int = 1) -> None:
        """Free the KV pool (level 1) and the weights too (level 2)."""
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """The KV pool again; level 2's weights come back by update_weights."""
        self.engine.wake_up(tags)

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()
