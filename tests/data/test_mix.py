"""data/mix.py: the mix's slot order, on hand-made weights: every prefix of a set is the set at a smaller size."""

from streakline.data.mix import interleave, mix_counts

WEIGHTS = [0.3, 0.1, 0.6]  # data=smol's


def test_counts_sum_to_the_total_stay_within_a_prompt_of_the_quota_and_never_fall():
    before = [0, 0, 0]
    for n in range(1, 2001):
        counts = mix_counts(WEIGHTS, n)
        assert sum(counts) == n
        # Webster's apportionment stays within one seat of the exact share for three sources of these weights
        assert all(abs(c - n * w / sum(WEIGHTS)) < 1 for c, w in zip(counts, WEIGHTS, strict=True))
        assert all(c >= b for c, b in zip(counts, before, strict=True))  # house-monotone: a prefix of the next size
        before = counts
    assert mix_counts([1.0, 0.0], 5) == [5, 0] and mix_counts([0.0, 0.0], 3) == [0, 0]


def _sources(counts, dry=None):
    """Each source's first ``count`` records, as load_source reads them; source ``dry`` holds only 20."""
    return [[(i, j) for j in range(c if i != dry else min(c, 20))] for i, c in enumerate(counts)]


def test_a_smaller_set_is_the_first_rows_of_a_larger_one_and_every_prefix_mixes_the_sources():
    large = interleave(_sources(mix_counts(WEIGHTS, 1000)), WEIGHTS)
    assert len(large) == 1000
    for n in (1, 7, 100, 333, 999):
        assert interleave(_sources(mix_counts(WEIGHTS, n)), WEIGHTS) == large[:n]
        prefix = [sum(1 for i, _ in large[:n] if i == s) for s in range(3)]
        assert prefix == mix_counts(WEIGHTS, n)  # the first n rows of any set are the mix at n
    # each source keeps its own order
    for s in range(3):
        mine = [j for i, j in large if i == s]
        assert mine == sorted(mine) and mine == list(range(len(mine)))


def test_a_source_that_runs_dry_leaves_its_slots_out_and_the_prefixes_still_agree():
    large = interleave(_sources(mix_counts(WEIGHTS, 1000), dry=1), WEIGHTS)
    small = interleave(_sources(mix_counts(WEIGHTS, 400), dry=1), WEIGHTS)
    assert len(large) == 1000 - (100 - 20) and small == large[: len(small)]
    assert sum(1 for i, _ in large if i == 1) == 20


def test_a_source_of_weight_zero_comes_after_every_other():
    # ranks (j + 1/2) / w: b0 at 0.25, a0 at 0.5, a1 at 1.5; the weight-0 source after all of them
    rows = interleave([["a0", "a1"], ["z0"], ["b0"]], [1.0, 0.0, 2.0])
    assert rows == ["b0", "a0", "a1", "z0"]
