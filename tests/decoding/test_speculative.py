"""Temperature 0: every decoder, every K, batch 1 and 4 reproduces the verifier's own greedy output token for token.

The reference is ``greedy_generate`` (itself checked against full recomputation in ``test_vanilla.py``) and, on the
same weights exported to a Hugging Face folder, ``transformers``' greedy ``generate``.
"""

import pytest
import torch

from streakline.decoding.drafters import ARDrafter, DiffusionDrafter
from streakline.decoding.speculative import SpecConfig, generate
from streakline.decoding.vanilla import PositionLimitError, greedy_generate
from streakline.models import save_pretrained
from tests.decoding.helpers import V, causal_copy, random_drafter, shifted_copy, verifier

N_NEW = 20


def _prompts(batch: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 1, 9, 3][:batch]  # ragged on purpose, with a one-token prompt
    return [torch.randint(0, V - 1, (n,), generator=g).tolist() for n in lengths]


def _drafters(model):
    yield "vanilla", None, 1
    yield "ar_oracle", ARDrafter(causal_copy(model)), 1
    yield "ar_random", ARDrafter(causal_copy(model, seed=7)), 1
    for K in (1, 2, 4, 8):
        yield f"diffusion_shifted_K{K}", DiffusionDrafter(shifted_copy(model), temperature=1.5), K
    yield "diffusion_shifted_full_K3", DiffusionDrafter(shifted_copy(model, "full"), temperature=1.0), 3
    yield "diffusion_random_K4", DiffusionDrafter(random_drafter(seed=5), temperature=1.5), 4
    yield "diffusion_random_full_shifted_K2", DiffusionDrafter(random_drafter(5, "full", shift=True)), 2


@pytest.mark.parametrize("batch", [1, 4])
def test_every_decoder_reproduces_greedy(batch):
    model = verifier(seed=0)
    prompts = _prompts(batch)
    want = greedy_generate(model, prompts, N_NEW)
    for name, drafter, K in _drafters(model):
        for acceptance in ("greedy_acceptance", "leviathan", "multidraft_leviathan", "exact_greedy"):
            if acceptance == "leviathan" and K > 1:
                continue
            cfg = SpecConfig(max_new_tokens=N_NEW, gamma=4, K=K, acceptance=acceptance, temperature=0.0)
            res = generate(model, prompts, cfg, drafter=drafter)
            assert res.tokens == want, (name, acceptance)
            m = res.metrics
            assert m.new_tokens == batch * N_NEW
            assert m.cycles * (1 if drafter else 1) >= m.new_tokens / (cfg.gamma + 1)
            if drafter is None:
                assert m.cycles == m.new_tokens and m.drafter_forwards == 0
            if acceptance != "greedy_acceptance":
                break  # the other rules all reduce to exact-greedy at T=0; one check per drafter is enough


def test_drafts_are_accepted_and_self_selection_picks_other_chains():
    """The shifted copy's slot 1 is the verifier's argmax, so every cycle accepts >= 1 token; with K=8 chains some
    cycles must pick a chain other than the argmax chain 0 (its later slots matched by chance)."""
    model = verifier(seed=0)
    prompts = _prompts(4, seed=1)
    res = generate(
        model, prompts, SpecConfig(max_new_tokens=40, gamma=4, K=8), drafter=DiffusionDrafter(shifted_copy(model))
    )
    m = res.metrics
    assert res.tokens == greedy_generate(model, prompts, 40)
    assert m.alpha[0] == 1.0  # slot 1 always right
    assert m.accepted_per_cycle >= 1.0 and m.tokens_per_verifier_call >= 2.0
    assert sum(m.chosen[1:]) > 0, m.chosen
    oracle = generate(model, prompts, SpecConfig(max_new_tokens=40, gamma=4), drafter=ARDrafter(causal_copy(model)))
    assert oracle.tokens == res.tokens
    assert oracle.metrics.alpha == [1.0] * 4  # the verifier drafting for itself is always accepted
    assert oracle.metrics.drafter_forwards == 4 * oracle.metrics.nfe - 4  # gamma per cycle, no prefill


def test_stop_criteria_eos_and_stop_strings():
    model = verifier(seed=2)
    prompts = _prompts(4, seed=3)
    free = greedy_generate(model, prompts, N_NEW)
    eos = free[0][5]
    res = generate(
        model,
        prompts,
        SpecConfig(max_new_tokens=N_NEW, gamma=3, K=2, eos_token_id=eos),
        drafter=DiffusionDrafter(shifted_copy(model)),
    )
    for got, full in zip(res.tokens, free, strict=True):
        want = full[: full.index(eos) + 1] if eos in full else full
        assert got == want


def test_matches_transformers_generate(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = verifier(seed=4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(save_pretrained(model, tmp_path / "v")).eval()
    prompts = _prompts(4, seed=5)
    ours = generate(
        model, prompts, SpecConfig(max_new_tokens=N_NEW, gamma=4, K=4), drafter=DiffusionDrafter(shifted_copy(model))
    )
    for prompt, got in zip(prompts, ours.tokens, strict=True):
        with torch.no_grad():
            ids = torch.tensor(
                [prompt]
            )  # explicit mask: these prompts contain id 0, which generate() takes for padding
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_NEW, do_sample=False, eos_token_id=None
            )
        assert got == out[0, len(prompt) :].tolist()


def test_bad_settings_are_refused():
    model = verifier()
    with pytest.raises(ValueError, match="K=1"):
        generate(model, [[1, 2]], SpecConfig(max_new_tokens=4, K=2), drafter=ARDrafter(causal_copy(model)))
    with pytest.raises(ValueError, match="multidraft_leviathan"):
        generate(
            model,
            [[1]],
            SpecConfig(max_new_tokens=4, K=3, temperature=1.0, acceptance="leviathan"),
            drafter=DiffusionDrafter(shifted_copy(model)),
        )
    # exact_greedy keeps only the verifier's argmax: at T > 0 that is greedy decoding, not sampling (not lossless)
    with pytest.raises(ValueError, match="exact_greedy is lossless only at temperature 0"):
        generate(model, [[1]], SpecConfig(max_new_tokens=4, temperature=1.0, acceptance="exact_greedy"))
    with pytest.raises(ValueError, match="unknown acceptance"):
        generate(model, [[1]], SpecConfig(max_new_tokens=4, acceptance="best"))
    with pytest.raises(ValueError, match="decoder=ar_draft"):
        DiffusionDrafter(causal_copy(model))


def test_topk_logprobs_and_finish_reasons():
    model = verifier(seed=6)
    prompts = _prompts(4, seed=7)
    free = greedy_generate(model, prompts, 10)
    eos = free[1][3]
    res = generate(
        model,
        prompts,
        SpecConfig(max_new_tokens=10, gamma=3, K=2, eos_token_id=eos, topk_logprobs=3),
        drafter=DiffusionDrafter(shifted_copy(model)),
    )
    for prompt, toks, ids, lps, reason in zip(
        prompts, res.tokens, res.topk_ids, res.topk_logprobs, res.finish_reasons, strict=True
    ):
        assert reason == ("eos" if toks[-1] == eos else "length")
        assert len(ids) == len(lps) == len(toks)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + toks]))[0, len(prompt) - 1 : -1]
        want = torch.log_softmax(logits, -1).topk(3, -1)
        assert ids == want.indices.tolist()
        torch.testing.assert_close(torch.tensor(lps), want.values, rtol=1e-4, atol=1e-4)
        assert all(i[0] == t for i, t in zip(ids, toks, strict=True))  # greedy: the emitted token is the top-1


def test_a_decode_past_the_position_limit_is_refused_before_any_work():
    """Positions beyond max_position_embeddings were never trained: refused with the numbers, not decoded silently
    (and a huge gamma is refused before the KV cache is allocated for it)."""
    model = verifier()
    limit = model.config.max_position_embeddings
    long_prompt = [[1] * (limit - 3)]
    with pytest.raises(
        PositionLimitError, match=rf"{limit - 3} tokens plus 7 more positions.*max_position_embeddings={limit}"
    ):
        greedy_generate(model, long_prompt, 8)
    with pytest.raises(PositionLimitError, match="verifier's max_position_embeddings"):
        generate(model, long_prompt, SpecConfig(max_new_tokens=2, gamma=4), drafter=ARDrafter(causal_copy(model)))
    with pytest.raises(PositionLimitError, match="100003 more positions"):
        generate(model, [[1, 2]], SpecConfig(max_new_tokens=4, gamma=100000), drafter=ARDrafter(causal_copy(model)))
    # Exactly at the limit is fine: the 8th new token is emitted, never fed, so a prompt of limit - 7 fits; the
    # speculative decoder's last cycle scores at most N - 1 + gamma positions past the prompt. The hook checks that
    # no position id the verifier is fed reaches the limit, so the check is not just looser.
    fed = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kw: fed.append(int(kw["position_ids"].max())) if kw.get("position_ids") is not None else None,
        with_kwargs=True,
    )
    try:
        edge = [[1] * (limit - 7)]
        assert len(greedy_generate(model, edge, 8)[0]) == 8
        spec = SpecConfig(max_new_tokens=4, gamma=4)
        drafter = ARDrafter(causal_copy(model))
        assert generate(model, edge, spec, drafter=drafter).tokens == greedy_generate(model, edge, 4)
    finally:
        hook.remove()
    assert fed and max(fed) == limit - 1
    with pytest.raises(PositionLimitError):
        greedy_generate(model, [[1] * (limit - 6)], 8)
    with pytest.raises(PositionLimitError):
        generate(model, [[1] * (limit - 6)], spec, drafter=drafter)
