"""``dpace`` against the ``speculators`` package's own D-PACE: the same logits, labels and masks given to both, the
slot weights, the loss and its gradient must agree to float rounding.

On the speculators side the loss is what ``DFlashDraftModel.forward`` computes for ``--per-position-loss-weight
dpace`` (its default for DFlash since mid-2026): ``speculators.models.dflash.metrics.compute_metrics`` with the
cross-entropy loss (``eager.ce_loss``, the eager form of its default fused kernel, which needs Triton) and D-PACE
weights, on blocks laid out as it lays them out, ``[1, n_blocks * B]`` with the anchor at slot 0 masked out. The
weights themselves come from ``speculators.losses.dpace_loss_decay`` fed the masked per-slot cross-entropy, as its
``loss_function`` feeds it. On our side the loss gets the drafted slots' logits as ``hidden`` with an identity
output matrix, so ``hidden @ weight.T`` is those logits exactly and their gradient is the logits' gradient.

``speculators`` comes from ``tests/speculators_env.py`` (installed from PyPI on first use into a cache folder; the
test is skipped without access to the package index) and runs in its own process.

    python -m pytest -q tests/alignment/test_dpace_speculators.py    # about 10 s on 2 cores, mostly its imports
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from streakline.alignment.losses import LossInput, LossSettings, compute_loss, dpace_weights
from tests.speculators_env import run_under_speculators, speculators_folder

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

V = 11
B = 6  # block size: the anchor and G = 5 drafted slots
G = B - 1
LENGTHS = [5, 3, 1, 0, 4]  # valid drafted slots per block (a prefix, as the windows give them); one block has none
ALPHAS = [0.5, 0.25, 1.0, 0.0]  # 0.5 is both sides' default; speculators' CLI refuses 0, its function takes it
HOLED = [True, True, False, True, True]  # block 0's drafted slots with a hole at slot 3
CUT = [True, True, False, False, False]  # the same cut at the hole

DRIVER = r"""
import json
import sys
from functools import partial

import torch
from safetensors.torch import load_file, save_file

from speculators.losses import dpace_loss_decay, eager
from speculators.models.dflash.metrics import compute_metrics

torch.set_num_threads(1)
job = json.loads(open(sys.argv[1]).read())
inputs = load_file(job["inputs"])
B = job["block_size"]
out = {}
for i, alpha in enumerate(job["alphas"]):
    logits = inputs["logits"].clone().requires_grad_(True)
    loss, _ = compute_metrics(
        logits, inputs["targets"], inputs["loss_mask"], block_size=B,
        loss_config={"ce": (eager.ce_loss, 1.0)}, per_position_loss_weight="dpace", dpace_alpha=alpha,
    )
    loss.backward()
    out[f"loss.{i}"] = loss.detach().reshape(1)
    out[f"grad.{i}"] = logits.grad
for name in ("loss_mask", "holed_mask", "cut_mask"):
    mask = inputs[name]
    with torch.no_grad():
        ce = eager.ce_loss(inputs["logits"], inputs["targets"]) * mask.float()  # as loss_function hands it on
        pos = (torch.arange(mask.shape[1]) % B)[None].float()
        for i, alpha in enumerate(job["alphas"]):
            decay = partial(dpace_loss_decay, loss_mask=mask, block_size=B, dpace_alpha=alpha)
            out[f"weights.{name}.{i}"] = decay(pos, elementwise_loss=ce)
    out[f"ce.{name}"] = ce
save_file(out, job["out"])
"""


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = len(LENGTHS)
    logits = torch.randn(n, B, V, generator=g) * 2.0
    labels = torch.randint(0, V, (n, B), generator=g)
    valid = torch.tensor([[j < k for j in range(G)] for k in LENGTHS])
    holed, cut = valid.clone(), valid.clone()
    holed[0], cut[0] = torch.tensor(HOLED), torch.tensor(CUT)
    anchor = torch.zeros(n, 1, dtype=torch.bool)  # slot 0 is the anchor: never a prediction
    return {
        "logits": logits,
        "labels": labels,
        "valid": valid,
        "holed": holed,
        "cut": cut,
        # speculators' ce_loss takes its labels as the argmax of the verifier's logits
        "targets": torch.nn.functional.one_hot(labels, V).float() * 10.0,
        "loss_mask": torch.cat([anchor, valid], 1).long(),
        "holed_mask": torch.cat([anchor, holed], 1).long(),
        "cut_mask": torch.cat([anchor, cut], 1).long(),
    }


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """Our inputs and what speculators computed from them."""
    folder = speculators_folder()
    root = tmp_path_factory.mktemp("dpace_speculators")
    inp = _inputs()
    flat = {"logits": inp["logits"].reshape(1, -1, V), "targets": inp["targets"].reshape(1, -1, V)}
    flat |= {k: inp[k].reshape(1, -1) for k in ("loss_mask", "holed_mask", "cut_mask")}
    save_file(flat, root / "inputs.safetensors")
    job = {"inputs": str(root / "inputs.safetensors"), "out": str(root / "out.safetensors"), "block_size": B,
           "alphas": ALPHAS}  # fmt: skip
    (root / "job.json").write_text(json.dumps(job))
    (root / "driver.py").write_text(DRIVER)
    run_under_speculators(folder, root / "driver.py", str(root / "job.json"), cwd=root)
    return inp, load_file(root / "out.safetensors")


def _drafted(x: torch.Tensor) -> torch.Tensor:
    """speculators' ``[1, n * B, ...]`` -> ``[n, G, ...]``: the drafted slots, the anchor column dropped."""
    return x.reshape(len(LENGTHS), B, *x.shape[2:])[:, 1:]


@pytest.mark.parametrize("i", range(len(ALPHAS)))
def test_weights_equal_speculators(both, i):
    inp, theirs = both
    ce = _drafted(theirs["ce.loss_mask"])
    ours = dpace_weights(torch.exp(-ce), inp["valid"], ALPHAS[i])
    want = _drafted(theirs[f"weights.loss_mask.{i}"])
    print(f"alpha {ALPHAS[i]}: max |weight diff| {(ours - want).abs().max().item():.3g}")
    torch.testing.assert_close(ours, want, rtol=1e-6, atol=1e-7)
    assert (want[~inp["valid"]] == 0).all() and (want[inp["valid"]] > 0).all()  # the comparison is not vacuous


@pytest.mark.parametrize("i", range(len(ALPHAS)))
def test_loss_and_gradient_equal_speculators(both, i):
    inp, theirs = both
    hidden = inp["logits"][:, 1:].clone().requires_grad_(True)
    out = compute_loss(
        LossInput(hidden, torch.eye(V), inp["labels"][:, 1:], inp["valid"], temperature=1.0),
        LossSettings(name="dpace", dpace_alpha=ALPHAS[i], chunk=4),  # several chunks over V = 11, the last short
    )
    out.loss.backward()
    # speculators divides by the valid slots + 1e-5, we by the valid slots: a relative 1e-5 / 13 apart
    assert out.loss.item() == pytest.approx(theirs[f"loss.{i}"].item(), rel=1e-5)
    grad = theirs[f"grad.{i}"][0].reshape(len(LENGTHS), B, V)
    assert (grad[:, 0] == 0).all()  # the anchor slot has no loss there either
    print(f"alpha {ALPHAS[i]}: max |grad diff| {(hidden.grad - grad[:, 1:]).abs().max().item():.3g}")
    torch.testing.assert_close(hidden.grad, grad[:, 1:], rtol=1e-4, atol=1e-7)


def test_a_hole_ends_our_products_where_speculators_bridges_it(both):
    """The one documented difference, on masks no caller here produces (windows' valid slots form a prefix):
    speculators gives a masked slot inside a block a factor of 1 and carries the product on past it; ours stops at
    the first invalid slot, as the streak losses do. So our weights for a holed block are speculators' for the same
    block cut at the hole."""
    inp, theirs = both
    ours = dpace_weights(torch.exp(-_drafted(theirs["ce.holed_mask"])), inp["holed"], 0.5)
    torch.testing.assert_close(ours, _drafted(theirs["weights.cut_mask.0"]), rtol=1e-6, atol=1e-7)
    bridged = _drafted(theirs["weights.holed_mask.0"])[0]
    assert (ours[0, 2:] == 0).all() and (bridged[3:] > 0).all()
    assert (bridged[:2] > ours[0, :2]).all()  # the slots past the hole add to the earlier slots' sums there
