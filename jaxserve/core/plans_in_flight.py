"""PlansInFlight: the plans that went out (Scheduler.schedule or schedule_next returned them) and
are not yet applied (Scheduler.update). It numbers them (StepPlan.step), holds the sequences with
a chunk in one (not scheduled again until it is applied; a chunk that forks holds its forks too),
and tells the KV manager which frees wait for them: pages freed while a plan that may still write
them is on the device are not reused before it is applied. Host-only, no JAX."""

from __future__ import annotations

from collections import Counter

from jaxserve.core.kv_manager import KVManager
from jaxserve.core.sequence import Sequence
from jaxserve.core.step_plan import StepPlan


class PlansInFlight:
    def __init__(self, kv: KVManager):
        self.kv = kv
        self._last_step = 0
        self._steps: set[int] = set()
        self._held: Counter[int] = Counter()  # seq id -> its chunks in plans not yet applied

    def holds(self, seq: Sequence) -> bool:
        return self._held[seq.seq_id] > 0

    def hold(self, seq: Sequence) -> None:
        """seq has a chunk (or a sample row) in the plan being made."""
        self._held[seq.seq_id] += 1

    def launched(self, plan: StepPlan) -> None:
        """A non-empty plan goes out: numbered, outstanding until applied."""
        self._last_step += 1
        plan.step = self._last_step
        self._steps.add(plan.step)
        self.kv.step_launched(plan.step)

    def is_out(self, plan: StepPlan) -> bool:
        return plan.step in self._steps

    def applying(self, plan: StepPlan) -> None:
        """update(plan) begins: plan's sequences may be scheduled again."""
        self._steps.discard(plan.step)
        for chunk in plan.chunks:
            for seq_id in {chunk.seq.seq_id, *(s.seq_id for s in chunk.sample_seqs)}:
                self._held[seq_id] -= 1
                if self._held[seq_id] <= 0:
                    del self._held[seq_id]

    def applied(self) -> None:
        """update() is done: frees made before the oldest plan still out may be reused."""
        self.kv.steps_applied(list(self._steps))
