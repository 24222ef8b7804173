"""How many drafts to verify per sequence next step: speculation pays while the step that verifies
k drafts per sequence costs less, per token it yields, than a plain decode step. Both sides are
measured at run time on this device: step wall times per token bucket (the padded shape fixes
a step's work), and the scheduler's per-position draft and acceptance counts.

With S decoding sequences, q_i the accepted drafts at position i per decode and r_i the drafts
proposed there per decode, k drafts yield S (1 + q_0 + ... + q_{k-1}) tokens from a step of
S (1 + r_0 + ... + r_{k-1}) tokens; the k with the most tokens per second wins, 0 (plain decoding,
which keeps async scheduling's overlap) included. A bucket not yet timed is assumed to cost what
the nearest smaller timed bucket costs: optimism that tries it once and so measures it. The
acceptance counts start from a prior (PRIOR_DECODES decodes that drafted every position and
had half accepted), so a few early decodes without a proposal do not end speculation; once
plain decoding wins, speculation is tried again after 16 decisions, then 32, 64, ... (at most
MAX_PROBE_INTERVAL): where it still loses, the probes cost ever less.
"""

from __future__ import annotations

import bisect

PRIOR_DECODES = 4
MAX_PROBE_INTERVAL = 1024


class SpeculationControl:
    def __init__(self, max_k: int, token_buckets: tuple[int, ...], decay: float = 0.9):
        self.max_k = max_k
        self.buckets = token_buckets
        self.decay = decay
        self.seconds: dict[int, float] = {}  # token bucket -> moving average step wall time
        self._plain_streak, self._probe_interval = 0, 16

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step of num_tokens tokens took `seconds` from planning to its tokens applied."""
        if num_tokens <= 0:
            return
        b = self._bucket(num_tokens)
        old = self.seconds.get(b)
        self.seconds[b] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

    def cost(self, num_tokens: float) -> float | None:
        """Estimated seconds of a step of num_tokens tokens; None before any step was timed."""
        if not self.seconds:
            return None
        b = self._bucket(num_tokens)
        if b in self.seconds:
            return self.seconds[b]
        timed = sorted(self.seconds)
        i = bisect.bisect_left(timed, b)
        return self.seconds[timed[max(i - 1, 0)]]

    def choose(self, num_decoding: int, opportunities: int, drafted_at: list[int],
               accepted_at: list[int]) -> int:
        """Drafts per sequence for a step where num_decoding sequences decode, from the
        scheduler's counts: decodes that could have speculated, drafts and acceptances per
        position."""
        if num_decoding == 0 or self.cost(num_decoding) is None:
            return self.max_k  # nothing to weigh yet: speculate, and so measure
        decodes = opportunities + PRIOR_DECODES
        best_k, best_rate = 0, num_decoding / self.cost(num_decoding)
        made = computed = 1.0  # tokens per decoding sequence, with k drafts
        for k in range(1, self.max_k + 1):
            made += (accepted_at[k - 1] + PRIOR_DECODES / 2) / decodes
            computed += (drafted_at[k - 1] + PRIOR_DECODES) / decodes
            rate = num_decoding * made / self.cost(num_decoding * computed)
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k:
            self._plain_streak, self._probe_interval = 0, 16
            return best_k
        self._plain_streak += 1
        if self._plain_streak < self._probe_interval:
            return 0
        self._plain_streak = 0
        self._probe_interval = min(2 * self._probe_interval, MAX_PROBE_INTERVAL)
        return self.max_k  # a probe: fresh acceptance counts and step times

    def _bucket(self, num_tokens: float) -> int:
        i = bisect.bisect_left(self.buckets, num_tokens)
        return self.buckets[min(i, len(self.buckets) - 1)]
