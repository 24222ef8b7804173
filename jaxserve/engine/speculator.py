"""Speculator: the engine's side of speculative decoding. How many drafts the next step takes
(fixed, or chosen from measured step costs by SpeculationControl), the draft model of method
"draft" (loaded, checked against the target, run by a DraftRunner), and what speculation adds to
the engine's warm-up, compile count and stats. The scheduler reserves the drafts (core/); this
only decides how many and, for a draft model, fills them in."""

from __future__ import annotations

from jax.sharding import Mesh

from jaxserve.backends import Backend
from jaxserve.config import EngineConfig
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.step_plan import StepPlan
from jaxserve.engine.in_flight import Launched
from jaxserve.engine.speculation_control import SpeculationControl
from jaxserve.runtime.buckets import Buckets
from jaxserve.runtime.draft import DraftRunner, check_draft_window, check_shared_vocabulary
from jaxserve.weights import LoadedModel, load_model


def load_draft(config: EngineConfig, loaded: LoadedModel,
               draft: LoadedModel | None) -> LoadedModel | None:
    """Method "draft"'s model (given, the speculative config's, or the target's own weights),
    checked to share the target's tokenizer and to read no page the target's window releases;
    None for any other method."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft":
        return None
    if draft is None:
        own = spec.model is None or spec.model == config.model
        draft = loaded if own else load_model(spec.model, dtype=config.dtype, lazy=True)
    check_shared_vocabulary(loaded.config, loaded.tokenizer, draft.config, draft.tokenizer)
    check_draft_window(loaded.config, draft.config)
    return draft


class Speculator:
    def __init__(self, config: EngineConfig, scheduler: Scheduler, buckets: Buckets,
                 draft: LoadedModel | None, *, num_pages: int, backend: Backend, mesh: Mesh):
        """mesh: the target's replica devices; a draft model runs whole on the first (it is
        small: sharding it would add two all-reduces a layer to each of its k steps)."""
        spec = config.speculative_config
        self.scheduler = scheduler
        self.control = (SpeculationControl(spec.num_speculative_tokens, buckets.tokens)
                        if spec and spec.adaptive else None)
        self.drafter = None
        if draft is not None:
            self.drafter = DraftRunner(
                draft.config, draft.params, scheduler.proposer.draft_kv, buckets=buckets,
                page_size=config.page_size, num_pages=num_pages,
                max_tokens=config.max_num_batched_tokens, max_k=spec.num_speculative_tokens,
                dtype=config.dtype, kv_cache_dtype=config.kv_cache_dtype, backend=backend,
                quantization=spec.quantization, huge_pages=config.huge_pages,
                mesh=Mesh(mesh.devices[:, :1], mesh.axis_names))
        self._last_step_end: float | None = None

    def choose(self) -> int:
        """The drafts per sequence for the next step planned, from the measured cost model
        (SpeculationControl), in steps that only decode (prompt work, of waiting or still
        prefilling sequences, takes the budget first); 0 (and nothing without speculation)
        lets async scheduling plan that step ahead."""
        s = self.scheduler
        if self.control is None:
            return s.spec_k  # off, or fixed (not adaptive)
        decoding = sum(seq.num_computed_tokens >= seq.num_prompt_tokens for seq in s.running)
        if s.waiting or decoding < len(s.running):
            s.spec_k = 0
        else:
            s.spec_k = self.control.choose(decoding, s.spec_opportunities, s.spec_drafted_at,
                                           s.spec_accepted_at)
        return s.spec_k

    def propose(self, plan: StepPlan) -> float:
        """The draft model's tokens in place of the drafts the scheduler reserved; returns the
        seconds its catch-up over new prompts took (its prefill, not the step's cost)."""
        if self.drafter is None:
            return 0.0
        for chunk, drafts in self.drafter.propose(plan):
            chunk.draft_token_ids = drafts
        return self.drafter.catch_up_seconds

    def observe(self, launched: Launched, started: float, ended: float) -> None:
        """A step's cost for the cost model: the interval between steps that follow each other
        (with async scheduling the device ran this one while the host finished the last), less
        the draft model's catch-up. A step that chose drafts but found none is timed as a
        verification: it too was planned after the last step's read-back, without the overlap
        plain decoding keeps."""
        if self.control is None:
            return
        back_to_back = self._last_step_end is not None and started - self._last_step_end < 1e-3
        seconds = ended - (self._last_step_end if back_to_back else started)
        self.control.observe(launched.plan.num_tokens, seconds - launched.catch_up_seconds,
                             verifying=launched.verifying)
        self._last_step_end = ended

    def reset(self) -> None:
        """After a failed step: the draft pool went with it."""
        if self.drafter is not None:
            self.drafter.reset()

    def attach(self, scheduler: Scheduler) -> None:
        """Serve `scheduler` in place of the one built with (a memory plan's probe pool)."""
        self.scheduler = scheduler
        if self.drafter is not None:
            self.drafter.draft_kv = scheduler.proposer.draft_kv

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
        if self.control is not None:  # the cost model: seconds per token bucket timed
            stats["spec_step_seconds"] = {
                kind: dict(sorted(self.control.seconds[verifying].items()))
                for kind, verifying in (("plain", False), ("verifying", True))}
        return stats
