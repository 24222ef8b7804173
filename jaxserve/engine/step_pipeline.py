"""The step pipeline: one engine step is plan -> build -> dispatch -> (sample) -> fetch -> apply.

With async scheduling the next step is planned and dispatched before this one's tokens are read
back (Scheduler.schedule_next: when nothing waits and every running sequence decodes), so the
host's planning, batch building and dispatch overlap the device. The pipeline owns that state
(the step in flight, the plans not yet applied), recovery from a failed device step, and the
step timers. A request whose own row cannot be built or processed fails alone (RequestTable.fail).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

from jaxserve.core.output_processor import OutputProcessor
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.step_plan import StepPlan
from jaxserve.core.structured_output import GrammarLimits, grammar_error
from jaxserve.engine.in_flight import Launched, StepFailed
from jaxserve.engine.pooling import Pooler
from jaxserve.engine.requests import RequestTable
from jaxserve.engine.speculator import Speculator
from jaxserve.runtime.batch import StepBatch, build_batch, page_copies
from jaxserve.runtime.buckets import Buckets
from jaxserve.runtime.distributed import PeerLostError
from jaxserve.runtime.logit_controls import LogitControls, step_controls
from jaxserve.runtime.runner import ModelRunner

log = logging.getLogger("jaxserve.engine")


@dataclasses.dataclass
class Built:
    """A plan as the device takes it: the padded batch, its real sample rows, each chunk's first
    flat token, and its logit controls, unless they wait for the tokens of the step before."""

    batch: StepBatch
    num_rows: int
    offsets: list[int]
    controls: LogitControls | None
    deferred: bool = False  # controls built later (`StepPipeline._sample`)


class StepPipeline:
    def __init__(self, buckets: Buckets, scheduler: Scheduler, runner: ModelRunner,
                 speculator: Speculator, outputs: OutputProcessor, requests: RequestTable, *,
                 vocab_size: int, page_size: int, async_scheduling: bool,
                 grammar_limits: Callable[[], GrammarLimits | None], adapters=None,
                 pooler: Pooler | None = None):
        """adapters: the engine's LoRA adapters (engine/lora.py), placed in their device slots
        before the step that first needs them; None: no adapters. pooler: a pooling engine's,
        which reads each step's pooled rows."""
        self.buckets, self.vocab_size, self.page_size = buckets, vocab_size, page_size
        self.async_scheduling = async_scheduling
        self.scheduler, self.runner, self.speculator = scheduler, runner, speculator
        self.outputs, self.requests, self.grammar_limits = outputs, requests, grammar_limits
        self.adapters = adapters
        self.pooler = pooler  # a pooling engine's: reads each step's pooled rows
        self._in_flight: Launched | None = None  # the step on the device, not yet fetched
        self._unapplied: list[StepPlan] = []  # plans launched and not yet applied
        self.num_steps = 0
        # Wall time of step() split into host work (schedule, build, dispatch, outputs) and
        # waiting for the device; host_overlapped_seconds is the host work done while a step ran.
        self.host_seconds = self.host_overlapped_seconds = self.device_seconds = 0.0

    def step(self) -> list[RequestOutput]:
        """One iteration; a snapshot of every request that progressed or failed. A failed
        device step fails the requests whose KV it held, and the pipeline goes on with a fresh
        pool (`recover`)."""
        try:
            results = self._step()
        except StepFailed as e:
            self.recover(e)
            results = []
        return self._stamped(results) + self.take_failed()

    def take_failed(self) -> list[RequestOutput]:
        """The outputs of the requests failed since the last step."""
        return self._stamped(self.requests.take_failed(time.monotonic()))

    def _stamped(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for out in outputs:  # no request spans an update (WeightUpdates settles them first)
            out.weights_version = self.runner.weights_version
            if self.pooler is not None and out.finished:
                out.pooled = self.pooler.take(out.request_id)
        return outputs

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        if self._in_flight is None:
            self.speculator.choose(self.scheduler)
            plan = self.scheduler.schedule()
            if plan.is_empty:  # still reported: requests schedule() finished (outgrew the pool)
                return self.requests.snapshots(self.scheduler.update(plan, []), time.monotonic())
            self._in_flight = self._launch(plan)
        t_launched = time.perf_counter()
        current, self._in_flight = self._in_flight, None
        if self.async_scheduling and not self.speculator.choose(self.scheduler):
            plan = self.scheduler.schedule_next(current.plan)
            if plan is not None:
                self._in_flight = self._launch(plan, after=current.out)
        t1 = time.perf_counter()
        out = self._fetch(current)
        t2 = time.perf_counter()
        results = self._apply(current, out)
        if self._in_flight is not None and self._in_flight.unsampled is not None:
            self._sample(self._in_flight)  # its controls follow from the tokens just applied
        ahead = self._in_flight is not None
        if ahead and not self.scheduler.has_unfinished():
            self.settle()  # everything it computes was finished meanwhile: drop it now
        t3 = time.perf_counter()
        self.speculator.observe(current, t0, t3)
        # Host work while a step ran on the device overlapped it: planning the next step while
        # `current` ran, and applying `current` while the next one runs.
        self.host_seconds += (t1 - t0) + (t3 - t2)
        self.host_overlapped_seconds += (t1 - t_launched) + ((t3 - t2) if ahead else 0.0)
        self.device_seconds += t2 - t1
        return results

    # ---- build and dispatch
    def _build(self, plan: StepPlan, ahead: bool = False) -> Built:
        """A plan made `ahead` of the previous step's tokens with a row whose controls depend on
        them (a grammar, penalties) has its controls built later."""
        batch, num_rows, offsets = build_batch(plan, self.buckets, self.page_size)
        if ahead and any(seq.sampling_params.needs_previous_token for _, seq in plan.sample_rows):
            return Built(batch, num_rows, offsets, None, deferred=True)
        return Built(batch, num_rows, offsets, self._controls(plan, batch))

    def _controls(self, plan: StepPlan, batch: StepBatch) -> LogitControls | None:
        return step_controls(plan, batch.logits_indices.shape[0], self.vocab_size)

    def _launch(self, plan: StepPlan, after=None) -> Launched:
        """Build and dispatch a plan. Planned ahead of the previous step's read-back with rows
        whose controls need that step's tokens, only its forward pass goes out now: its
        sampling follows once those tokens are applied (`_sample`), so the device computes the
        forward pass while the host reads the previous step and fills the masks. A draft
        model's tokens come first (Speculator.propose: the plan with them)."""
        try:
            plan, catch_up = self.speculator.propose(plan)
        except Exception as e:  # noqa: BLE001 - the draft pool was donated to the failed call
            self._unapplied.append(plan)
            raise StepFailed(f"the draft model's step failed: {e!r}") from e
        self._unapplied.append(plan)
        if self.adapters is not None:  # each chunk's LoRA slot; adapters new to a slot placed
            try:
                self.adapters.place(plan, self.scheduler.running, self.runner,
                                    self.scheduler.live)
            except Exception as e:  # noqa: BLE001
                raise StepFailed(f"placing a LoRA adapter failed: {e!r}") from e
        try:
            built = self._build(plan, ahead=after is not None)
        except Exception as e:  # noqa: BLE001 - a row's values: fail its request, keep the step
            self._fail_unbuildable(plan, e)
            built = self._build(plan, ahead=after is not None)
        copies = page_copies(plan.copies, self.buckets) if plan.copies else None
        try:
            out = self.runner.dispatch(built.batch, copies, after, built.controls,
                                       sample=not built.deferred)
        except PeerLostError:  # another process is gone: nothing to recover here
            raise
        except Exception as e:  # noqa: BLE001
            raise StepFailed(f"the device step failed: {e!r}") from e
        return Launched(plan, out, built.num_rows, built.offsets, catch_up,
                        unsampled=built.batch if built.deferred else None,
                        verifying=self.speculator.verifying)

    def _fail_unbuildable(self, plan: StepPlan, error: Exception) -> None:
        """build_batch raised: fail the requests whose chunks fail alone (their rows are then
        padding, build_batch skips finished sequences); StepFailed if none does."""
        culprits = []
        for chunk in plan.chunks:
            try:
                self._build(StepPlan(chunks=[chunk]))
            except Exception as e:  # noqa: BLE001
                culprits.append((chunk.seq.request.request_id, e))
        if not culprits:
            raise StepFailed(f"building the step's batch failed: {error!r}") from error
        for request_id, e in culprits:
            self.requests.fail(request_id, f"building its batch row failed: {e!r}")

    # ---- sample, fetch, apply
    def _sample(self, launched: Launched) -> None:
        """Launch the deferred sampling of a step with its controls, now that the tokens before
        it are applied; a request whose controls cannot be built fails alone."""
        batch, launched.unsampled = launched.unsampled, None
        try:
            controls = self._controls(launched.plan, batch)
        except Exception as e:  # noqa: BLE001
            self._fail_unbuildable(launched.plan, e)
            controls = self._controls(launched.plan, batch)
        try:
            self.runner.sample(launched.out, batch.sampling, controls)
        except PeerLostError:
            raise
        except Exception as e:  # noqa: BLE001
            raise StepFailed(f"the device step failed: {e!r}") from e

    def _fetch(self, launched: Launched):
        if launched.unsampled is not None:
            self._sample(launched)
        try:
            return self.runner.fetch(launched.out, launched.num_rows)
        except Exception as e:  # noqa: BLE001
            raise StepFailed(f"the device step failed: {e!r}") from e

    def _apply(self, launched: Launched, out) -> list[RequestOutput]:
        """The output processor reads the step's rows first (logprobs, text, stop strings), then
        the scheduler applies them with the stop strings found."""
        plan = launched.plan
        self._unapplied.remove(plan)
        errors = {}
        if self.pooler is not None:  # before update() advances the chunks' sequences
            self.pooler.record(plan, out.pooled)
        if out.prompt_logprobs is not None:
            errors = self.outputs.record_prompt_logprobs(plan, launched.offsets, out)
        now = time.monotonic()
        tokens = [int(t) for t in out.token_ids]
        stops, row_errors = self.outputs.process(self.scheduler.accepted_rows(plan, tokens), out,
                                                 now)
        for request_id, error in {**errors, **row_errors}.items():
            self.requests.fail(request_id, error)
        changed = self.scheduler.update(plan, tokens, stops)
        self.num_steps += 1
        results = self.requests.snapshots(changed, now)
        self._fail_broken_grammars(plan)
        return results

    def _fail_broken_grammars(self, plan: StepPlan) -> None:
        """A sequence whose matcher erred on the token just applied (a grammar limit hit
        mid-generation) fails its request alone, before a mask is filled from that state."""
        limits = self.grammar_limits()
        if limits is None:  # no grammar yet
            return
        for _, seq in plan.sample_rows:
            error = None if seq.is_finished else grammar_error(seq, limits)
            if error is not None:
                self.requests.fail(seq.request.request_id, error)

    # ---- settling and recovery
    def settle(self) -> None:
        """Read back and apply the step in flight, if any (its sequences are all finished or
        aborted, so its tokens are dropped): afterwards no plan is outstanding."""
        if self._in_flight is not None:
            launched, self._in_flight = self._in_flight, None
            self._apply(launched, self._fetch(launched))

    def drain(self) -> None:
        """settle, recovering if the step in flight failed (after the last request's abort)."""
        try:
            self.settle()
        except StepFailed as e:
            self.recover(e)

    def recover(self, failure: StepFailed) -> None:
        """After a failed step: every request whose KV was in the pool fails with the cause,
        plans in flight are applied with their tokens dropped, and the runner gets a fresh pool
        (the prefix cache is emptied with it: the pool donated to a failed step is gone)."""
        cause = str(failure)
        log.error("%s; failing the running requests and starting a fresh KV pool "
                  "(the prefix cache is emptied)", cause)
        self.requests.failed_with_the_pool(self.scheduler.drop_kv(cause))
        for plan in self._unapplied:
            self.scheduler.update(plan, [0] * len(plan.sample_rows))
        self._unapplied, self._in_flight = [], None
        self.runner.reset_pool()
        self.speculator.reset()

    def stats(self) -> dict:
        return dict(steps=self.num_steps, host_seconds=self.host_seconds,
                    device_seconds=self.device_seconds,
                    host_overlapped_seconds=self.host_overlapped_seconds)
