"""engine.memo.remember against a reference model: a memo never holds more than its bound,
always holds what was remembered last, and holds nothing it was not given."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engine.memo import remember


@given(
    st.integers(min_value=1, max_value=8),
    st.lists(st.tuples(st.integers(0, 20), st.integers()), max_size=200),
)
def test_remember_keeps_the_bound_and_the_newest(
    limit: int, entries: list[tuple[int, int]]
) -> None:
    memo: dict[int, int] = {}
    given_since_cleared: dict[int, int] = {}  # the model: what the memo may hold
    for key, value in entries:
        if len(memo) >= limit:
            given_since_cleared.clear()
        given_since_cleared[key] = value
        assert remember(memo, key, value, limit) == value
        assert len(memo) <= limit
        assert memo[key] == value
        assert memo == given_since_cleared
