"""The draft vocabulary (DESIGN.md, "Vocab map"): the W most frequent supervised target ids,
ties and unseen ids by lowest id, sorted ascending; target_id = i + d2t[i]; t2d marks them."""

from __future__ import annotations

import pytest
import torch

from eagleforge.data.vocab import VocabMap, build_vocab_map, count_supervised_tokens

pytestmark = pytest.mark.unit


def test_count_supervised_tokens_counts_only_masked_tokens() -> None:
    """Only ids at mask=1 are counted, over all samples; unmasked ids (here 1, 5, 7) count 0."""
    samples = [
        ([1, 2, 2, 3, 5], [0, 1, 1, 0, 0]),
        ([3, 3, 9, 7], [1, 0, 1, 0]),
        ([2], [1]),
    ]
    counts = count_supervised_tokens(samples, vocab_size=10)
    assert counts.dtype == torch.int64
    assert counts.tolist() == [0, 0, 3, 1, 0, 0, 0, 0, 0, 1]


def test_count_supervised_tokens_empty() -> None:
    """No samples (or no masked tokens) gives all zeros of length V."""
    assert count_supervised_tokens([], vocab_size=4).tolist() == [0, 0, 0, 0]
    assert count_supervised_tokens([([1, 2], [0, 0])], vocab_size=4).tolist() == [0, 0, 0, 0]


def test_keeps_most_frequent_sorted_ascending() -> None:
    """The W most frequent ids are kept and listed in ascending id order (not frequency order)."""
    counts = torch.tensor([0, 1, 9, 0, 4, 0, 7, 2, 0, 0])
    vocab = build_vocab_map(counts, 3)
    assert vocab.draft_ids_W.tolist() == [2, 4, 6]
    assert vocab.d2t_W.dtype == torch.int64
    assert vocab.d2t_W.tolist() == [2, 3, 4]
    assert vocab.t2d_V.dtype == torch.bool
    assert vocab.t2d_V.int().tolist() == [0, 0, 1, 0, 1, 0, 1, 0, 0, 0]


def test_ties_broken_by_lowest_id() -> None:
    """Ids 1, 5 and 8 tie at count 3 for the last two slots: 1 and 5 are kept, not 8."""
    counts = torch.tensor([0, 3, 0, 6, 0, 3, 0, 0, 3, 0])
    vocab = build_vocab_map(counts, 3)
    assert vocab.draft_ids_W.tolist() == [1, 3, 5]
    # All equal: the lowest ids win.
    assert build_vocab_map(torch.full((6,), 2), 4).draft_ids_W.tolist() == [0, 1, 2, 3]


def test_pads_with_unused_ids_when_too_few_seen() -> None:
    """Only ids 3 and 7 are seen; W=4 pads with the lowest unseen ids 0 and 1."""
    counts = torch.tensor([0, 0, 0, 5, 0, 0, 0, 2, 0, 0])
    vocab = build_vocab_map(counts, 4)
    assert vocab.draft_ids_W.tolist() == [0, 1, 3, 7]
    assert vocab.d2t_W.tolist() == [0, 0, 1, 4]
    assert vocab.t2d_V.nonzero().squeeze(1).tolist() == [0, 1, 3, 7]


def test_d2t_t2d_consistent_on_random_counts() -> None:
    """For random counts: i + d2t[i] is strictly ascending, t2d marks exactly those ids, and
    every kept id is at least as frequent as every dropped id."""
    generator = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 6, (200,), generator=generator)
    vocab = build_vocab_map(counts, 37)
    target_ids = torch.arange(37) + vocab.d2t_W
    assert torch.equal(target_ids, vocab.draft_ids_W)
    assert bool((target_ids[1:] > target_ids[:-1]).all())
    assert int(vocab.t2d_V.sum()) == 37
    assert torch.equal(vocab.t2d_V.nonzero().squeeze(1), target_ids)
    assert int(counts[vocab.t2d_V].min()) >= int(counts[~vocab.t2d_V].max())
    # Among ids with the boundary count, the kept ones are the lowest.
    boundary = int(counts[vocab.t2d_V].min())
    tied = (counts == boundary).nonzero().squeeze(1)
    kept_tied = tied[vocab.t2d_V[tied]]
    assert kept_tied.tolist() == tied[: kept_tied.numel()].tolist()


def test_full_vocab_and_too_large() -> None:
    """W = V keeps every id with d2t all zero; W > V raises ValueError."""
    vocab = build_vocab_map(torch.tensor([5, 0, 2]), 3)
    assert vocab.d2t_W.tolist() == [0, 0, 0]
    assert vocab.t2d_V.all()
    with pytest.raises(ValueError, match="exceeds"):
        build_vocab_map(torch.tensor([5, 0, 2]), 4)


def test_draft_ids_property_from_offsets() -> None:
    """VocabMap.draft_ids_W is arange(W) + d2t."""
    vocab = VocabMap(d2t_W=torch.tensor([4, 4, 9]), t2d_V=torch.zeros(12, dtype=torch.bool))
    assert vocab.draft_ids_W.tolist() == [4, 5, 11]
