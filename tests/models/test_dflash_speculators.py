"""Interoperability with the ``speculators`` package (the reference DFlash implementation vLLM serves): its
``DFlashDraftModel`` loads our export and drafts the same logits as ``DFlashModel``, and a checkpoint it writes loads
into ``load_dflash`` with the same logits.

``speculators`` comes from ``tests/speculators_env.py``: installed from PyPI on first use into a cache folder, never
into the project's environment (the tests are skipped without access to the package index), and run in a subprocess
so none of its imports or registrations reach this process.

Measured on 2 shared CPU cores: the install about 4 s (3 MB downloaded, 33 MB on disk), then about 10 s for both
tests (one speculators process for both directions, mostly its imports).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from streakline.models import Transformer, TransformerConfig, save_pretrained
from streakline.models.dflash import DFlashConfig, DFlashModel, block_inputs, packed_blocks
from streakline.models.dflash_checkpoint import load_dflash, save_dflash
from streakline.models.draft_vocab import DraftVocab
from tests.speculators_env import run_under_speculators, speculators_folder

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

V, H = 97, 32
TARGET_LAYERS = 4
AUX = (1, 3, 4)  # 4 = the verifier's last layer (its output before the final norm)
BLOCK = 4
MASK = V - 1
SEQ = 20
ANCHORS = (0, 5, 11)  # < SEQ - BLOCK: speculators draws anchors only there; 0 = a block without context
VOCAB_N = 40  # a draft vocabulary of 40 of the 97 tokens


@pytest.fixture(scope="module")
def speculators_path() -> Path:
    """A folder holding speculators (and the extras its import needs), installed from PyPI once and reused."""
    return speculators_folder()


# The script run under speculators (its own process). It reads a job file (JSON) and:
#   "load":   DFlashDraftModel.from_pretrained(folder) -- reads config.json and model.safetensors, then
#             load_verifier_weights() copies embed_tokens / lm_head / model.norm from the folder named by
#             speculators_config.verifier.name_or_path -- and saves its logits on the inputs;
#   "create": builds a randomly initialised DFlashDraftModel from a DFlashSpeculatorConfig (qwen3 layers, full
#             attention), fetches the verifier weights the way from_training_args does, saves it with
#             save_pretrained and saves its logits on the inputs.
# The logits come from DFlashDraftModel._backbone_forward: forward() runs the same code and then turns the logits
# into a loss against the verifier's predictions, and the model has no inference entry point (vLLM reimplements the
# drafting). _backbone_forward takes the concatenated aux-layer states hidden_states [1, T, L*H], input_ids [1, T],
# loss_mask, verifier_last_hidden_states (only for the loss targets: zeros here), document_ids (all 0: one document)
# and position_ids (0 .. T-1); it draws max_anchors anchors at random among the positions where loss_mask is 1 (not in
# the last block_size), sorted, and drafts one block [ids[p], MASK x (B-1)] at positions p .. p+B-1 for each, each
# block seeing the context rows before its anchor and its own block (bidirectional). A loss_mask that is 1 exactly at
# our anchors, with max_anchors = their number, makes that draw ours. It returns (hidden, logits [1, n*B, V],
# targets, loss mask, block indices). The attention runs "eager" (a float mask) instead of the default
# "simple_flex_attention", which needs torch.compile to be efficient and is meant for GPUs.
DRIVER = r"""
import json
import sys

import torch
from safetensors.torch import load_file, save_file

from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

torch.set_num_threads(1)
ATTENTION = "eager"


def logits_of(model, inputs):
    model.eval()
    feats, ids, anchors = inputs["hidden_states"], inputs["input_ids"], inputs["anchors"]
    T = ids.shape[1]
    loss_mask = torch.zeros(1, T, dtype=torch.long)
    loss_mask[0, anchors] = 1
    with torch.no_grad():
        _, logits, _, _, indices = model._backbone_forward(
            hidden_states=feats,
            input_ids=ids,
            loss_mask=loss_mask,
            verifier_last_hidden_states=torch.zeros(1, T, model.config.transformer_layer_config.hidden_size),
            document_ids=torch.zeros(1, T, dtype=torch.long),
            position_ids=torch.arange(T)[None],
            max_anchors=anchors.numel(),
        )
    expected = (anchors[:, None] + torch.arange(model.block_size)).reshape(-1)
    assert torch.equal(indices, expected), (indices, expected)  # the blocks drafted are the ones asked for
    return logits.contiguous()


def load(job, inputs):
    config = DFlashSpeculatorConfig.from_pretrained(job["folder"])
    config.transformer_layer_config._attn_implementation = ATTENTION
    model = DFlashDraftModel.from_pretrained(job["folder"], config=config)
    assert model._attn_impl == ATTENTION, model._attn_impl
    return logits_of(model, inputs)


def create(job, inputs):
    from transformers import Qwen3Config

    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    s = job["shapes"]
    layers = Qwen3Config(
        vocab_size=s["vocab_size"], hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
        num_hidden_layers=s["num_layers"], num_attention_heads=s["num_heads"], num_key_value_heads=s["num_kv_heads"],
        head_dim=s["head_dim"], rms_norm_eps=s["rms_norm_eps"], max_position_embeddings=s["max_position_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": s["rope_theta"]},
        layer_types=["full_attention"] * s["num_layers"], tie_word_embeddings=False,
    )
    layers._attn_implementation = ATTENTION
    config = DFlashSpeculatorConfig(
        transformer_layer_config=layers,
        draft_vocab_size=s["vocab_size"],
        block_size=job["block_size"],
        mask_token_id=job["mask_token_id"],
        aux_hidden_state_layer_ids=job["aux_hidden_state_layer_ids"],
        speculators_config=SpeculatorsConfig(
            algorithm="dflash",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=job["block_size"] - 1)],
            default_proposal_method="greedy",
            verifier=VerifierConfig.from_pretrained(job["verifier"]),
        ),
    )
    model = DFlashDraftModel(config)
    gen = torch.Generator().manual_seed(job["seed"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.split(".")[0] in ("embed_tokens", "lm_head", "verifier_lm_head", "verifier_norm"):
                continue  # the verifier's, loaded below
            noise = torch.randn(p.shape, generator=gen) * 0.2
            p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
    model.load_verifier_weights()
    model.save_pretrained(job["folder"])
    return logits_of(model, inputs)


jobs = json.loads(open(sys.argv[1]).read())
for job in jobs:
    inputs = load_file(job["inputs"])
    logits = {"load": load, "create": create}[job["kind"]](job, inputs)
    save_file({"logits": logits}, job["out"])
"""


def _verifier(seed: int = 0) -> Transformer:
    cfg = TransformerConfig(
        vocab_size=V, hidden_size=H, intermediate_size=64, num_layers=TARGET_LAYERS, num_heads=4, num_kv_heads=2,
        head_dim=12, rope_theta=5000.0, rms_norm_eps=1e-5, family="qwen3", qk_norm=True, tie_embeddings=False,
    )  # fmt: skip
    model = Transformer(cfg).init_weights(seed=seed).eval()
    with torch.no_grad():  # a final norm that is not all ones: speculators loads it too (for its loss targets)
        model.norm.weight.add_(0.1 * torch.randn(H, generator=torch.Generator().manual_seed(seed)))
    return model


def _drafter_shapes() -> TransformerConfig:
    # head_dim 12 != hidden / heads, rope_theta and eps not the defaults: a lost value shows in the logits
    return TransformerConfig(
        vocab_size=V, hidden_size=H, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=12,
        rope_theta=5000.0, rms_norm_eps=1e-5, max_position_embeddings=256, family="qwen3", qk_norm=True,
        attention="full", tie_embeddings=False,
    )  # fmt: skip


def _our_drafter(verifier: Transformer, seed: int = 1) -> DFlashModel:
    cfg = DFlashConfig(layers=_drafter_shapes(), target_layer_ids=AUX, block_size=BLOCK, mask_token_id=MASK)
    model = DFlashModel(cfg).init_weights(seed=seed, std=0.2)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():  # norms away from 1, each different: a swapped or dropped norm shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return model.share(verifier).eval()


def _our_logits(drafter: DFlashModel, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    anchors = torch.tensor([ANCHORS])
    block_ids, block_pos, mask = packed_blocks(ids, anchors, BLOCK, MASK)
    with torch.no_grad():
        return drafter(block_ids, block_pos, features=feats, feature_pos=torch.arange(SEQ)[None], attn_mask=mask)


def _tokenizer(folder):
    """Any real tokenizer: what the export records of it is all that matters here."""
    from streakline.data.corpora.math import math_texts
    from streakline.data.tokenizer import train_tokenizer
    from streakline.models.tokenizer import load_tokenizer

    texts = [r["text"] for r in math_texts("train", 100, seed=0)]
    return load_tokenizer(train_tokenizer(texts, folder, vocab_size=280))


@pytest.fixture(scope="module")
def speculators_run(speculators_path, tmp_path_factory):
    """Both directions in one speculators process (its import is most of the time): our export loaded by
    speculators, and a drafter speculators creates and saves. Returns the folders, inputs and logits."""
    root = tmp_path_factory.mktemp("speculators")
    verifier = _verifier()
    save_pretrained(verifier, root / "verifier")
    ours = _our_drafter(verifier)
    # with the tokenizer record beside speculators' keys (dflash_checkpoint.TOKENIZER_FIELD), which it must ignore
    save_dflash(ours, root / "ours", verifier_name=str(root / "verifier"), verifier_architecture="Qwen3ForCausalLM",
                tokenizer=_tokenizer(root / "tokenizer"))  # fmt: skip
    # the same drafter over a draft vocabulary of 40 tokens (the mask among them), exported with its maps
    reduced = _our_drafter(verifier).use_vocab(DraftVocab.from_counts(torch.arange(V) % 7, VOCAB_N, keep=[MASK]))
    save_dflash(reduced, root / "vocab", verifier_name=str(root / "verifier"), verifier_architecture="Qwen3ForCausalLM")

    ids = torch.randint(0, V - 1, (1, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        feats = verifier.hidden(ids, aux_layers=AUX)[1].contiguous()
    save_file({"hidden_states": feats, "input_ids": ids, "anchors": torch.tensor(ANCHORS)}, root / "inputs.safetensors")

    s = _drafter_shapes()
    shapes = {k: getattr(s, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                                         "num_kv_heads", "head_dim", "rms_norm_eps", "rope_theta",
                                         "max_position_embeddings")}  # fmt: skip
    jobs = [
        {"kind": "load", "folder": str(root / "ours"), "inputs": str(root / "inputs.safetensors"),
         "out": str(root / "load.safetensors")},
        {"kind": "load", "folder": str(root / "vocab"), "inputs": str(root / "inputs.safetensors"),
         "out": str(root / "vocab.safetensors")},
        {"kind": "create", "folder": str(root / "theirs"), "inputs": str(root / "inputs.safetensors"),
         "out": str(root / "create.safetensors"), "shapes": shapes, "block_size": BLOCK, "mask_token_id": MASK,
         "aux_hidden_state_layer_ids": list(AUX), "verifier": str(root / "verifier"), "seed": 3},
    ]  # fmt: skip
    (root / "jobs.json").write_text(json.dumps(jobs))
    (root / "driver.py").write_text(DRIVER)
    run_under_speculators(speculators_path, root / "driver.py", str(root / "jobs.json"), cwd=root)
    return {
        "root": root,
        "verifier": verifier,
        "ours": ours,
        "reduced": reduced,
        "ids": ids,
        "feats": feats,
        "load": load_file(root / "load.safetensors")["logits"],
        "vocab": load_file(root / "vocab.safetensors")["logits"],
        "create": load_file(root / "create.safetensors")["logits"],
    }


def test_speculators_loads_our_export_with_the_same_logits(speculators_run):
    run = speculators_run
    ours = _our_logits(run["ours"], run["ids"], run["feats"])
    theirs = run["load"]
    assert theirs.shape == ours.shape == (1, len(ANCHORS) * BLOCK, V)
    diff = (theirs - ours).abs().max().item()
    print(f"speculators vs ours, our export: max |diff| {diff:.3g}")
    assert diff < 1e-4
    # the context mattered: a block past 0 drafted without its context gives other logits
    a = ANCHORS[1]
    with torch.no_grad():
        blind = run["ours"](block_inputs(run["ids"][:, a], BLOCK, MASK), torch.arange(a, a + BLOCK)[None])
    assert (theirs[0, BLOCK : 2 * BLOCK] - blind[0]).abs().max() > 1e-2


def test_speculators_loads_a_draft_vocabulary_export_with_the_same_logits(speculators_run):
    """speculators reads ``draft_vocab_size``, the N-row ``lm_head`` and ``t2d``/``d2t`` of our export and drafts
    the same logits over the draft vocabulary."""
    run = speculators_run
    ours = _our_logits(run["reduced"], run["ids"], run["feats"])
    theirs = run["vocab"]
    assert theirs.shape == ours.shape == (1, len(ANCHORS) * BLOCK, VOCAB_N)
    diff = (theirs - ours).abs().max().item()
    print(f"speculators vs ours, draft vocabulary of {VOCAB_N}: max |diff| {diff:.3g}")
    assert diff < 1e-4
    full = _our_logits(run["ours"], run["ids"], run["feats"])  # the same layers over the whole head
    assert torch.allclose(full[..., run["reduced"].draft_vocab.ids], ours, atol=1e-5)


def test_a_speculators_checkpoint_loads_with_the_same_logits(speculators_run):
    run = speculators_run
    folder = run["root"] / "theirs"
    drafter = load_dflash(folder).share(run["verifier"]).eval()
    cfg = drafter.dflash
    assert cfg.target_layer_ids == AUX and cfg.block_size == BLOCK and cfg.mask_token_id == MASK
    assert cfg.verifier == str(run["root"] / "verifier")
    expected = _drafter_shapes()
    for key in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                "rope_theta", "rms_norm_eps"):  # fmt: skip
        assert getattr(cfg.layers, key) == getattr(expected, key), key
    ours = _our_logits(drafter, run["ids"], run["feats"])
    theirs = run["create"]
    diff = (theirs - ours).abs().max().item()
    print(f"speculators vs ours, speculators' checkpoint: max |diff| {diff:.3g}")
    assert diff < 1e-4
    a = ANCHORS[2]
    with torch.no_grad():
        blind = drafter(block_inputs(run["ids"][:, a], BLOCK, MASK), torch.arange(a, a + BLOCK)[None])
    assert (theirs[0, 2 * BLOCK : 3 * BLOCK] - blind[0]).abs().max() > 1e-2
