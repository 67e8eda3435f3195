"""Training DFlash drafters (``streakline/alignment/dflash.py``) and the DFlash papers' decayed cross-entropy
(``dflash_ce`` in ``alignment/losses.py``): the packed training loss equals one uncached block forward per window,
gradients reach the drafter and never the verifier, stored and online teachers agree where they must, ``dflash_ce``
equals its formula, and a short training run raises the real decoder's accepted streak.

    python -m pytest tests/alignment/test_dflash_training.py -q
"""

from __future__ import annotations

import copy

import datasets
import pytest
import torch

from streakline.alignment.data import TrajectoryWindows
from streakline.alignment.dflash import DFlashTrainModule
from streakline.alignment.losses import LOSSES, LossInput, LossSettings, compute_loss, naive_logprobs
from streakline.decoding.drafters import DFlashDrafter
from streakline.decoding.speculative import SpecConfig, generate
from streakline.models import Transformer, TransformerConfig
from streakline.models.dflash import DFlashConfig, DFlashModel, block_inputs
from tests.models.helpers import tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

V, H = 97, 32
MASK = V - 1  # the drafter's mask token, also the windows' padding id (a verifier id, so the verifier can embed it)
BLOCK = 5  # windows of G = BLOCK - 1 = 4 slots


def _verifier(seed: int = 0) -> Transformer:
    cfg = TransformerConfig(
        vocab_size=V, hidden_size=H, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
        family="qwen3", qk_norm=True,
    )  # fmt: skip
    # left trainable on purpose: DFlashTrainModule must freeze it
    return Transformer(cfg).init_weights(seed=seed, std=0.1)


def _drafter(verifier: Transformer, seed: int = 1, block: int = BLOCK) -> DFlashModel:
    shapes = TransformerConfig(
        vocab_size=V, hidden_size=H, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
        family="qwen3", qk_norm=True, attention="full",
    )  # fmt: skip
    cfg = DFlashConfig(layers=shapes, target_layer_ids=(1, 3), block_size=block, mask_token_id=MASK)
    # std 0.2: large enough that a wrong mask, position or context row shows in the loss
    return DFlashModel(cfg).init_weights(seed=seed, std=0.2).share(verifier)


def _rows(seed: int = 0) -> dict[str, list]:
    """Trajectories of different lengths (ragged, so the clean rows are right-padded); a one-token prompt puts a
    window at offset 1, whose block is anchored at 0 and has no context at all."""
    g = torch.Generator().manual_seed(seed)
    rows = {"prompt_ids": [], "completion_ids": []}
    for p, c in [(1, 7), (5, 9), (3, 4), (7, 12)]:
        rows["prompt_ids"].append(torch.randint(0, MASK, (p,), generator=g).tolist())
        rows["completion_ids"].append(torch.randint(0, MASK, (c,), generator=g).tolist())
    return rows


def _batch(rows: dict[str, list], teacher: bool = False):
    windows = TrajectoryWindows(
        datasets.Dataset.from_dict(rows), gamma=BLOCK - 1, mask_id=MASK, windows_per_seq=5, teacher=teacher
    )
    return windows.collate(list(range(len(windows))))  # every example: the edge cases are all in one batch


def _one_block_per_forward(module: DFlashTrainModule, batch, settings: LossSettings) -> torch.Tensor:
    """The reference: each real window alone, its row's verifier states computed on the unpadded row, one uncached
    drafter forward over ``[seq[p], MASK x G]`` after only the context before the anchor ``p = offset - 1``."""
    drafter, verifier = module.drafter, module.verifier
    slots, labels, valid = [], [], []
    for b, w in batch.window_valid.nonzero().tolist():
        seq = batch.clean[b, batch.pad_valid[b]]
        p = int(batch.offsets[b, w]) - 1
        with torch.no_grad():
            feats = verifier.hidden(seq[None], aux_layers=drafter.dflash.target_layer_ids)[1][:, :p]
        block = block_inputs(seq[p : p + 1], BLOCK, MASK)
        h = drafter.hidden(
            block,
            torch.arange(p, p + BLOCK)[None],
            features=feats if p else None,
            feature_pos=torch.arange(p)[None] if p else None,
        )
        slots.append(h[0, 1:])
        labels.append(batch.labels[b, w])
        valid.append(batch.valid[b, w])
    inp = LossInput(torch.stack(slots), drafter.output_weight, torch.stack(labels), torch.stack(valid), temperature=0.8)
    return compute_loss(inp, settings).loss


@pytest.mark.parametrize("loss", ["ce_streak", "streak", "dflash_ce"])
def test_packed_training_loss_equals_one_block_per_forward(loss):
    verifier = _verifier()
    module = DFlashTrainModule(_drafter(verifier), verifier, LossSettings(name=loss, chunk=13), temperature=0.8)
    batch = _batch(_rows())
    assert int(batch.offsets.min()) == 1 and not bool(batch.pad_valid.all())  # the edge cases are in the batch
    assert not bool(batch.window_valid.all())  # and filler windows, which must not count
    packed, metrics = module(batch)
    alone = _one_block_per_forward(module, batch, LossSettings(name=loss, chunk=13))
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-6)
    assert set(metrics) == {"loss", "q_mean_j", "streak_q"} and len(metrics["q_mean_j"]) == BLOCK - 1
    # the comparison can fail: a drafter that ignores the context gives another loss
    blind = copy.deepcopy(module)
    with torch.no_grad():
        blind.drafter.fc.weight.zero_()
    assert abs(blind(batch)[0].item() - packed.item()) > 1e-3


def test_gradients_reach_every_drafter_parameter_and_never_the_verifier():
    verifier = _verifier()
    module = DFlashTrainModule(_drafter(verifier), verifier, LossSettings(name="dflash_ce"))
    verifier_params = {id(p) for p in verifier.parameters()}
    assert not verifier_params & {id(p) for p in module.parameters()}
    assert all(k.startswith("drafter.") for k in module.state_dict())
    assert module.external_parameters() == []
    head = verifier.output_weight.detach().clone()
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    loss, _ = module(_batch(_rows()))
    loss.backward()
    for name, p in module.drafter.named_parameters():
        assert p.grad is not None and bool(p.grad.abs().sum() > 0), name
    assert all(p.grad is None and not p.requires_grad for p in verifier.parameters())
    opt.step()
    assert torch.equal(verifier.output_weight, head)


def _with_topk(rows: dict[str, list], verifier: Transformer, k: int) -> dict[str, list]:
    """``rows`` plus the verifier's top-k log-softmax at every completion token (what stage=trajectories stores):
    completion token t of a row is predicted from sequence position ``P + t - 1``."""
    out = {**rows, "topk_ids": [], "topk_logprobs": []}
    for prompt, completion in zip(rows["prompt_ids"], rows["completion_ids"], strict=True):
        with torch.no_grad():
            logp = verifier(torch.tensor([prompt + completion])).log_softmax(-1)[0]
        top = logp[len(prompt) - 1 : len(prompt) + len(completion) - 1].topk(k, -1)
        out["topk_ids"].append(top.indices.tolist())
        out["topk_logprobs"].append(top.values.tolist())
    return out


def test_stored_topk_and_online_teachers(monkeypatch):
    """distillspec (fkl) with the stored top-k at k = V equals the online teacher (the k + 1 bucket divergence is
    the full one there), and with k = 4 it is strictly smaller (a lower bound: the buckets merge ids)."""
    verifier = _verifier()
    settings = LossSettings(name="distillspec", divergence="fkl", chunk=13)
    module = DFlashTrainModule(_drafter(verifier), verifier, settings, temperature=0.8)
    rows = _rows()
    online, metrics = module(_batch(rows))
    full, _ = module(_batch(_with_topk(rows, verifier, V), teacher=True))
    top4, _ = module(_batch(_with_topk(rows, verifier, 4), teacher=True))
    assert "divergence" in metrics and online.item() > 0
    torch.testing.assert_close(full, online, rtol=1e-4, atol=1e-5)
    assert top4.item() < online.item() - 1e-3
    # the online teacher runs only for the losses that read it
    monkeypatch.setattr(DFlashTrainModule, "_teacher_logits", lambda *a: pytest.fail("teacher for a CE loss"))
    module.settings = LossSettings(name="ce_streak")
    module(_batch(rows))


def test_refusals_name_the_fix():
    verifier = _verifier()
    with pytest.raises(ValueError, match=r"call drafter.share\(verifier\)"):
        DFlashTrainModule(DFlashModel(_drafter(verifier).dflash), verifier, LossSettings(name="dflash_ce"))
    with pytest.raises(ValueError, match="another model's embedding"):
        DFlashTrainModule(_drafter(_verifier(seed=3)), verifier, LossSettings(name="dflash_ce"))
    module = DFlashTrainModule(_drafter(verifier, block=4), verifier, LossSettings(name="dflash_ce"))
    with pytest.raises(ValueError, match=r"4 slots wide .* gamma=3"):
        module(_batch(_rows()))


# ---------------------------------------------------------------------------------------------------------------
# dflash_ce against its formula

N, G, HH, VV = 4, 6, 8, 23
VALID_LEN = [6, 4, 1, 0]  # the last window has no valid slot


def _ce_case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, G, HH, generator=g)
    weight = torch.randn(VV, HH, generator=g) * 0.7
    valid = torch.tensor([[j < n for j in range(G)] for n in VALID_LEN])
    labels = torch.where(valid, torch.randint(0, VV, (N, G), generator=g), -100)  # junk at invalid slots
    return hidden, weight, labels, valid


def _dflash_ce(hidden, weight, labels, valid, decay_gamma=3.0, temperature=0.7):
    inp = LossInput(hidden, weight, labels, valid, temperature=temperature)
    return compute_loss(inp, LossSettings(name="dflash_ce", decay_gamma=decay_gamma, chunk=7))


def test_dflash_ce_equals_the_weighted_mean_of_the_slot_cross_entropies():
    hidden, weight, labels, valid = _ce_case()
    out = _dflash_ce(hidden, weight, labels, valid)
    logp = torch.log_softmax(hidden.double() @ weight.double().T / 0.7, -1)
    total, weights = 0.0, 0.0
    for n in range(N):
        for k in range(1, G + 1):  # slot k, 1-based
            if valid[n, k - 1]:
                w = torch.exp(torch.tensor(-(k - 1) / 3.0, dtype=torch.float64))
                total -= w * logp[n, k - 1, labels[n, k - 1]]
                weights += w
    assert out.loss.item() == pytest.approx(float(total / weights), rel=1e-5)
    expce = compute_loss(LossInput(hidden, weight, labels, valid), LossSettings(name="expce"))
    assert set(out.metrics) == set(expce.metrics)  # the metrics every loss reports


def test_dflash_ce_weights_decay_per_slot_and_invalid_slots_contribute_nothing():
    hidden, weight, labels, valid = _ce_case(1)
    h = hidden.clone().requires_grad_(True)
    _dflash_ce(h, weight, labels, valid).loss.backward()
    # d loss / d h[n, k] = -w_k / Σw * d ℓ[n, k] / d h[n, k]: read w_k off the ratio, window 0 (all valid)
    ell_leaf = hidden.clone().requires_grad_(True)
    safe = torch.where(valid, labels, 0)
    naive_logprobs(ell_leaf[0], weight, safe[0, :, None], temperature=0.7).sum().backward()
    ratio = (h.grad[0] * ell_leaf.grad[0]).sum(-1) / (ell_leaf.grad[0] ** 2).sum(-1)  # -w_k / Σw
    k = torch.arange(G, dtype=torch.float32)
    want = torch.exp(-k / 3.0)
    total = sum(want[: int(n)].sum() for n in VALID_LEN)
    torch.testing.assert_close(-ratio, want / total, rtol=1e-4, atol=1e-7)
    assert (h.grad[~valid] == 0).all()
    # other hidden states and labels at the invalid slots change nothing
    junk_h, junk_labels = hidden.clone(), labels.clone()
    junk_h[~valid] = torch.randn(int((~valid).sum()), HH) * 10
    junk_labels[~valid] = 5
    a = _dflash_ce(hidden, weight, labels, valid).loss
    b = _dflash_ce(junk_h, weight, junk_labels, valid).loss
    assert a.item() == pytest.approx(b.item(), rel=1e-6)
    # no valid slot at all: 0, not NaN; a non-positive decay is refused with the setting's name
    none = _dflash_ce(hidden, weight, labels, torch.zeros_like(valid)).loss
    assert none.item() == 0.0
    with pytest.raises(ValueError, match="method.decay_gamma"):
        _dflash_ce(hidden, weight, labels, valid, decay_gamma=0.0)
    assert "dflash_ce" in LOSSES


# ---------------------------------------------------------------------------------------------------------------
# A short training run raises the real decoder's accepted streak


def test_training_raises_the_accepted_streak_against_the_verifier():
    """A tiny random verifier's own greedy continuations as the trajectories; 40 AdamW steps of dflash_ce on them
    take the drafter's accepted tokens per cycle (the real decoder, greedy, held-out prompts) from about zero to a
    clear fraction of a token (0.34 to 0.58 over five verifier seeds when this test was written)."""
    vocab = 32
    verifier = Transformer(tiny_config("qwen2", vocab_size=vocab)).init_weights(seed=0, std=0.1).eval()
    g = torch.Generator().manual_seed(0)

    def prompts(n):
        lengths = torch.randint(2, 7, (n,), generator=g).tolist()
        return [torch.randint(0, vocab - 1, (m,), generator=g).tolist() for m in lengths]

    train, held_out = prompts(48), prompts(16)
    continuations = generate(verifier, train, SpecConfig(max_new_tokens=24)).tokens
    dataset = datasets.Dataset.from_dict({"prompt_ids": train, "completion_ids": continuations})
    shapes = TransformerConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2,
        family="qwen3", qk_norm=True, attention="full",
    )  # fmt: skip
    cfg = DFlashConfig(layers=shapes, target_layer_ids=(1, 2), block_size=4, mask_token_id=vocab - 1)
    drafter = DFlashModel(cfg).init_weights(seed=1).share(verifier)

    def accepted_per_cycle() -> float:
        drafter.eval()
        decoder = DFlashDrafter(drafter, temperature=1.0, top_k=None)
        res = generate(verifier, held_out, SpecConfig(max_new_tokens=24, gamma=3), drafter=decoder)
        drafter.train()
        return res.metrics.accepted_per_cycle

    before = accepted_per_cycle()
    module = DFlashTrainModule(drafter, verifier, LossSettings(name="dflash_ce"))
    opt = torch.optim.AdamW(module.parameters(), lr=3e-3)
    windows = TrajectoryWindows(dataset, gamma=3, mask_id=vocab - 1, windows_per_seq=8, seed=0)
    for _, batch in zip(range(40), windows.batches(16), strict=False):
        loss, _ = module(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = accepted_per_cycle()
    assert after > before + 0.2, (before, after)


# ------------------------------------------------------------------------------------------- a draft vocabulary
def test_labels_outside_a_draft_vocabulary_end_a_streak_or_drop_one_slot():
    """A slot whose label the draft vocabulary lacks (q = 0 there) carries no term; the streak-product losses also
    weigh nothing after it (no streak passes it), the others keep the later slots."""
    from streakline.alignment.dflash import draft_labels
    from streakline.models.draft_vocab import DraftVocab

    vocab = DraftVocab(torch.tensor([2, 5, 7, 9]), V)
    labels = torch.tensor([[5, 3, 7, 9], [9, 7, 5, 2]])  # 3 is outside
    valid = torch.tensor([[True, True, True, True], [True, True, True, False]])
    for loss in ("ce_streak", "streak", "dpace"):
        ids, keep = draft_labels(vocab, labels, valid, loss)
        assert keep.tolist() == [[True, False, False, False], [True, True, True, False]], loss
        assert ids[0, 0] == 1 and ids[1].tolist()[:3] == [3, 2, 1]  # draft ids: positions in the sorted ids
    ids, keep = draft_labels(vocab, labels, valid, "dflash_ce")
    assert keep.tolist() == [[True, False, True, True], [True, True, True, False]]
    assert vocab.to_target(ids[keep]).tolist() == labels[keep].tolist()


@pytest.mark.parametrize("loss", ["ce_streak", "dflash_ce"])
def test_training_over_a_draft_vocabulary_reads_its_own_head_and_labels(loss):
    """The module's loss over a draft vocabulary is the loss of the drafter's slot states on its N-row head with the
    labels ``draft_labels`` gives; its gradients reach every trained parameter and never the frozen head."""
    from streakline.alignment.dflash import draft_labels, slot_hidden
    from streakline.models.draft_vocab import DraftVocab, count_tokens

    verifier = _verifier()
    rows = _rows()
    vocab = DraftVocab.from_counts(count_tokens(rows["completion_ids"], V), 30, keep=[MASK])
    drafter = _drafter(verifier).use_vocab(vocab)
    module = DFlashTrainModule(drafter, verifier, LossSettings(name=loss, chunk=13), temperature=0.8)
    assert module.external_parameters() == [drafter.lm_head.weight]  # read outside its forward: ZeRO-3 gathers it
    batch = _batch(rows)
    got, _ = module(batch)
    _, slots = slot_hidden(drafter, verifier, batch.clean, batch.offsets, batch.pad_valid)
    keep = batch.window_valid.flatten()
    labels, valid = draft_labels(vocab, batch.labels.flatten(0, 1)[keep], batch.valid.flatten(0, 1)[keep], loss)
    assert not bool(valid.all()) and bool(valid.any())  # some labels fell outside, some inside
    want = compute_loss(
        LossInput(slots.flatten(0, 1)[keep], verifier.output_weight[vocab.ids], labels, valid, temperature=0.8),
        LossSettings(name=loss, chunk=13),
    ).loss
    torch.testing.assert_close(got, want)
    got.backward()
    assert drafter.lm_head.weight.grad is None and not drafter.lm_head.weight.requires_grad
    for name, p in drafter.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and bool(p.grad.abs().sum() > 0), name
