"""Ray: batch files over engine replicas, and a Ray Data processor (the `ray` extra).

run_batch_on_ray (`jaxserve batch --ray_replicas=N`): the driver reads the batch file and the
output's finished lines (jaxserve.batch_file.plan_batch, the resume rules) and writes every result
itself (BatchWriter), so the output file has one writer and stays in input order. Each replica is
a Ray actor holding one engine (its own devices: tensor/data parallel options apply per replica)
that runs lines through jaxserve.batch_file.LineRunner. The driver keeps each replica fed with
up to twice its batch (the engine's queue covers the round trip), and a result is written when it
reaches the driver: a replica that dies loses only lines the driver has not written, which go
back to the front of the queue for the others. Nothing is written twice; nothing is lost while
one replica lives, and if none does, the written results stay and a rerun resumes.

JaxserveProcessor / build_processor: `ds.map_batches` over a Ray Data dataset with a pool of
engines, rows {"prompt": text} or {"messages": [...]} (optional "sampling_params": a dict per
row) gaining "generated_text", "num_generated_tokens" and "finish_reason".
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import logging
import math
import os
from typing import Any, Callable

from jaxserve.tools import require

require("ray", "ray")

import numpy as np  # noqa: E402
import ray  # noqa: E402

from jaxserve.batch_file import (BatchSummary, BatchWriter, LineRunner, Todo,  # noqa: E402
                                 plan_batch)
from jaxserve.chat import Conversation  # noqa: E402
from jaxserve.core.sampling_params import SamplingParams  # noqa: E402

log = logging.getLogger(__name__)
POLL_SECONDS = 0.5  # longest a replica steps before reporting back when nothing finishes


class RayBatchError(RuntimeError):
    """The run could not go on over Ray (no replica started, or every one died)."""


@dataclasses.dataclass
class RayBatchSummary(BatchSummary):
    replicas: int = 0
    replicas_lost: int = 0  # replicas that died during the run
    retried: int = 0  # lines handed to another replica after theirs died
    last_error: str | None = None  # why the last replica was lost


# ----------------------------------------------------------------------------- resources
def devices_per_replica(engine_options: dict[str, Any]) -> int:
    return ((engine_options.get("tensor_parallel_size") or 1)
            * (engine_options.get("data_parallel_size") or 1))


def actor_resources(engine_options: dict[str, Any], replicas: int = 1,
                    spare_cpus: int = 0) -> dict[str, Any]:
    """Ray resources for one replica: its devices as GPUs or TPU chips where the cluster has
    them, one CPU otherwise (less where spare_cpus must stay free for other tasks: an engine
    on the CPU uses every core whatever it is granted); refuses what the cluster can never
    place (Ray would wait forever)."""
    n = devices_per_replica(engine_options)
    cluster = ray.cluster_resources()
    if cluster.get("GPU"):
        options, kind, have = {"num_gpus": n}, "GPU", cluster["GPU"]
    elif cluster.get("TPU"):
        options, kind, have = {"resources": {"TPU": n}}, "TPU", cluster["TPU"]
    else:
        kind, have = "CPU", cluster.get("CPU", 0)
        n = min(1.0, max(0.0, (have - spare_cpus) / replicas)) if spare_cpus else 1
        options = {"num_cpus": n}
    if n * replicas > have:
        raise ValueError(f"{replicas} replica(s) of {n} {kind} each need {n * replicas} {kind}; "
                         f"the Ray cluster has {have:g}")
    return options


@contextlib.contextmanager
def ray_session(address: str | None = None, num_cpus: int | None = None):
    """Ray for the duration: the caller's connection when ray is initialized already (left
    open), else `address`'s cluster (default: $RAY_ADDRESS, as Ray reads it), else a local one
    of num_cpus CPUs (no dashboard); both shut down (disconnected) at the end."""
    if ray.is_initialized():
        yield
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
    else:
        ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False)
    try:
        yield
    finally:
        ray.shutdown()


# ----------------------------------------------------------------------------- batch files
class BatchReplica:
    """One engine in a Ray actor, running batch lines (jaxserve.batch_file.LineRunner)."""

    def __init__(self, engine_options: dict[str, Any], context: dict[str, Any]):
        from jaxserve.config import EngineConfig
        from jaxserve.engine import make_engine
        from jaxserve.server.protocol import ProtocolContext

        engine = make_engine(EngineConfig.from_options(**engine_options))
        self.runner = LineRunner(engine, ProtocolContext.for_engine(engine, **context))
        config = engine.config
        self.capacity = 2 * config.scheduler.max_num_seqs * config.parallel.data_parallel_size

    def ready(self) -> int:
        """Lines to keep in flight here."""
        return self.capacity

    def run(self, items: list[Todo], max_seconds: float) -> list[tuple[int, dict]]:
        """Queue `items`, step, and return the lines that finished: one round trip does both, so
        an error in either reaches the driver."""
        self.runner.submit(items)
        return self.runner.poll(max_seconds)


_RemoteReplica = ray.remote(BatchReplica)


def run_batch_on_ray(engine_options: dict[str, Any], input_path: str, output_path: str, *,
                     replicas: int, address: str | None = None, progress: bool = False,
                     on_replicas: Callable[[list], None] | None = None,
                     **context: Any) -> RayBatchSummary:
    """Run `input_path` over `replicas` engine actors and write `output_path` as run_batch does.
    context: ProtocolContext.for_engine's options (model_names, max_tokens_limit,
    tool_call_parser, reasoning_parser), as each replica's requests are read.
    on_replicas: called with the actor handles once all are ready (tests kill one)."""
    if not (isinstance(replicas, int) and replicas >= 1):
        raise ValueError(f"ray replicas must be an integer >= 1, got {replicas!r}")
    from jaxserve.server.protocol import ProtocolContext

    try:  # a misspelt option fails here, not in every replica
        inspect.signature(ProtocolContext.for_engine).bind(None, **context)
    except TypeError as e:
        raise ValueError(f"run_batch_on_ray: {e}") from None
    plan = plan_batch(input_path, output_path)
    summary = RayBatchSummary(**dataclasses.asdict(plan.summary), replicas=replicas)
    plan.summary = summary
    writer = BatchWriter(output_path, plan, progress)
    try:
        if plan.todo:  # a finished file needs no cluster
            with ray_session(address, num_cpus=max(os.cpu_count() or 1, replicas)):
                _dispatch(plan.todo, writer, summary, engine_options, replicas, context,
                          on_replicas)
    finally:
        writer.close()
    writer.finish()
    return summary


def _lost(summary: RayBatchSummary, r: int, error: Exception) -> None:
    summary.replicas_lost += 1
    summary.last_error = str(error).strip().splitlines()[-1] if str(error).strip() else repr(error)
    log.warning("Ray replica %d lost: %s", r, error)


def _dispatch(todo: list[Todo], writer: BatchWriter, summary: RayBatchSummary,
              engine_options: dict[str, Any], replicas: int, context: dict[str, Any],
              on_replicas) -> None:
    options = actor_resources(engine_options, replicas)
    actors = [_RemoteReplica.options(**options).remote(engine_options, context)
              for _ in range(replicas)]
    try:
        capacity: dict[int, int] = {}  # live replica -> lines to keep in flight there
        for r, ready in enumerate([a.ready.remote() for a in actors]):
            try:
                capacity[r] = ray.get(ready)
            except ray.exceptions.RayError as e:  # its engine did not start: run without it
                _lost(summary, r, e)
        if not capacity:
            raise RayBatchError(f"no Ray replica started its engine: {summary.last_error}")
        if on_replicas is not None:
            on_replicas(actors)
        pending = collections.deque(todo)
        assigned: dict[int, dict[int, Todo]] = {r: {} for r in capacity}
        calls: dict[ray.ObjectRef, int] = {}  # each live replica's one call in flight

        def feed(r: int) -> None:
            room = capacity[r] - len(assigned[r])
            items = [pending.popleft() for _ in range(min(room, len(pending)))]
            assigned[r].update((item[0], item) for item in items)
            if assigned[r]:
                calls[actors[r].run.remote(items, POLL_SECONDS)] = r

        for r in assigned:
            feed(r)
        while calls:
            [ref], _ = ray.wait(list(calls), num_returns=1)
            r = calls.pop(ref)
            try:
                finished = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                # The replica died, or its engine raised (its state is unknown: it is let go).
                # Its lines, none written yet, go back to the front of the queue for the others.
                ray.kill(actors[r])
                lost = sorted(assigned.pop(r).values(), key=lambda item: item[0])
                pending.extendleft(reversed(lost))
                summary.retried += len(lost)
                _lost(summary, r, e)
                if not assigned:
                    raise RayBatchError(f"every Ray replica died; {len(pending)} line(s) left "
                                        "unrun (the output keeps the finished ones: rerun to "
                                        f"resume); the last: {summary.last_error}") from None
                for idle in [s for s in assigned if s not in calls.values()]:
                    feed(idle)
                continue
            for i, result in finished:
                del assigned[r][i]
                writer.emit(i, result)
            feed(r)
    finally:
        for actor in actors:
            ray.kill(actor)


# ----------------------------------------------------------------------------- Ray Data
def _sampling(value: SamplingParams | dict | None) -> SamplingParams:
    params = value if isinstance(value, SamplingParams) else SamplingParams(**(value or {}))
    if params.n != 1:
        raise ValueError(f"the processor writes one text per row; got sampling n={params.n}")
    return params


_INT_FIELDS = {f.name for f in dataclasses.fields(SamplingParams) if str(f.type).startswith("int")}


def _plain(key: str, value: Any) -> Any:
    """A value of a row's sampling_params as SamplingParams takes it: Arrow gives every row every
    key of the column's struct (None or NaN where a row has none) and numpy types, and a column
    with gaps holds its integers as floats."""
    if isinstance(value, (np.generic, np.ndarray)):
        value = value.tolist()
    if isinstance(value, float) and math.isnan(value):
        return None
    if key in _INT_FIELDS and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


class JaxserveProcessor:
    """A Ray Data callable class, one engine per actor of the pool:
    `ds.map_batches(JaxserveProcessor, fn_constructor_kwargs={"model": ..., "sampling": {...},
    **engine_options}, compute=ray.data.ActorPoolStrategy(size=N), batch_size=...)`. A batch is
    one LLM.generate call."""

    def __init__(self, model: str, sampling: SamplingParams | dict | None = None,
                 **engine_options: Any):
        from jaxserve.llm import LLM

        self.sampling = _sampling(sampling)
        self.llm = LLM(model=model, **engine_options)

    def _prompt(self, batch: dict, k: int) -> str | dict:
        messages = batch["messages"][k] if "messages" in batch else None
        if messages is not None and len(messages):  # Arrow hands back an array of row dicts
            tokenizer = self.llm.get_tokenizer()
            # validated and rendered as LLM.chat and the server do (content parts, None)
            text = Conversation.validated(messages=[dict(m) for m in messages]).render(tokenizer)
            # the rendered template's markup is special tokens: encoded as written, as LLM.chat
            return {"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False),
                    "prompt": text}
        prompt = batch["prompt"][k] if "prompt" in batch else None
        if prompt is None:
            raise ValueError(f"a row has neither 'prompt' nor 'messages'; columns: {sorted(batch)}")
        return str(prompt)

    def _params(self, batch: dict, k: int) -> SamplingParams:
        row = batch["sampling_params"][k] if "sampling_params" in batch else None
        if not row:
            return self.sampling
        given = {key: _plain(key, value) for key, value in dict(row).items()}
        given = {key: value for key, value in given.items() if value is not None}
        return _sampling({**dataclasses.asdict(self.sampling), **given})

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        n = len(next(iter(batch.values()), []))
        outs = self.llm.generate([self._prompt(batch, k) for k in range(n)],
                                 [self._params(batch, k) for k in range(n)], use_tqdm=False)
        completions = [o.outputs[0] for o in outs]
        return {**batch,
                "generated_text": np.array([c.text for c in completions], dtype=object),
                "num_generated_tokens": np.array([len(c.token_ids) for c in completions]),
                "finish_reason": np.array([c.finish_reason for c in completions], dtype=object)}


def build_processor(model: str, sampling: SamplingParams | dict | None = None, *,
                    concurrency: int = 1, batch_size: int = 64,
                    ray_remote_args: dict[str, Any] | None = None,
                    **engine_options: Any) -> Callable[[Any], Any]:
    """`processor = build_processor(model=..., sampling={...}, concurrency=2, **engine_options)`,
    then `processor(ds)`: the dataset with each row's generation, over `concurrency` engines,
    each with its own devices (GPUs or TPU chips where the cluster has them);
    ray_remote_args override the resources asked per engine."""
    _sampling(sampling)  # a bad sampling dict fails here, not in every actor

    def process(ds):
        # ray.data started (or joined) Ray when the dataset was made: the cluster is known now
        import ray.data

        # one CPU stays free for the dataset's own tasks (reading, splitting blocks)
        remote_args = ray_remote_args if ray_remote_args is not None else actor_resources(
            engine_options, concurrency, spare_cpus=1)
        return ds.map_batches(JaxserveProcessor, fn_constructor_kwargs={
            "model": model, "sampling": sampling, **engine_options},
            compute=ray.data.ActorPoolStrategy(size=concurrency), batch_size=batch_size,
            **remote_args)

    return process
