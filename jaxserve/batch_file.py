"""OpenAI batch files, run offline through one in-process engine (run_batch), or spread over Ray
replicas (jaxserve.integrations.ray.run_batch_on_ray), both out of the pieces here: plan_batch
(what is left to run), LineRunner (lines through one engine), BatchWriter (the output file).

Input: JSONL, one request per line: {"custom_id", "method": "POST", "url": "/v1/completions",
"/v1/chat/completions" or (a pooling engine's) "/v1/embeddings", "body": {...}}; bodies are validated and translated by the server's code
(jaxserve.server.protocol), so both accept the same bodies. Output: JSONL in input order, one line
per input line: {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}.
A request the server would refuse gets its 4xx response; a line that is not a request at all
(malformed JSON, missing fields, unknown url) gets `error` and no response. Nothing aborts the file.

Resumable, keyed by input line, not by custom_id: each result also carries `line` (1-based line
number in the input file) and `line_sha256` (a fingerprint of that line's text), and a re-run skips
every line whose (line, line_sha256) already has a result, so a finished result is never rewritten
while its line is unchanged; an edited or moved line runs again, and results no longer matching a
line are dropped. Every line whose custom_id appeared on an earlier line gets its own
`duplicate_custom_id` error (a stored result is reused only if it agrees on that). Results are
appended as they finish (an interrupted run keeps them; a line torn by a kill is ignored and run
again), and the file is rewritten in input order at the end, one line per input line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
import uuid

from jaxserve.engine import LLMEngine
from jaxserve.server.json_io import dumps, parse_body
from jaxserve.config.serving import ServingConfig
from jaxserve.server.pooling import (EmbeddingsParsed, check_runner, embeddings_response,
                                     parse_embeddings)
from jaxserve.server.protocol import APIError, ParsedRequest, ProtocolContext, parse_request
from jaxserve.server.responses import ResponseBuilder

URL_KINDS = {"/v1/completions": "completion", "/v1/chat/completions": "chat",
             "/v1/embeddings": "embeddings"}  # embeddings: a pooling engine's (server/pooling.py)


@dataclasses.dataclass
class BatchSummary:
    total: int = 0  # request lines in the input
    skipped: int = 0  # already in the output (resumed)
    succeeded: int = 0
    failed: int = 0  # per-line errors and 4xx responses written by this run


@dataclasses.dataclass
class _Line:
    index: int
    custom_id: str
    parsed: ParsedRequest
    request_ids: list[str] = dataclasses.field(default_factory=list)
    finals: list = dataclasses.field(default_factory=list)


def _result(custom_id, *, response=None, error=None) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response,
            "error": error}


def _line_error(custom_id, code: str, message: str) -> dict:
    return _result(custom_id, error={"code": code, "message": message})


def _api_error(custom_id, e: APIError) -> dict:
    return _result(custom_id, response={"status_code": e.status,
                                        "request_id": f"req_{uuid.uuid4().hex}", "body": e.body()})


def _line_key(number: int, raw: str) -> tuple[int, str]:
    """(1-based line number in the input, fingerprint of the line's text)."""
    return number, hashlib.sha256(raw.strip().encode("utf-8")).hexdigest()[:16]


def _keyed(result: dict, key: tuple[int, str]) -> dict:
    # Two extra fields rather than a sidecar file: the output stays the whole resume state, so a
    # kill cannot leave two files out of step, and readers of OpenAI's format ignore extra fields.
    return {**result, "line": key[0], "line_sha256": key[1]}


def _is_duplicate(result: dict) -> bool:
    return (result.get("error") or {}).get("code") == "duplicate_custom_id"


def read_results(path: str) -> dict[tuple[int, str], dict]:
    """(line, line_sha256) -> result line of an existing output file; unreadable lines (one torn
    by a kill, or written without line keys) are ignored, so their input lines run again."""
    done: dict[tuple[int, str], dict] = {}
    if not os.path.exists(path):
        return done
    with open(path, encoding="utf-8") as f:
        for raw in f:
            try:
                result = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(result, dict):
                continue
            key = (result.get("line"), result.get("line_sha256"))
            if isinstance(key[0], int) and isinstance(key[1], str):
                done.setdefault(key, result)  # a line's first result is final
    return done


def _ends_mid_line(path: str) -> bool:
    """Whether the file's last line was cut short (by a kill) before its newline."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return False
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def _parse_envelope(raw: str) -> tuple[str | None, tuple[str, object] | dict]:
    """(custom_id, (kind, body)) or (custom_id or None, an error result): what is checked without
    the model (the body is validated where an engine runs it, LineRunner.submit)."""
    try:
        line = parse_body(raw)  # the server's nesting limit: no RecursionError ends the file
    except APIError as e:
        return None, _line_error(None, "invalid_json", e.message)
    if not isinstance(line, dict):
        return None, _line_error(None, "invalid_request", "each line must be a JSON object")
    cid = line.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return None, _line_error(None, "invalid_request", "'custom_id' must be a non-empty string")
    if line.get("method", "POST") != "POST":
        return cid, _line_error(cid, "invalid_request", "'method' must be POST")
    kind = URL_KINDS.get(line.get("url"))
    if kind is None:
        return cid, _line_error(cid, "invalid_url", f"'url' must be one of {list(URL_KINDS)}, "
                                                    f"got {line.get('url')!r}")
    return cid, (kind, line.get("body"))


# A line to run: (index in the input's request lines, custom_id, url kind, body).
Todo = tuple[int, str, str, object]


@dataclasses.dataclass
class BatchPlan:
    """What a run of `input_path` against `output_path` has left to do."""
    keys: list[tuple[int, str]]  # each request line's (line, line_sha256)
    results: list[dict | None]  # resumed and line-error results; None: still to run
    todo: list[Todo]
    summary: BatchSummary


def plan_batch(input_path: str, output_path: str) -> BatchPlan:
    """Read the input and the results already in the output (the resume rules, duplicates)."""
    with open(input_path, encoding="utf-8") as f:
        lines = [(_line_key(n, raw), raw) for n, raw in enumerate(f, 1) if raw.strip()]
    done = read_results(output_path)
    plan = BatchPlan([key for key, _ in lines], [None] * len(lines), [],
                     BatchSummary(total=len(lines)))
    seen: set[str] = set()
    for i, (key, raw) in enumerate(lines):
        cid, item = _parse_envelope(raw)
        duplicate = cid is not None and cid in seen
        if cid is not None:
            seen.add(cid)
        stored = done.get(key)
        if stored is not None and _is_duplicate(stored) == duplicate:
            plan.results[i] = stored
            plan.summary.skipped += 1
        elif duplicate:
            plan.results[i] = _keyed(_line_error(cid, "duplicate_custom_id", f"custom_id {cid!r} "
                                                 "appears on an earlier line of the input"), key)
            plan.summary.failed += 1
        elif isinstance(item, dict):
            plan.results[i] = _keyed(item, key)
            plan.summary.failed += 1
        else:
            plan.todo.append((i, cid, *item))
    return plan


class BatchWriter:
    """Appends each finished result to the output as it comes (an interrupted run keeps them),
    and on `finish` rewrites the file in input order, one line per input line."""

    def __init__(self, output_path: str, plan: BatchPlan, progress: bool = False):
        self.path, self.plan = output_path, plan
        self.bar = None
        if progress:
            from tqdm import tqdm

            # lines, as the summary counts them: those resumed or refused before running are
            # done already
            self.bar = tqdm(total=plan.summary.total, initial=plan.summary.total - len(plan.todo),
                            desc="batch", unit="line")
        os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
        torn = _ends_mid_line(output_path)
        self.sink = open(output_path, "a", encoding="utf-8")
        if torn:  # end the torn line, or the next result would be glued onto it and lost
            self.sink.write("\n")

    def emit(self, i: int, result: dict) -> None:
        if self.plan.results[i] is not None:
            raise RuntimeError(f"request line {self.plan.keys[i][0]} finished twice")
        self.plan.results[i] = result = _keyed(result, self.plan.keys[i])
        self.sink.write(dumps(result) + "\n")
        self.sink.flush()
        ok = result["error"] is None and result["response"]["status_code"] == 200
        self.plan.summary.succeeded += ok
        self.plan.summary.failed += not ok
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        self.sink.close()
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def finish(self) -> BatchSummary:
        self.close()
        missing = [self.plan.keys[i][0] for i, r in enumerate(self.plan.results) if r is None]
        if missing:
            raise RuntimeError(f"{len(missing)} request line(s) have no result, e.g. line "
                               f"{missing[0]}")
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for result in self.plan.results:
                f.write(dumps(result) + "\n")
        os.replace(tmp, self.path)
        return self.plan.summary


class LineRunner:
    """Runs batch lines through one engine: `submit` validates and queues them, `poll` steps the
    engine and hands back (index, result) for every line that finished. The local run and each
    Ray replica (jaxserve.integrations.ray) drive the same object."""

    def __init__(self, engine: LLMEngine, ctx: ProtocolContext):
        self.engine, self.ctx = engine, ctx
        self.owner: dict[str, _Line] = {}
        self.ready: list[tuple[int, dict]] = []
        self.unfinished = 0  # lines submitted whose result poll has not handed back yet

    def submit(self, items: list[Todo]) -> None:
        for i, cid, kind, body in items:
            self.unfinished += 1
            try:
                served = self.engine.served_model
                check_runner(served, kind)
                parsed = (parse_embeddings(body, self.ctx, served,
                                           ServingConfig.max_prompts_per_request)
                          if kind == "embeddings" else parse_request(kind, body, self.ctx))
            except APIError as e:
                self.ready.append((i, _api_error(cid, e)))
                continue
            except Exception as e:  # noqa: BLE001 - a bug fails its line, as the server's 500
                logging.exception("batch line %r", cid)
                self.ready.append((i, _api_error(cid, APIError(
                    f"internal error: {type(e).__name__}", status=500, type="internal_error"))))
                continue
            if not isinstance(parsed, EmbeddingsParsed):
                parsed.stream = parsed.include_usage = False
            line = _Line(i, cid, parsed, finals=[None] * len(parsed.prompts))
            lora = self.ctx.adapters.get(parsed.model)  # "model" names a --lora_modules adapter
            try:
                for k, prompt in enumerate(parsed.prompts):
                    rid = f"batch-{i}-{k}"
                    self.engine.add_request(prompt, parsed.params, request_id=rid,
                                            lora_request=lora)
                    line.request_ids.append(rid)
                    self.owner[rid] = line
            except ValueError as e:  # RequestRejected: never runnable here
                for rid in line.request_ids:
                    self.engine.abort(rid)
                    self.owner.pop(rid, None)
                self.ready.append((i, _api_error(cid, APIError(str(e), code="invalid_value"))))

    def poll(self, max_seconds: float = 0.0) -> list[tuple[int, dict]]:
        """Step the engine until a line finishes, nothing runs, or max_seconds have passed (at
        least one step while anything runs); the finished lines' results."""
        deadline = time.monotonic() + max_seconds
        while self.owner and not self.ready:
            for out in self.engine.step():
                if out.finished and out.request_id in self.owner:
                    self._finished(self.owner.pop(out.request_id), out)
            if time.monotonic() >= deadline:
                break
        ready, self.ready = self.ready, []
        self.unfinished -= len(ready)
        return ready

    def _finished(self, line: _Line, out) -> None:
        line.finals[line.request_ids.index(out.request_id)] = out
        if any(f is None for f in line.finals):
            return
        failed = [f.error for f in line.finals if f.error is not None]
        if failed:  # the engine failed this request alone
            self.ready.append((line.index, _api_error(line.custom_id, APIError(
                f"the request failed: {failed[0]}", status=500, type="internal_error",
                code="request_failed"))))
            return
        body = (embeddings_response(line.parsed, line.finals, self.engine.served_model.pooling)
                if isinstance(line.parsed, EmbeddingsParsed)
                else ResponseBuilder(line.parsed, self.ctx).response(line.finals))
        self.ready.append((line.index, _result(line.custom_id, response={
            "status_code": 200, "request_id": body["id"], "body": body})))


def run_batch(engine: LLMEngine, input_path: str, output_path: str, *,
              ctx: ProtocolContext | None = None, progress: bool = False,
              max_in_flight: int | None = None) -> BatchSummary:
    """Run every request line of `input_path` through `engine` together; write `output_path`."""
    ctx = ctx or ProtocolContext.for_engine(engine)
    max_in_flight = max_in_flight or max(256, 4 * engine.config.scheduler.max_num_seqs)
    plan = plan_batch(input_path, output_path)
    writer = BatchWriter(output_path, plan, progress)
    runner = LineRunner(engine, ctx)
    pending = plan.todo[::-1]
    try:
        while pending or runner.unfinished:
            take = min(len(pending), max_in_flight - runner.unfinished)
            runner.submit([pending.pop() for _ in range(take)])
            for i, result in runner.poll():
                writer.emit(i, result)
    finally:
        writer.close()
    return writer.finish()
