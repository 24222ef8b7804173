"""How many drafts to verify per sequence next step: speculation pays while the step that verifies
k drafts per sequence costs less, per token it yields, than a plain decode step. Both sides are
measured at run time on this device: step wall times against the step's tokens, separately for
verifications (planned after the previous step's tokens were read back; a step that chose drafts
but found none counts too, since it also gave up the overlap) and plain steps (a decode
overlapped with the host's work by async scheduling), and Speculation's per-position draft
and acceptance counts.

With S decoding sequences, q_i the accepted drafts at position i per decode and r_i the drafts
proposed there per decode, k drafts yield S (1 + q_0 + ... + q_{k-1}) tokens from a step of
S (1 + r_0 + ... + r_{k-1}) tokens; the k with the most tokens per second wins, 0 (plain decoding)
included. A step's cost is interpolated linearly between the token buckets timed (a step lands
in a bucket by its tokens, which vary around the expectation, so tokens within a bucket are not
free), extrapolated past the largest along the slope of the last two, and held flat below the
smallest or past a lone one: optimism that tries such a step once, and so measures it, except
that an untimed verification costs at least a plain step of as many tokens. Plain decoding at
a batch's size is timed before speculation is weighed against it. The
first step timed in each bucket of each kind is not counted: a shape's first run pays one-time
costs (its sampling call's compile, first-touch allocations) that would otherwise mark
verification as many times dearer than it is, and the probes that could correct it verify at
other sizes. Later times count at most twice the bucket's average (a shape's sampling compiled
late, a stall), so that one outlier moves it by a tenth at most; a lasting change still moves
it within a few steps.
The acceptance counts are Speculation's (core/speculation.py, this model's owner), decayed
with a half-life of HALF_LIFE_DECODES decodes
(the traffic's mix changes: a run of copying requests must not keep a batch of chat speculating),
and start from a prior (PRIOR_DECODES decodes that drafted every position and had half
accepted), so a few early decodes without a proposal do not end speculation; once
plain decoding wins, one draft per sequence is tried again after FIRST_PROBE_INTERVAL (16)
decisions, then twice as many each time (at most MAX_PROBE_INTERVAL): where it still loses,
the probes cost ever less.
"""

from __future__ import annotations

import bisect

PRIOR_DECODES = 4
HALF_LIFE_DECODES = 256
FIRST_PROBE_INTERVAL = 16
MAX_PROBE_INTERVAL = 1024
# Speculation must promise this many times plain decoding's tokens per second: both rates are
# estimates from noisy times, and near a tie plain decoding keeps async scheduling's overlap.
REQUIRED_GAIN = 1.05


class SpeculationControl:
    def __init__(self, max_k: int, token_buckets: tuple[int, ...], decay: float = 0.9):
        self.max_k = max_k
        self.buckets = token_buckets
        self.decay = decay
        # (verifying?) -> token bucket -> moving average of step wall times
        self.seconds: dict[bool, dict[int, float]] = {False: {}, True: {}}
        self._first_seen: set[tuple[bool, int]] = set()  # (kind, bucket) run once, not counted
        self._plain_streak, self._probe_interval = 0, FIRST_PROBE_INTERVAL
        # Decayed acceptance counts, and Speculation's totals they have taken in.
        self.decodes, self.drafted, self.accepted = 0.0, [0.0] * max_k, [0.0] * max_k
        self._totals = (0, [0] * max_k, [0] * max_k)

    def observe(self, num_tokens: int, seconds: float, verifying: bool) -> None:
        """A step of num_tokens tokens (`verifying`: planned to verify drafts) took `seconds`
        from the previous step's end to its tokens applied."""
        if num_tokens <= 0:
            return
        table = self.seconds[verifying]
        b = self._bucket(num_tokens)
        if (verifying, b) not in self._first_seen:
            self._first_seen.add((verifying, b))
            return
        old = table.get(b)
        if old is not None:  # an outlier (a compile, a stall) moves the average by 10% at most
            seconds = min(seconds, 2 * old)
        table[b] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

    def cost(self, num_tokens: float, verifying: bool) -> float | None:
        """Estimated seconds of a step of num_tokens tokens; None before any step was timed.
        A verification is the forward pass of a plain step of as many tokens (a batch's
        decodes, a prefill chunk) and more (a draft model's steps), so where its own bucket is
        not timed yet it costs at least the plain estimate times the verification's price over
        a plain step's at the nearest size timed: an extrapolation from small, memory-bound
        verifications would promise a large batch's compute-bound ones at almost no cost."""
        own = _estimate(self.seconds[verifying], num_tokens)
        other = _estimate(self.seconds[not verifying], num_tokens)
        if own is None or other is None:
            return own if other is None else other
        timed = self.seconds[True]
        if verifying and self._bucket(num_tokens) not in timed:
            near = min(timed, key=lambda b: abs(b - num_tokens))
            dearer = max(1.0, timed[near] / _estimate(self.seconds[False], near))
            return max(own, other * dearer)
        return own

    def choose(self, num_decoding: int, opportunities: int, drafted_at: list[int],
               accepted_at: list[int]) -> int:
        """Drafts per sequence for a step where num_decoding sequences decode, from the
        running totals of Speculation: decodes that could have speculated, drafts and
        acceptances per position."""
        self._take_in(opportunities, drafted_at, accepted_at)
        if num_decoding == 0 or self._bucket(num_decoding) not in self.seconds[False]:
            # Plain decoding not timed at this size yet: the safe choice, and so measured (a
            # prefill chunk's time, held flat down to it, would price a decode far too high).
            return 0
        decodes = self.decodes + PRIOR_DECODES
        best_k, best_rate = 0, num_decoding / self.cost(num_decoding, False)
        made = computed = 1.0  # tokens per decoding sequence, with k drafts
        for k in range(1, self.max_k + 1):
            made += (self.accepted[k - 1] + PRIOR_DECODES / 2) / decodes
            computed += (self.drafted[k - 1] + PRIOR_DECODES) / decodes
            rate = num_decoding * made / self.cost(num_decoding * computed, True)
            if rate > best_rate * (REQUIRED_GAIN if best_k == 0 else 1.0):
                best_k, best_rate = k, rate
        if best_k:
            self._plain_streak, self._probe_interval = 0, FIRST_PROBE_INTERVAL
            return best_k
        self._plain_streak += 1
        if self._plain_streak < self._probe_interval:
            return 0
        self._plain_streak = 0
        self._probe_interval = min(2 * self._probe_interval, MAX_PROBE_INTERVAL)
        return 1  # a probe, at the cheapest: fresh acceptance counts and step times

    def _take_in(self, opportunities: int, drafted_at: list[int], accepted_at: list[int]) -> None:
        """Speculation's counts since the last call, added to the decayed ones after
        decaying those by the decodes counted since."""
        seen, seen_drafted, seen_accepted = self._totals
        new = opportunities - seen
        keep = 0.5 ** (max(new, 0) / HALF_LIFE_DECODES)
        self.decodes = keep * self.decodes + new
        self.drafted = [keep * d + n - s for d, n, s in zip(self.drafted, drafted_at, seen_drafted)]
        self.accepted = [keep * a + n - s
                         for a, n, s in zip(self.accepted, accepted_at, seen_accepted)]
        self._totals = (opportunities, list(drafted_at), list(accepted_at))

    def _bucket(self, num_tokens: float) -> int:
        i = bisect.bisect_left(self.buckets, num_tokens)
        return self.buckets[min(i, len(self.buckets) - 1)]


def _estimate(table: dict[int, float], num_tokens: float) -> float | None:
    """Seconds at num_tokens from a table's timed buckets: interpolated between them,
    extrapolated past the largest along the slope of the last two, flat below the smallest
    or past a lone one."""
    if not table:
        return None
    sizes = sorted(table)
    i = bisect.bisect_left(sizes, num_tokens)
    if i == 0:
        return table[sizes[0]]
    if i == len(sizes):
        if len(sizes) == 1:
            return table[sizes[0]]
        lo, hi = sizes[-2], sizes[-1]
        return table[hi] + max(0.0, table[hi] - table[lo]) * (num_tokens - hi) / (hi - lo)
    lo, hi = sizes[i - 1], sizes[i]
    return table[lo] + (table[hi] - table[lo]) * (num_tokens - lo) / (hi - lo)
