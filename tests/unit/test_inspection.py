"""The length histogram of eagleforge.inspect_data: bucket edges and counts."""

from __future__ import annotations

import re

import pytest

from eagleforge.data.inspection import length_histogram

pytestmark = pytest.mark.unit


def _buckets(lines: list[str]) -> list[tuple[int, int, int]]:
    """(first, last, count) of each histogram line."""
    parsed = [re.match(r"\s*(\d+)-(\d+)\s+(\d+)", line) for line in lines]
    assert all(parsed), lines
    return [(int(m[1]), int(m[2]), int(m[3])) for m in parsed if m]


@pytest.mark.parametrize(
    ("lengths", "num_buckets"),
    [
        ([35, 10, 1], 8),  # ceil(35 / 8) = 5: seven buckets of 5 reach 35
        ([3, 1, 2], 8),  # fewer tokens than buckets
        ([64, 7], 8),
        ([1], 1),
        ([100, 99, 1, 50], 3),
    ],
)
def test_buckets_are_ordered_cover_every_length_and_count_each_once(
    lengths: list[int], num_buckets: int
) -> None:
    buckets = _buckets(length_histogram(lengths, num_buckets))
    assert 1 <= len(buckets) <= num_buckets
    assert buckets[0][0] == 1 and buckets[-1][1] == max(lengths)
    for (first, last, _), (next_first, _, _) in zip(buckets, buckets[1:], strict=False):
        assert first <= last and next_first == last + 1
    assert buckets[-1][0] <= buckets[-1][1]
    for length in lengths:
        assert sum(first <= length <= last for first, last, _ in buckets) == 1
    assert sum(count for *_, count in buckets) == len(lengths)
    for first, last, count in buckets:
        assert count == sum(first <= length <= last for length in lengths)
