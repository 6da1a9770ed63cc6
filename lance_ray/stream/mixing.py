"""Which source each sample of a mixture comes from: a pure, seekable schedule.

The schedule is Tijdeman's solution of the *chairman assignment problem*: with normalised
weights ``p_i = w_i / W`` and ``c_i(k)`` the samples of source ``i`` among the first ``k``,
step ``k + 1`` goes, among the sources that are at least ``s = 1 / (2n - 2)`` behind their
share (``(k + 1) p_i - c_i(k) >= s``), to the one whose next sample is due first (smallest
``(c_i(k) + 1 - s) / p_i``), ties to the lowest index. Then, for every ``k`` and ``i``,
``|c_i(k) - k p_i| <= 1 - s < 1`` (R. Tijdeman, "The chairman assignment problem", 1980).
The plain largest-deficit rule does not keep that bound (it reaches 1.04 for some weights).

All arithmetic is on integers, so the rule is exact for any weights given as ints, floats
(taken as their shortest decimal form) or fractions. The choice depends only on the
deficits ``k p_i - c_i(k)``; after ``W`` steps (integer weights in lowest terms) every
deficit is 0 again, so the schedule repeats with period ``W``: a step's source is a table
lookup when ``W`` is small, and any step is reachable from the previous period boundary.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from fractions import Fraction
from functools import reduce

import numpy as np

# Periods up to this many steps are tabulated once (one int per step and per source count);
# longer ones are stepped through on demand.
TABLE_STEPS = 1 << 16


def integer_weights(weights: Sequence[object]) -> tuple[int, ...]:
    """``weights`` as positive integers in the same proportions, in lowest terms.

    Floats (numpy's too) count as their decimal form to 12 significant digits, so ``[0.7,
    0.2, 0.1]`` gives ``(7, 2, 1)`` and a computed ``0.1 + 0.2`` is ``3/10``, not a
    fraction with a 17-digit denominator, whose schedule would have to be walked step by
    step. Integers (numpy's too) and ``Fraction`` are exact. Raises ``ValueError`` naming
    the bad weight.
    """
    if not weights:
        raise ValueError("a mixture needs at least one source")
    fractions = []
    for i, w in enumerate(weights):
        if isinstance(w, bool | np.bool_) or not isinstance(w, numbers.Real):
            raise ValueError(f"source {i}: weight must be a positive number, got {w!r}")
        if isinstance(w, numbers.Rational):
            f = Fraction(int(w)) if isinstance(w, numbers.Integral) else Fraction(w)
        elif math.isfinite(w):
            # str: the shortest decimal at the number's own precision (a float32 0.3 is "0.3")
            f = Fraction(f"{float(str(w)):.12g}")
        else:
            raise ValueError(f"source {i}: weight must be a positive number, got {w!r}")
        if not math.isfinite(float(f)) or f <= 0:
            raise ValueError(f"source {i}: weight must be a positive number, got {w!r}")
        fractions.append(f)
    lcm = reduce(math.lcm, (f.denominator for f in fractions), 1)
    ints = [int(f * lcm) for f in fractions]
    g = reduce(math.gcd, ints)
    return tuple(x // g for x in ints)


class Schedule:
    """The source of every step of one mixture phase, for integer ``weights``.

    Steps count from 0 (the first sample of the phase). :meth:`sources` gives the sources
    of a range of steps, :meth:`counts` the samples of each source among the first ``k``
    steps; both take any ``k`` (seekable: resuming at step ``k`` needs nothing else).
    """

    def __init__(self, weights: Sequence[int]) -> None:
        self.weights = integer_weights(list(weights))
        self.period = sum(self.weights)
        self.n = len(self.weights)
        self._table: np.ndarray | None = None
        self._prefix: np.ndarray | None = None
        self._memo: tuple[int, list[int]] = (0, [0] * self.n)  # long periods: last step seen
        if self.period <= TABLE_STEPS:
            seq = self._walk([0] * self.n, 0, self.period)
            self._table = np.asarray(seq, dtype=np.int64)
            prefix = np.zeros((self.period + 1, self.n), dtype=np.int64)
            prefix[1:] = np.cumsum(np.eye(self.n, dtype=np.int64)[self._table], axis=0)
            self._prefix = prefix

    def _choose(self, counts: Sequence[int], k: int) -> int:
        """The source of step ``k`` (0-based) after ``counts``: Tijdeman's rule."""
        w, big_w, n = self.weights, self.period, self.n
        if n == 1:
            return 0
        m = 2 * n - 2  # s = 1/m
        best = -1
        for i in range(n):
            # eligible: (k+1) w_i / W - c_i >= 1/m
            if m * ((k + 1) * w[i] - counts[i] * big_w) < big_w:
                continue
            # due time (c_i + 1 - 1/m) / p_i, compared as (m (c_i + 1) - 1) / w_i
            if best < 0 or (m * (counts[i] + 1) - 1) * w[best] < \
                    (m * (counts[best] + 1) - 1) * w[i]:
                best = i
        return best

    def _walk(self, counts: list[int], k: int, steps: int) -> list[int]:
        """Sources of steps ``k .. k+steps-1`` from ``counts`` at ``k`` (updates counts)."""
        out = []
        for step in range(k, k + steps):
            i = self._choose(counts, step)
            counts[i] += 1
            out.append(i)
        return out

    def counts(self, k: int) -> list[int]:
        """Samples of each source among steps ``0 .. k-1``."""
        if k < 0:
            raise ValueError(f"step must be >= 0, got {k}")
        q, r = divmod(k, self.period)
        if self._prefix is not None:
            return [q * w + int(c) for w, c in zip(self.weights, self._prefix[r])]
        return [q * w + c for w, c in zip(self.weights, self._counts_within(r))]

    def _counts_within(self, r: int) -> list[int]:
        """Counts at step ``r`` of a long period, walked from the last step asked for (a
        reader asks for consecutive steps, so each is walked once)."""
        at, counts = self._memo
        if r < at:
            at, counts = 0, [0] * self.n
        counts = list(counts)
        self._walk(counts, at, r - at)
        self._memo = (r, list(counts))
        return counts

    def sources(self, start: int, stop: int) -> np.ndarray:
        """The source (int64) of each step ``start .. stop-1``."""
        if stop <= start:
            return np.zeros(0, dtype=np.int64)
        if self._table is not None:
            return self._table[np.arange(start, stop) % self.period]
        out: list[int] = []
        k = start
        while k < stop:  # within one period at a time: counts restart at each boundary
            r = k % self.period
            steps = min(stop - k, self.period - r)
            counts = self._counts_within(r)
            out += self._walk(counts, r, steps)
            self._memo = ((r + steps) % self.period,
                          counts if r + steps < self.period else [0] * self.n)
            k += steps
        return np.asarray(out, dtype=np.int64)

    def step_bounds(self, source: int, count: int) -> tuple[int, int]:
        """``(lo, hi)`` with ``lo <= step_of(source, count) <= hi``, without walking: every
        prefix of ``k`` steps holds ``k·w/W`` draws of the source, to within one."""
        w = self.weights[source]
        return (count - 1) * self.period // w - 1, -(-(count + 1) * self.period // w)

    def step_of(self, source: int, count: int) -> int:
        """The step at which source ``source`` draws its ``count``-th sample (1-based):
        the smallest ``k`` with ``counts(k)[source] == count``, minus one.

        The first step the source would need a sample it does not have, when it has
        ``count - 1`` left: where a mixture that stops at its first exhausted source ends.
        """
        if count <= 0:
            raise ValueError(f"count must be >= 1, got {count}")
        w = self.weights[source]
        q, r = divmod(count - 1, w)  # whole periods, then the (r+1)-th draw within one
        if self._prefix is not None:  # smallest j with counts(j)[source] > r
            j = int(np.searchsorted(self._prefix[:, source], r, side="right"))
            return q * self.period + j - 1
        counts, j = [0] * self.n, 0
        while counts[source] <= r:
            counts[self._choose(counts, j)] += 1
            j += 1
        return q * self.period + j - 1


def end_step(schedule: Schedule, remaining: Sequence[int], *, stop: str, start: int = 0,
             whole: Sequence[bool] | None = None) -> int:
    """The step at which a phase at step ``start`` ends, when source ``i`` has
    ``remaining[i]`` samples left (on the rank with the fewest, for ``first_exhausted``).

    ``first_exhausted``: at the first step whose source has none left. ``all_exhausted``:
    once every source not yet read ``whole`` has delivered its remaining samples (a source
    that runs out before then starts its next pass, so it never limits the phase).
    """
    counts = schedule.counts(start)
    # Only the sources whose bounds let them decide the end are located exactly: in a long
    # period (a tiny weight), locating a draw walks the schedule up to it, and a draw far
    # beyond the end would cost a walk far longer than the phase.
    if stop == "first_exhausted":
        draws = [(i, c + r + 1) for i, (c, r) in enumerate(zip(counts, remaining))]
        bounds = [schedule.step_bounds(i, n) for i, n in draws]
        cap = min(hi for _, hi in bounds)
        return min(schedule.step_of(i, n) for (i, n), (lo, _) in zip(draws, bounds)
                   if lo <= cap)
    if stop == "all_exhausted":
        whole = whole or [False] * len(remaining)
        draws = [(i, c + r) for i, (c, r, w) in enumerate(zip(counts, remaining, whole))
                 if r and not w]
        bounds = [schedule.step_bounds(i, n) for i, n in draws]
        floor = max((lo for lo, _ in bounds), default=0)
        return max((schedule.step_of(i, n) + 1 for (i, n), (_, hi) in zip(draws, bounds)
                    if hi >= floor), default=start)
    raise ValueError(f"stop must be 'first_exhausted' or 'all_exhausted', got {stop!r}")
