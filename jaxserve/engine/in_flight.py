"""The engine's record of a step on the device (StepPipeline._launch until _apply), and the error
of a step that could not run."""

from __future__ import annotations

import dataclasses

from jaxserve.core.step_plan import StepPlan
from jaxserve.runtime.batch import StepBatch


class StepFailed(RuntimeError):
    """A step could not run: the jitted step or its read-back raised (the KV pool donated to it
    is gone), or its batch could not be built through no single request's fault."""


@dataclasses.dataclass
class Launched:
    """A step on the device: its plan, output arrays, real sample rows and chunk offsets; and
    while its sampling waits for its logit controls (`StepPipeline._launch`), its batch."""

    plan: StepPlan
    out: dict
    num_rows: int
    offsets: list[int]
    catch_up_seconds: float = 0.0  # the draft model's prefill of new prompts before it
    unsampled: StepBatch | None = None
    verifying: bool = False  # planned to verify drafts (k > 0), whether or not any were found
