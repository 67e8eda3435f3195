"""verify_chains: the torch reference against hand-built cases and the acceptance rules' distributions, and the
Triton path against the reference on odd shapes, every rule/selection, two temperatures and three dtypes.

    python -m pytest tests/decoding/kernels/test_verify.py -q      # Triton runs under TRITON_INTERPRET=1 on CPU
"""

import pytest
import torch

from streakline.decoding.kernels import backend_for, use_backend, verify_chains

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Both paths upcast the same half-precision logits and compute in fp32, so the dtype changes the inputs, not the
# arithmetic: the tolerance covers only summation/scan order and exp(x - lse) against exp(x - max) / sum.
SCORE_TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1e-5, 1e-6), torch.float16: (1e-5, 1e-6)}


def _run(logits, drafts, rule, T=1.0, ua=None, us=None, q=None, selection="streak", backend="torch"):
    N, K, G1, V = logits.shape
    # Default uniforms are drawn where the logits live: the kernels refuse inputs on another device (on a GPU a
    # CPU-drawn default failed test_triton_argmax_ties_go_to_the_lowest_id with "all inputs must be on the logits'
    # device"). On CPU this draws from the same generator as before.
    ua = torch.rand(N, G1 - 1, device=logits.device) if ua is None else ua
    us = torch.rand(N, device=logits.device) if us is None else us
    return verify_chains(
        logits, drafts, rule=rule, temperature=T, u_accept=ua, u_sample=us, q=q, selection=selection, backend=backend
    )


def _peaked(V: int, tokens: list[int], height: float = 30.0) -> torch.Tensor:
    """``[len(tokens), V]`` logits whose rows put (almost) all mass on the given tokens."""
    rows = torch.zeros(len(tokens), V)
    rows[torch.arange(len(tokens)), torch.tensor(tokens)] = height
    return rows


# ---------------------------------------------------------------------------------------------------- reference


def test_exact_rule_on_hand_built_logits():
    # Chain argmaxes per slot (rows 0..2) and bonus (row 3); drafts match 1, 3 and 3 leading slots.
    V = 6
    argmaxes = [[1, 2, 3, 4], [1, 5, 0, 2], [1, 5, 0, 3]]
    logits = torch.stack([_peaked(V, a, height=4.0) for a in argmaxes])[None]  # [1, 3, 4, 6]
    drafts = torch.tensor([[[1, 0, 3], [1, 5, 0], [1, 5, 0]]])
    out = _run(logits, drafts, "exact", T=0.0)
    assert out.scores.tolist() == [[1.0, 3.0, 3.0]]
    assert (out.chosen.item(), out.accepted.item(), out.next_token.item()) == (1, 3, 2)  # tie 1 vs 2 -> lowest k

    # No chain matches: chain 0, nothing accepted, replacement = argmax of row 0; a tie in the logits goes to the
    # lowest token id.
    logits[0, :, 0, 4] = 4.0  # ties token 1 with token 4 in row 0 of every chain
    drafts = torch.tensor([[[2, 0, 0], [3, 5, 0], [4, 5, 0]]])
    out = _run(logits, drafts, "exact", T=0.0, selection="longest")
    assert out.scores.tolist() == [[0.0, 0.0, 0.0]]
    assert (out.chosen.item(), out.accepted.item(), out.next_token.item()) == (0, 0, 1)


def test_streak_and_longest_selection_differ_where_they_should():
    V = 4
    # Chain 0: every draft is the argmax but only at p = 0.4. Chain 1: slot 0 is not the argmax (0.45 against 0.5)
    # but the rest is near certain. Streaks: 0.4 + 0.16 + 0.064 against 0.45 + 0.43 + 0.41.
    p0 = torch.tensor([0.4, 0.2, 0.2, 0.2])
    p1_slot0 = torch.tensor([0.45, 0.5, 0.025, 0.025])
    p1_rest = torch.tensor([0.95, 0.02, 0.02, 0.01])
    rows0 = p0.log().expand(4, V)
    rows1 = torch.stack([p1_slot0.log(), p1_rest.log(), p1_rest.log(), p1_rest.log()])
    logits = torch.stack([rows0, rows1])[None]
    drafts = torch.tensor([[[0, 0, 0], [0, 0, 0]]])
    streak = _run(logits, drafts, "greedy", selection="streak")
    longest = _run(logits, drafts, "greedy", selection="longest")
    torch.testing.assert_close(streak.scores, torch.tensor([[0.624, 0.45 * (1 + 0.95 + 0.95**2)]]))
    assert streak.chosen.item() == 1 and longest.chosen.item() == 0
    torch.testing.assert_close(streak.scores, longest.scores)  # the score is reported whatever picks the chain


def test_greedy_accepts_everything_at_u_zero_and_takes_the_bonus_from_row_g():
    N, K, G, V = 2, 2, 4, 9
    torch.manual_seed(1)
    logits = torch.randn(N, K, G + 1, V)
    logits[:, :, G] = _peaked(V, [7])  # the bonus row puts its mass on token 7; other rows are diffuse
    drafts = torch.randint(0, V, (N, K, G))
    out = _run(logits, drafts, "greedy", T=1.3, ua=torch.zeros(N, G), us=torch.full((N,), 0.5))
    assert out.accepted.tolist() == [G, G] and out.next_token.tolist() == [7, 7]


def test_greedy_rejection_never_returns_the_rejected_draft():
    N, V = 256, 8
    # The draft is the verifier's favourite (p ~ 0.9): a rejection must still never emit it.
    row = torch.zeros(V)
    row[3] = 4.0
    logits = row.expand(N, 1, 2, V).clone()
    drafts = torch.full((N, 1, 1), 3)
    ua = torch.full((N, 1), 1.0 - 2**-24)  # largest float32 below 1: rejects anything with p(x) < 1
    out = _run(logits, drafts, "greedy", ua=ua, us=torch.linspace(0, 1 - 2**-24, N))
    assert out.accepted.eq(0).all()
    assert not out.next_token.eq(3).any()
    assert set(out.next_token.tolist()) == set(range(V)) - {3}  # and every other token is reachable


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_draft_of_probability_zero_is_rejected_even_at_u_zero(backend, request):
    # u >= a rejects: a token the verifier rules out (-inf logit, e.g. an unmappable drafter token) never passes.
    if backend == "triton":
        backend = request.getfixturevalue("triton_backend")
    logits = torch.zeros(1, 2, 3, 7, device=DEVICE)
    logits[:, :, 1, 4] = float("-inf")
    drafts = torch.tensor([[[2, 4], [2, 5]]], device=DEVICE)
    ua, us = torch.zeros(1, 2, device=DEVICE), torch.full((1,), 0.5, device=DEVICE)
    out = _run(logits, drafts, "greedy", 1.0, ua, us, backend=backend)
    assert out.chosen.item() == 1 and out.accepted.item() == 2  # chain 0 scores 1/7 + 0: chain 1 wins
    out = _run(logits[:, :1], drafts[:, :1], "greedy", 1.0, ua, us, backend=backend)
    assert out.accepted.item() == 1 and out.next_token.item() != 4


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability 0"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_greedy_residual_follows_p_with_the_draft_zeroed():
    N, V, T = 4000, 6, 0.7
    g = torch.Generator().manual_seed(0)
    row = torch.tensor([0.5, 1.5, -0.3, 2.0, 0.0, 1.0])
    logits = row.expand(N, 1, 2, V).clone()
    drafts = torch.full((N, 1, 1), 3)  # the argmax; rejection is forced below
    out = _run(logits, drafts, "greedy", T=T, ua=torch.full((N, 1), 1.0 - 2**-24), us=torch.rand(N, generator=g))
    residual = torch.softmax(row / T, -1)
    residual[3] = 0.0
    # 4 degrees of freedom (5 tokens left); 18.47 is the 0.999 quantile. The seed is fixed, so this is stable.
    assert _chi_square(out.next_token, residual / residual.sum()) < 18.47


def test_self_selection_with_greedy_acceptance_is_lossless():
    # The first emitted token (the draft if slot 0 is accepted, else the replacement) must follow p_1 even though
    # the chain was chosen by looking at p (docs/algorithms.md section 2).
    N, K, G, V, T = 6000, 3, 2, 6, 1.0
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(N, K, G + 1, V, generator=g)
    p1_logits = torch.tensor([1.0, 0.2, -0.5, 0.8, 0.0, -1.0])
    logits[:, :, 0] = p1_logits  # slot 1 depends only on the prefix: the same row for every chain
    drafts = torch.randint(0, V, (N, K, G), generator=g)
    out = _run(logits, drafts, "greedy", T=T, ua=torch.rand(N, G, generator=g), us=torch.rand(N, generator=g))
    first = torch.where(out.accepted > 0, drafts[torch.arange(N), out.chosen, 0], out.next_token)
    assert _chi_square(first, torch.softmax(p1_logits / T, -1)) < 20.52  # 5 dof, 0.999 quantile


def test_leviathan_with_q_equal_p_accepts_everything():
    N, G, V, T = 3, 5, 11, 0.7
    torch.manual_seed(2)
    logits = torch.randn(N, 1, G + 1, V)
    q = torch.softmax(logits[:, 0, :G] / T, -1)
    drafts = torch.multinomial(q.reshape(-1, V), 1).reshape(N, 1, G)
    out = _run(logits, drafts, "leviathan", T=T, q=q, ua=torch.rand(N, G) * 0.99)
    assert out.accepted.tolist() == [G] * N
    torch.testing.assert_close(out.scores, torch.full((N, 1), float(G)))


def test_leviathan_residual_excludes_tokens_q_overweights():
    V, T = 5, 1.0
    p = torch.tensor([0.1, 0.4, 0.2, 0.2, 0.1])
    q = torch.tensor([[[0.6, 0.1, 0.1, 0.1, 0.1]]])  # only tokens 1-3 have p > q
    logits = p.log().expand(1, 1, 2, V).clone()
    N = 64
    out = _run(
        logits.expand(N, 1, 2, V),
        torch.zeros(N, 1, 1, dtype=torch.long),
        "leviathan",
        T=T,
        q=q.expand(N, 1, V),
        ua=torch.full((N, 1), 0.5),
        us=torch.linspace(0, 0.999, N),
    )
    assert out.accepted.eq(0).all()  # a = p/q = 1/6 < 0.5
    assert set(out.next_token.tolist()) == {1, 2, 3}


def test_inputs_are_validated():
    logits = torch.randn(1, 2, 3, 5)
    drafts = torch.zeros(1, 2, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="leviathan verifies one draft"):
        _run(logits, drafts, "leviathan", q=torch.full((1, 2, 5), 0.2))
    with pytest.raises(ValueError, match="needs q"):
        _run(logits[:, :1], drafts[:, :1], "leviathan")
    with pytest.raises(ValueError, match="valid: exact, greedy, leviathan"):
        _run(logits, drafts, "typical")
    with pytest.raises(ValueError, match="valid: streak, longest"):
        _run(logits, drafts, "greedy", selection="best")
    with pytest.raises(ValueError, match="drafts must be int64"):
        _run(logits, drafts[..., :1], "greedy")
    with pytest.raises(ValueError, match="temperature > 0"):
        _run(logits, drafts, "greedy", T=0.0)
    with pytest.raises(ValueError, match="u_accept"):
        _run(logits, drafts, "greedy", ua=torch.rand(1, 3))
    with pytest.raises(ValueError, match=r"lie in \[0, 5\)"):
        _run(logits, drafts + 5, "greedy")


# ------------------------------------------------------------------------------------------ Triton vs reference


def _make_case(N, K, G, V, dtype, seed, rule, T):
    """Inputs with non-trivial acceptance: random logits, drafts whose logit is boosted by a random amount (so a
    spans ~0..1), and a random leading run of drafts set to the row argmax (so exact match lengths vary)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, K, G + 1, V, generator=g) * 2
    drafts = torch.randint(0, V, (N, K, G), generator=g)
    boost = torch.rand(N, K, G, 1, generator=g) * 12
    logits[:, :, :G].scatter_add_(-1, drafts.unsqueeze(-1), boost)
    logits = logits.to(dtype)
    lead = torch.randint(0, G + 1, (N, K, 1), generator=g)
    drafts = torch.where(torch.arange(G) < lead, logits.float().argmax(-1)[..., :G], drafts)
    q = None
    if rule == "leviathan":
        noise = torch.randn(N, G, V, generator=g) * 1.5
        q = torch.softmax(logits[:, 0, :G].float() / T + noise, -1)
    return logits, drafts, q, g


def _robust_uniforms(logits, drafts, q, rule, T, selection, g, us=None):
    """Uniforms at which the reference's discrete outputs are stable under a nudge far larger than the two paths'
    rounding differences (~1e-6): acceptance is monotone in u_accept and the inverse-CDF token is monotone in
    u_sample, so equal outputs at u - eps and u + eps mean no boundary lies within eps of u. Rows that fail are
    redrawn (a few percent of draws with eps = 1e-4 / 3e-5), so a boundary coincidence is ruled out, not just
    improbable. ``us`` optionally fixes u_sample; its failing rows then move by at most 1e-3 instead."""
    N, _, G1, _ = logits.shape
    ua = torch.rand(N, G1 - 1, generator=g)
    jitter = us is not None
    us = torch.rand(N, generator=g) * 0.999 if us is None else us.clone()
    for _ in range(100):
        outs = [
            _run(logits, drafts, rule, T, (ua + s * 1e-4).clamp(0, 1), (us + s * 3e-5).clamp(0, 1), q, selection)
            for s in (-1, 0, 1)
        ]
        bad = torch.zeros(N, dtype=torch.bool)
        for o in (outs[0], outs[2]):
            bad |= (o.accepted != outs[1].accepted) | (o.next_token != outs[1].next_token)
        if not bad.any():
            return ua, us, outs[1]
        ua[bad] = torch.rand(int(bad.sum()), G1 - 1, generator=g)
        fresh = torch.rand(int(bad.sum()), generator=g)
        us[bad] = (us[bad] + 1e-3 * fresh).clamp(max=0.999) if jitter else fresh * 0.999
    raise AssertionError("no robust uniforms found")


def _scores_well_separated(scores: torch.Tensor) -> bool:
    if scores.shape[1] < 2:
        return True
    top2 = scores.topk(2, dim=-1).values
    return bool(((top2[:, 0] - top2[:, 1]) > 1e-4 * top2[:, 0].clamp(min=1e-3)).all())


def _check_against_reference(N, K, G, V, rule, selection, T, dtype, backend, seed=0):
    K = 1 if rule == "leviathan" else K
    for attempt in range(20):
        logits, drafts, q, g = _make_case(N, K, G, V, dtype, seed + 1000 * attempt, rule, T)
        ua, us, ref = _robust_uniforms(logits, drafts, q, rule, T, selection, g)
        # Streak selection is an argmax over floats: two chains within rounding would be a coincidence too.
        if rule == "exact" or selection == "longest" or _scores_well_separated(ref.scores):
            break
    else:
        raise AssertionError("no case with well separated streak scores")
    q = None if q is None else q.to(DEVICE)
    got = _run(logits.to(DEVICE), drafts.to(DEVICE), rule, T, ua.to(DEVICE), us.to(DEVICE), q, selection, backend)
    assert got.chosen.dtype == got.accepted.dtype == got.next_token.dtype == torch.int64
    assert got.scores.dtype == torch.float32 and got.scores.shape == (N, K)
    assert got.chosen.cpu().tolist() == ref.chosen.tolist()
    assert got.accepted.cpu().tolist() == ref.accepted.tolist()
    assert got.next_token.cpu().tolist() == ref.next_token.tolist()
    rtol, atol = SCORE_TOL[dtype]
    torch.testing.assert_close(got.scores.cpu(), ref.scores, rtol=rtol, atol=atol)
    return ref


RULE_SELECTIONS = [("exact", "streak"), ("greedy", "streak"), ("greedy", "longest"), ("leviathan", "streak")]
# exact ignores the temperature: one run of it, two of the others.
CASES = [(r, s, T) for r, s in RULE_SELECTIONS for T in ((0.7,) if r == "exact" else (0.7, 1.3))]
SMALL_SHAPES = [(2, 2, 3, 37), (3, 4, 5, 300), (1, 1, 0, 50), (2, 3, 1, 5)]  # V below one block, G = 0, G = 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rule,selection,T", CASES)
@pytest.mark.parametrize("shape", SMALL_SHAPES, ids=lambda s: "NKGV=" + "x".join(map(str, s)))
def test_triton_matches_reference_small(shape, rule, selection, T, dtype, triton_backend):
    _check_against_reference(*shape, rule, selection, T, dtype, triton_backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rule,selection", RULE_SELECTIONS)
def test_triton_matches_reference_big_vocab(rule, selection, dtype, triton_backend):
    # V = 4099 is one past a power of two: two blocks of 4096, the second almost empty.
    _check_against_reference(2, 3, 7, 4099, rule, selection, 1.3, dtype, triton_backend, seed=7)


def test_triton_samples_across_blocks_and_masked_logits(triton_backend):
    # Three blocks of 4096 (the last holds 5 tokens that carry about half the mass), so inverse-CDF draws land in
    # every block and the carried offset of the running sum matters; -inf logits (a padded vocabulary) in the
    # middle, a whole block of them in row 0.
    N, V = 5, 2 * 4096 + 5
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(N, 1, 2, V, generator=g)
    logits[..., -5:] += 8.0
    logits[..., 100:300] = float("-inf")
    logits[0, :, :, 4096:8192] = float("-inf")
    drafts = torch.randint(0, V - 5, (N, 1, 1), generator=g)
    us = torch.tensor([0.1, 0.05, 0.2, 0.35, 0.9])  # blocks hold ~0.12-0.28, ~0.13-0.27 and the rest of the mass
    ua, us, ref = _robust_uniforms(logits, drafts, None, "greedy", 1.0, "streak", g, us=us)
    got = _run(
        logits.to(DEVICE), drafts.to(DEVICE), "greedy", 1.0, ua.to(DEVICE), us.to(DEVICE), backend=triton_backend
    )
    assert got.accepted.cpu().tolist() == ref.accepted.tolist()
    assert got.next_token.cpu().tolist() == ref.next_token.tolist()
    assert {t // 4096 for t in ref.next_token.tolist()} == {0, 1, 2}  # the case reaches every block


def test_triton_argmax_ties_go_to_the_lowest_id(triton_backend):
    # Equal maxima inside one lane sweep, across lanes and across blocks; torch.argmax takes the first.
    N, V = 3, 4099
    logits = torch.zeros(N, 1, 1, V)
    logits[0, ..., [4097, 9, 5, 4098]] = 5.0
    logits[1, ..., [4000, 4097]] = 5.0
    logits[2, ..., [4096 + 1, 1]] = 5.0  # same lane (1) in both blocks
    empty = torch.zeros(N, 1, 0, dtype=torch.long)
    ref = _run(logits, empty, "exact", 0.0)
    got = _run(logits.to(DEVICE), empty.to(DEVICE), "exact", 0.0, backend=triton_backend)
    assert ref.next_token.tolist() == [5, 4000, 1]
    assert got.next_token.cpu().tolist() == [5, 4000, 1]


def test_triton_reads_strided_logits(triton_backend):
    # A slice of a wider tensor (as a model's output might be): the kernels take strides, nothing is copied.
    N, K, G, V = 2, 2, 3, 40
    logits, drafts, _, g = _make_case(N, K, G, V, torch.float32, 3, "greedy", 1.0)
    wide = torch.randn(N, K, G + 1, V + 9)
    wide[..., 4 : 4 + V] = logits
    view = wide[..., 4 : 4 + V]
    assert not view.is_contiguous()
    ua, us, ref = _robust_uniforms(logits, drafts, None, "greedy", 1.0, "streak", g)
    got = _run(view.to(DEVICE), drafts.to(DEVICE), "greedy", 1.0, ua.to(DEVICE), us.to(DEVICE), backend=triton_backend)
    assert got.next_token.cpu().tolist() == ref.next_token.tolist()
    assert got.accepted.cpu().tolist() == ref.accepted.tolist()
    torch.testing.assert_close(got.scores.cpu(), ref.scores, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------- the switch


def test_switch_precedence_and_errors(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.delenv("STREAKLINE_KERNELS", raising=False)
    assert backend_for(cpu) == "torch"  # auto: CPU tensors stay on torch
    monkeypatch.setenv("STREAKLINE_KERNELS", "torch")
    assert backend_for(cpu) == "torch"
    with use_backend("auto"):
        assert backend_for(cpu, "torch") == "torch"  # the argument wins over the context
    monkeypatch.setenv("STREAKLINE_KERNELS", "fast")
    with pytest.raises(ValueError, match="valid: auto, torch, triton"):
        backend_for(cpu)
    with use_backend("torch"):  # the context wins over the environment
        assert backend_for(cpu) == "torch"
    with pytest.raises(ValueError, match="valid: auto, torch, triton"):
        backend_for(cpu, "cuda")
    with pytest.raises(ValueError), use_backend("gpu"):
        pass


def test_forcing_triton_on_cpu_needs_the_interpreter(monkeypatch):
    from streakline.decoding import kernels

    cpu = torch.zeros(1)
    monkeypatch.setattr(kernels, "available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        backend_for(cpu, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backend_for(cpu, "triton") == "triton"
    monkeypatch.setattr(kernels, "available", lambda: False)
    with pytest.raises(RuntimeError, match="pip install triton"):
        backend_for(cpu, "triton")
    with use_backend("triton"), pytest.raises(RuntimeError, match="pip install triton"):
        verify_chains(
            torch.randn(1, 1, 1, 4),
            torch.zeros(1, 1, 0, dtype=torch.long),
            rule="exact",
            temperature=0.0,
            u_accept=torch.rand(1, 0),
            u_sample=torch.rand(1),
        )
