"""Speculator: the engine's side of speculative decoding, around its one owner on the host
(core/speculation.py's Speculation: k, counters, proposals, verdicts, draft KV record, cost
model), which the scheduler asks for drafts. This side asks Speculation for k before each plan,
times each step for its cost model, and for method "draft" runs the draft model on the device
(loaded and checked against the target here, run by runtime/draft.py's DraftRunner): it returns
the plan with the draft model's tokens for the drafts the scheduler counted. It also adds
speculation's part to the engine's warm-up, compile count and stats."""

from __future__ import annotations

from jax.sharding import Mesh

from jaxserve.backends import Backend
from jaxserve.config import EngineConfig, ResolvedConfig
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.speculation import Speculation
from jaxserve.core.step_plan import StepPlan
from jaxserve.engine.in_flight import Launched
from jaxserve.runtime.buckets import Buckets
from jaxserve.runtime.draft import DraftRunner, check_draft_window, check_shared_vocabulary
from jaxserve.weights import LoadedModel, load_model


def load_draft(config: EngineConfig, loaded: LoadedModel, draft: LoadedModel | None, *,
               dtype: str) -> LoadedModel | None:
    """Method "draft"'s model (given, the speculative config's, or the target's own weights, in
    the resolved dtype), checked to share the target's tokenizer and to read no page the
    target's window releases; None for any other method."""
    spec = config.speculative
    if spec is None or spec.method != "draft":
        return None
    if draft is None:
        own = spec.model is None or spec.model == config.load.model
        draft = loaded if own else load_model(spec.model, dtype=dtype, lazy=True)
    check_shared_vocabulary(loaded.config, loaded.tokenizer, draft.config, draft.tokenizer)
    check_draft_window(loaded.config, draft.config)
    return draft


class Speculator:
    def __init__(self, config: EngineConfig, resolved: ResolvedConfig, buckets: Buckets,
                 draft: LoadedModel | None, *, num_pages: int, backend: Backend, mesh: Mesh):
        """mesh: the target's replica devices; a draft model runs whole on the first (it is
        small: sharding it would add two all-reduces a layer to each of its k steps)."""
        spec, page_size = config.speculative, config.cache.page_size
        # The scheduler takes this one (Scheduler(speculation=...)): one owner for both.
        self.speculation = Speculation(spec, max_model_len=resolved.max_model_len,
                                       page_size=page_size, token_buckets=buckets.tokens)
        self.drafter = None
        if draft is not None:
            self.drafter = DraftRunner(
                draft.config, draft.params, buckets=buckets,
                page_size=page_size, num_pages=num_pages,
                max_tokens=config.scheduler.max_num_batched_tokens,
                max_k=spec.num_speculative_tokens, dtype=resolved.dtype,
                kv_cache_dtype=resolved.kv_cache_dtype, backend=backend,
                quantization=spec.quantization, huge_pages=config.load.huge_pages,
                mesh=Mesh(mesh.devices[:, :1], mesh.axis_names))
        self._last_step_end: float | None = None

    def choose(self, scheduler: Scheduler) -> int:
        """The drafts per sequence for the next step `scheduler` plans (Speculation.choose,
        from its queues); 0 (and always without speculation) lets async scheduling plan that
        step ahead."""
        return self.speculation.choose(scheduler.running, bool(scheduler.waiting))

    @property
    def verifying(self) -> bool:
        """Whether the step planned now verifies drafts (k > 0), whether or not any are found."""
        return self.speculation.k > 0

    def propose(self, plan: StepPlan) -> tuple[StepPlan, float]:
        """The plan with the draft model's tokens for the drafts the scheduler counted (the
        plan itself without a draft model), and the seconds the draft's catch-up over new
        prompts took (its prefill, not the step's cost)."""
        if self.drafter is None:
            return plan, 0.0
        record = self.speculation.draft_kv
        record.prune()
        rows = [(c, record.computed(c.seq)) for c in plan.chunks
                if c.num_drafts and not c.seq.is_finished]
        proposed = self.drafter.propose(rows)
        for chunk, drafts in proposed:
            record.wrote(chunk.seq, chunk.start, drafts)
        return (plan.with_drafts(proposed) if proposed else plan), self.drafter.catch_up_seconds

    def observe(self, launched: Launched, started: float, ended: float) -> None:
        """A step's cost for the cost model: the interval between steps that follow each other
        (with async scheduling the device ran this one while the host finished the last), less
        the draft model's catch-up. A step that chose drafts but found none is timed as a
        verification: it too was planned after the last step's read-back, without the overlap
        plain decoding keeps."""
        if self.speculation.control is None:
            return
        back_to_back = self._last_step_end is not None and started - self._last_step_end < 1e-3
        seconds = ended - (self._last_step_end if back_to_back else started)
        self.speculation.observe(launched.plan.num_tokens, seconds - launched.catch_up_seconds,
                                 verifying=launched.verifying)
        self._last_step_end = ended

    def reset(self) -> None:
        """After a failed step: the draft pool went with it, and the record of what it held."""
        if self.drafter is not None:
            self.speculation.draft_kv.clear()
            self.drafter.reset()

    def warmup(self) -> int:
        return self.drafter.warmup() if self.drafter is not None else 0

    def warmup_count(self) -> int:
        """At most how many shapes `warmup` compiles: the catch-up and the proposal of each
        step shape."""
        if self.drafter is None:
            return 0
        return 2 * len(self.drafter.buckets.step_shapes(self.drafter.page_size))

    @property
    def compilations(self) -> int:
        return self.drafter.compilations if self.drafter is not None else 0

    def stats(self) -> dict:
        stats = {}
        if self.drafter is not None:  # beside the target's pool and weights
            drafted = self.drafter.model.memory_stats()
            stats.update(draft_kv_pool_bytes=drafted["kv_pool_bytes"],
                         draft_weight_bytes=drafted["weight_bytes"])
        control = self.speculation.control
        if control is not None:  # the cost model: seconds per token bucket timed
            stats["spec_step_seconds"] = {
                kind: dict(sorted(control.seconds[verifying].items()))
                for kind, verifying in (("plain", False), ("verifying", True))}
        return stats
