"""attngen.timing: calls timed in rounds of alternating order."""

import pytest

from attngen.timing import in_rounds


def test_every_call_is_timed_once_a_round_in_alternating_order():
    order = []
    calls = {name: (lambda name=name: order.append(name) or len(order)) for name in "abc"}
    results = in_rounds(calls, rounds=4)
    assert "".join(order) == "abccbaabccba"
    assert results == {"a": [1, 6, 7, 12], "b": [2, 5, 8, 11], "c": [3, 4, 9, 10]}


def test_a_call_that_raises_is_reported_and_left_out_of_later_rounds():
    calls_of_b = []

    def b():
        calls_of_b.append(1)
        if len(calls_of_b) == 2:
            raise RuntimeError("out of resources")
        return 2.0

    failures, rounds = [], []
    results = in_rounds({"a": lambda: 1.0, "b": b}, 3, lambda key, e: failures.append((key, str(e))), rounds.append)
    assert results == {"a": [1.0, 1.0, 1.0]} and failures == [("b", "out of resources")]
    assert len(calls_of_b) == 2 and rounds == [0, 1, 2]
    with pytest.raises(RuntimeError, match="out of resources"):
        calls_of_b.clear()
        in_rounds({"b": b}, 2)
