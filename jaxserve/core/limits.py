"""What a request may ask of this engine: the checks add_request makes before anything is
queued. A request that fails one can never run under this configuration (RequestRejected), as
opposed to one that waits for room."""

from __future__ import annotations

from typing import Callable

from jaxserve.config import SchedulerConfig
from jaxserve.core.sequence import Request


class RequestRejected(ValueError):
    """The request can never be served under this configuration; the message says why."""


def check_request(request: Request, config: SchedulerConfig, page_size: int, *,
                  max_model_len: int, pages_for: Callable[[int], int],
                  num_usable_pages: int) -> None:
    rid, prompt = request.request_id, request.prompt_token_ids
    if request.sequences:
        raise RequestRejected(f"request {rid!r} already has sequences; add each Request once")
    if not prompt:
        raise RequestRejected(f"request {rid!r} has an empty prompt")
    if len(prompt) + 1 > max_model_len:
        raise RequestRejected(f"prompt of {len(prompt)} tokens + 1 exceeds max_model_len "
                              f"{max_model_len}")
    need = pages_for(len(prompt) + 1)
    if need > num_usable_pages:
        raise RequestRejected(f"prompt of {len(prompt)} tokens + 1 needs {need} pages but the KV "
                              f"pool has {num_usable_pages}")
    max_tokens = request.sampling_params.max_tokens
    if max_tokens is not None:
        # KV for every token but the last; the n forks share the prompt and, when the pool is
        # short, run one at a time (preempted and recomputed), so one sequence must fit.
        kv_tokens = min(len(prompt) + max_tokens, max_model_len) - 1
        need = pages_for(kv_tokens)
        if need > num_usable_pages:
            raise RequestRejected(f"prompt of {len(prompt)} tokens + max_tokens {max_tokens} needs "
                                  f"{need} pages of {page_size} tokens per sequence but the "
                                  f"KV pool has {num_usable_pages}")
    if not config.enable_chunked_prefill and len(prompt) > config.max_num_batched_tokens:
        raise RequestRejected(f"prompt of {len(prompt)} tokens exceeds max_num_batched_tokens "
                              f"{config.max_num_batched_tokens} and chunked prefill is disabled")
    n = request.sampling_params.n
    if n > config.max_num_seqs:
        raise RequestRejected(f"n={n} sequences exceeds max_num_seqs {config.max_num_seqs}")
