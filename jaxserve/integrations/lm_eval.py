"""lm-evaluation-harness's model "jaxserve": lm-eval's requests run through one in-process engine.

Every kind of request is one LLM.generate call over the whole list, so the engine batches them
all: loglikelihood scores the continuation from prompt logprobs (one generated token, discarded),
loglikelihood_rolling scores lm-eval's own rolling windows the same way, generate_until maps
gen_kwargs onto SamplingParams. Contexts are cut as lm-eval's local-completions model cuts them
against a server of the same max_model_len, so both give the same numbers.

Registered by import (`@register_model`): lm-eval 0.4.13 discovers no plugins.
"""

from __future__ import annotations

import logging
from typing import Any

from jaxserve.tools import require

require("lm_eval", "eval")

from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402
from lm_eval.models.utils import postprocess_generated_text  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from jaxserve.core.sampling_params import SamplingParams  # noqa: E402
from jaxserve.llm import LLM  # noqa: E402

log = logging.getLogger(__name__)

# gen_kwargs that SamplingParams takes under the same name; until, max_gen_toks, do_sample and
# temperature are read on their own.
_SAMPLING_KWARGS = ("top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                    "repetition_penalty")
# One scoring request: ((context, continuation) or None, context ids, continuation ids).
Scored = tuple[Any, list[int], list[int]]


@register_model("jaxserve")
class JaxserveLM(TemplateLM):
    """`--model jaxserve --model_args model=smollm2-135m,max_num_seqs=64,...` (EngineConfig
    fields), or JaxserveLM(llm=LLM(...), model=its name) around an engine built elsewhere."""

    def __init__(self, model: str | None = None, pretrained: str | None = None,
                 llm: LLM | None = None, max_gen_toks: int = 256, add_bos_token: bool = False,
                 seed: int = 1234, batch_size: Any = None, max_batch_size: Any = None,
                 device: Any = None, **engine_options: Any):
        super().__init__()
        # batch_size, max_batch_size, device: lm-eval passes them to every model; the engine
        # batches all requests itself (max_num_seqs, max_num_batched_tokens) on JAX's device.
        del batch_size, max_batch_size, device
        model = model or pretrained
        if llm is None:
            model = model or "smollm2-135m"
            llm = LLM(model=model, **engine_options)
        elif engine_options:
            raise ValueError("give llm= or engine options, not both")
        self.llm = llm
        self.tokenizer = llm.get_tokenizer()
        self.model_name = model or "jaxserve"  # with llm=, only names it (request caches)
        self.max_gen_toks = int(max_gen_toks)
        self.add_bos_token = bool(add_bos_token)
        self.seed = int(seed)

    # --- what TemplateLM asks --------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_ids[0]

    @property
    def prefix_token_id(self) -> int:
        """An empty context and the first rolling window condition on BOS, else EOS."""
        bos = self.tokenizer.bos_token_id
        return self.eot_token_id if bos is None else bos

    @property
    def max_length(self) -> int:
        return self.llm.engine.max_model_len

    @property
    def tokenizer_name(self) -> str:
        return str(self.model_name).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs: Any) -> list[int]:
        special = self.add_bos_token if add_special_tokens is None else add_special_tokens
        return self.tokenizer.encode(string, add_special_tokens=special)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tokenizer.chat_template if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """The model's template; without a generation prompt the last message is left open (a
        prefilled answer the model continues), as transformers' continue_final_message does
        (which ends the text at the content stripped of trailing whitespace)."""
        if add_generation_prompt or not chat_history:
            return self.tokenizer.apply_chat_template(
                chat_history, add_generation_prompt=add_generation_prompt)
        last = {**chat_history[-1], "content": str(chat_history[-1].get("content", "")).rstrip()}
        return self.tokenizer.apply_chat_template([*chat_history[:-1], last],
                                                  add_generation_prompt=False,
                                                  continue_final_message=True)

    # --- scoring ---------------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests: list[Scored],
                              disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(sum of the continuation's logprobs, whether greedy decoding gives it), from the
        prompt logprobs of context + continuation; contexts are cut from the left to leave room
        for the one generated token."""
        limit = self.max_length - 1
        prompts, starts = [], []
        for _, context, continuation in requests:
            if len(continuation) >= limit:
                raise ValueError(f"a continuation of {len(continuation)} tokens leaves no context "
                                 f"within max_model_len {self.max_length}")
            ids = (context + continuation)[-limit:]
            prompts.append({"prompt_token_ids": ids})
            starts.append(len(ids) - len(continuation))
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
        outs = self.llm.generate(prompts, params, use_tqdm=not disable_tqdm)
        results = []
        for (key, _, _), prompt, start, out in zip(requests, prompts, starts, outs):
            _raise_failed(out)
            ids, total, greedy = prompt["prompt_token_ids"], 0.0, True
            for pos in range(start, len(ids)):
                entry = out.prompt_logprobs[pos]  # {token at pos: logprob, most likely: logprob}
                total += entry[ids[pos]]
                greedy = greedy and entry[ids[pos]] >= max(entry.values())
            results.append((total, greedy))
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, results[-1])
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's logprob over lm-eval's disjoint rolling windows, all texts' windows in one
        call."""
        windows, owners = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for context, pred in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length - 2, context_len=1)):
                windows.append((None, context, pred))
                owners.append(i)
        totals = [0.0] * len(requests)
        scores = self._loglikelihood_tokens(windows, disable_tqdm) if windows else []
        for i, (logprob, _) in zip(owners, scores):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # --- generation ------------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        prompts, params, stops = [], [], []
        for context, gen_kwargs in (req.args for req in requests):
            p, until = self._sampling_params(gen_kwargs)
            ids = self.tok_encode(context)
            room = self.max_length - p.max_tokens
            if len(ids) > room:
                log.warning("a context of %d tokens + max_gen_toks %d exceeds max_model_len %d: "
                            "its start is cut", len(ids), p.max_tokens, self.max_length)
                ids = ids[-room:]
            prompts.append({"prompt_token_ids": ids})
            params.append(p)
            stops.append(until)
        outs = self.llm.generate(prompts, params, use_tqdm=not disable_tqdm)
        texts = []
        for req, out, until in zip(requests, outs, stops):
            _raise_failed(out)
            texts.append(postprocess_generated_text(out.outputs[0].text, until, None))
            self.cache_hook.add_partial("generate_until", req.args, texts[-1])
        return texts

    def _sampling_params(self, gen_kwargs: dict) -> tuple[SamplingParams, list[str]]:
        """gen_kwargs as local-completions reads them: greedy unless a temperature is given
        (do_sample alone samples at 1), max_gen_toks tokens at most, stopping at `until`."""
        kwargs = dict(gen_kwargs or {})
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_tokens = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
        if max_tokens >= self.max_length:  # keep one context token
            log.warning("max_gen_toks %d leaves no context within max_model_len %d: %d tokens "
                        "at most", max_tokens, self.max_length, self.max_length - 1)
            max_tokens = self.max_length - 1
        temperature = float(kwargs.pop("temperature", 1.0 if kwargs.pop("do_sample", False)
                                       else 0.0))
        kwargs.pop("do_sample", None)
        unknown = sorted(set(kwargs) - set(_SAMPLING_KWARGS))
        if unknown:
            raise ValueError(f"gen_kwargs {unknown} are not supported by the jaxserve model "
                             f"(supported: until, max_gen_toks, do_sample, temperature, "
                             f"{', '.join(_SAMPLING_KWARGS)})")
        kwargs.setdefault("seed", self.seed if temperature > 0 else None)
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                stop=[s for s in until if s], **kwargs)
        return params, until


def _raise_failed(out) -> None:
    if out.error is not None or out.outputs[0].finish_reason == "error":
        raise RuntimeError(f"request {out.request_id} failed: {out.error}")
