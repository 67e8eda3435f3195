"""The losslessness checks: exact comparison and the paired sign-flip test. Run:
``python -m pytest tests/evaluation/test_lossless.py``."""

import torch

from streakline.evaluation.lossless import exact_check, paired_signflip_p, sampled_check


def test_exact_check_names_the_first_difference():
    assert exact_check([[1, 2], [3]], [[1, 2], [3]])["lossless"]
    out = exact_check([[1, 2], [3, 4, 5]], [[1, 2], [3, 9, 5]])
    assert not out["lossless"] and out["prompts_differing"] == 1
    assert out["first_difference"] == {"prompt": 1, "token": 1}
    assert exact_check([[1, 2]], [[1, 2, 3]])["first_difference"] == {"prompt": 0, "token": 2}


def test_signflip_is_calibrated_under_the_null_and_detects_a_shift():
    g = torch.Generator().manual_seed(0)
    # Null: paired values from the same distribution; over 200 repetitions about 5% fall below 0.05.
    ps = []
    for _ in range(200):
        x, y = torch.randn(12, generator=g).tolist(), torch.randn(12, generator=g).tolist()
        ps.append(paired_signflip_p(x, y, rounds=2000))
    below = sum(p < 0.05 for p in ps) / len(ps)
    assert 0.01 <= below <= 0.11
    # A lossy decoder's completions are less likely under the verifier: a shift of 1 sd over 30 prompts.
    x = (torch.randn(30, generator=g) - 1.0).tolist()
    y = torch.randn(30, generator=g).tolist()
    assert paired_signflip_p(x, y) < 1e-3
    assert not sampled_check(x, y)["lossless"]
    assert paired_signflip_p([1.0, float("nan")], [1.0, 2.0]) == 1.0  # NaN pairs (empty completions) dropped
