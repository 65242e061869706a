"""Timing several calls against each other: in rounds, the order reversed every other round.

On the H200 a kernel timed right after a heavier one reads 2-3 % slower than the same kernel timed
after a lighter one (BENCHMARKS.md, 2026-12-04, "what an A/B's order costs"). So every comparison
in the repo (`attngen tune`'s candidates, the benchmarks' implementations) times each call once per
round, every call in turn, in the opposite order every other round, and takes the median of the
rounds.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Hashable, Mapping
from typing import TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

ROUNDS = 4  # an even count: each call as often near the front of a round as near its end


def in_rounds(
    calls: Mapping[K, Callable[[], T]],
    rounds: int = ROUNDS,
    failed: Callable[[K, Exception], None] | None = None,
    started: Callable[[int], None] | None = None,
) -> dict[K, list[T]]:
    """Each call's results over `rounds` rounds, every round calling each in turn, in `calls`' order
    and then reversed. A call that raises is reported to `failed` (which may re-raise to stop) and
    left out of the result and of the later rounds; without `failed` the error propagates.
    `started(r)` is told as round r (0-based) begins."""
    results: dict[K, list[T]] = {key: [] for key in calls}
    for r in range(rounds):
        if started is not None:
            started(r)
        for key in list(calls)[:: 1 if r % 2 == 0 else -1]:
            if key not in results:
                continue
            try:
                results[key].append(calls[key]())
            except Exception as e:
                if failed is None:
                    raise
                del results[key]
                failed(key, e)
    return results


def medians(
    calls: Mapping[K, Callable[[], float]],
    rounds: int = ROUNDS,
    failed: Callable[[K, Exception], None] | None = None,
) -> dict[K, float]:
    """The median over the rounds of each call's time (each call returns the time it measured)."""
    return {key: statistics.median(times) for key, times in in_rounds(calls, rounds, failed).items()}


def median_ms(fn: Callable[[], object]) -> float:
    """The benchmarks' time of one call on the GPU: triton.testing.do_bench's median, 25 ms of warm-up
    and 100 ms of calls (each after an L2 flush)."""
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
