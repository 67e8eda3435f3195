"""stage=decode on the micro world: every decoder prints text and a last JSON line; T=0 outputs agree; bad input
gets a message naming the fix."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from streakline.config import ConfigError, compose_config
from streakline.models.checkpoint import CheckpointError
from streakline.pipelines import run_stage
from streakline.world import attach_world

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Sam has 3 apples."


@pytest.fixture(scope="module")
def world_root(micro_world):
    return micro_world[0]


def _decode(root, *overrides):
    cfg = compose_config(["stage=decode", "model=micro", f"run_root={root}", "decoder.max_new_tokens=12", *overrides])
    return run_stage(cfg).details["line"]


def test_every_decoder_prints_text_and_a_json_line(world_root, capsys):
    lines = {}
    for decoder in ("vanilla", "ar_draft", "diffusion_draft", "ngram", "threshold"):
        extra = ["decoder.K=2"] if decoder == "diffusion_draft" else []
        result = _decode(world_root, f"decoder={decoder}", f"prompt={PROMPT}", *extra)
        out = capsys.readouterr().out.strip().splitlines()
        last = json.loads(out[-1])
        assert last == json.loads(json.dumps(result))
        assert out[0].startswith(PROMPT)
        assert 1 <= len(last["token_ids"]) <= 12 and last["nfe"] >= 1
        lines[decoder] = last
    # lossless at temperature 0: the speculative decoders reproduce the verifier's greedy output
    assert lines["ar_draft"]["token_ids"] == lines["vanilla"]["token_ids"]
    assert lines["diffusion_draft"]["token_ids"] == lines["vanilla"]["token_ids"]
    assert lines["ngram"]["token_ids"] == lines["vanilla"]["token_ids"]
    assert lines["ngram"]["drafter_forwards"] == 0  # prompt lookup runs no model
    assert lines["vanilla"]["tokens_per_verifier_call"] == 1.0
    assert len(lines["diffusion_draft"]["alpha"]) == 4  # the micro drafter's gamma


def test_prompt_ids_and_a_transformers_saved_verifier(world_root, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    first = _decode(world_root, "decoder=vanilla", "prompt_ids=[5,6,7,8]")
    capsys.readouterr()
    cfg = attach_world(compose_config(["stage=decode", "model=micro", f"run_root={world_root}", "prompt=x"]), False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(cfg.model.verifier.path)
    hf.save_pretrained(tmp_path / "hf")  # a folder written by transformers itself, not by us
    again = _decode(
        world_root, "decoder=diffusion_draft", "prompt_ids=[5,6,7,8]", f"model.verifier.path={tmp_path / 'hf'}"
    )
    assert again["token_ids"] == first["token_ids"]


def test_bad_input_is_refused_with_the_fix(world_root):
    with pytest.raises(ConfigError, match="exactly one of"):
        _decode(world_root, "decoder=vanilla")
    with pytest.raises(ConfigError, match="vocabulary"):
        _decode(world_root, "decoder=vanilla", "prompt_ids=[1,99999]")
    with pytest.raises(ConfigError, match="multidraft_leviathan"):
        _decode(
            world_root, "decoder=diffusion_draft", "prompt=x", "decoder.temperature=1", "decoder.acceptance=leviathan"
        )
    with pytest.raises(CheckpointError, match="stage=spot"):
        _decode(world_root, "decoder=spot", "prompt=x")


TYPED = 'Sam said: "f(x) = a, b" [ok]?\nThen {it} ended.'  # Hydra's grammar would need most of this escaped


def test_a_prompt_from_a_file_or_standard_input_is_taken_as_written(world_root, tmp_path):
    """``prompt_file`` and ``prompt=-`` read text Hydra could not take as ``prompt=`` without escapes, newline
    included, and decode exactly what its token ids decode; a BOM is dropped, and standard input's one trailing
    newline (echo's)."""
    from streakline.pipelines.common.prompts import encode
    from streakline.pipelines.common.roles import role_tokenizer

    cfg = attach_world(compose_config(["stage=decode", "model=micro", f"run_root={world_root}", "prompt=x"]), False)
    ids = encode(role_tokenizer(cfg, "verifier"), TYPED)
    want = _decode(world_root, "decoder=vanilla", f"prompt_ids=[{','.join(map(str, ids))}]")["token_ids"]
    (tmp_path / "prompt.txt").write_bytes(b"\xef\xbb\xbf" + TYPED.encode())  # a BOM: a Windows editor's
    got = _decode(world_root, "decoder=vanilla", f"prompt_file={tmp_path / 'prompt.txt'}", "data.chat_template=false")
    assert got["token_ids"] == want
    proc = subprocess.run(
        [sys.executable, "launch.py", "stage=decode", "model=micro", f"run_root={world_root}", "decoder=vanilla",
         "decoder.max_new_tokens=12", "data.chat_template=false", "prompt=-"],
        cwd=ROOT, input=TYPED + "\n", capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["token_ids"] == want
    assert proc.stdout.startswith(TYPED)  # the prompt as read, then its continuation


CODE = 'def add(a, b):\n    """Return the sum of a and b."""\n'  # a HumanEval-style prompt: it ends in a newline


def test_a_prompt_file_keeps_a_code_prompts_final_newline(world_root, tmp_path, monkeypatch):
    """``prompt_file`` decodes the file's text exactly, final newline included (the continuation of a code prompt
    depends on it); ``prompt=-`` with the file on standard input is the way to drop it."""
    import io

    from streakline.pipelines.common.prompts import encode
    from streakline.pipelines.common.roles import role_tokenizer

    cfg = attach_world(compose_config(["stage=decode", "model=micro", f"run_root={world_root}", "prompt=x"]), False)
    tokenizer = role_tokenizer(cfg, "verifier")
    kept, dropped = encode(tokenizer, CODE), encode(tokenizer, CODE.removesuffix("\n"))
    assert kept != dropped  # the newline is a token of the prompt
    (tmp_path / "prompt.py").write_text(CODE, newline="")
    args = ["stage=decode", "model=micro", f"run_root={world_root}", "decoder.max_new_tokens=12", "decoder=vanilla",
            "data.chat_template=false"]  # fmt: skip
    got = run_stage(compose_config([*args, f"prompt_file={tmp_path / 'prompt.py'}"]))
    assert got.details["prompt"] == CODE
    want = run_stage(compose_config([*args, f"prompt_ids=[{','.join(map(str, kept))}]"]))
    assert got.details["line"]["token_ids"] == want.details["line"]["token_ids"]
    monkeypatch.setattr(sys, "stdin", io.StringIO(CODE))
    piped = run_stage(compose_config([*args, "prompt=-"]))
    assert piped.details["prompt"] == CODE.removesuffix("\n")  # standard input drops one, as $(cat file) would


def test_a_prompt_file_that_cannot_serve_is_refused_with_the_fix(world_root, tmp_path):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "blank.txt").write_text(" \n\n")
    for overrides, match in (
        ([f"prompt_file={tmp_path / 'missing.txt'}"], "cannot read it"),
        ([f"prompt_file={tmp_path / 'latin1.txt'}"], "is not UTF-8 text .* save it as UTF-8"),
        ([f"prompt_file={tmp_path / 'blank.txt'}"], "holds no prompt text; write the prompt into it"),
        ([f"prompt_file={tmp_path / 'blank.txt'}", "prompt=x"], r"exactly one of .*got \['prompt', 'prompt_file'\]"),
    ):
        with pytest.raises(ConfigError, match=match):
            _decode(world_root, "decoder=vanilla", *overrides)


def test_cli_last_line_is_json(world_root):
    proc = subprocess.run(
        [
            sys.executable,
            "launch.py",
            "stage=decode",
            "model=micro",
            f"run_root={world_root}",
            "decoder=diffusion_draft",
            "decoder.max_new_tokens=6",
            "prompt_ids=[5,6,7]",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(last) >= {"token_ids", "tokens_per_verifier_call", "nfe", "tokens_per_s", "alpha"}
    bad = subprocess.run(
        [
            sys.executable,
            "launch.py",
            "stage=decode",
            "model=micro",
            f"run_root={world_root}",
            "decoder=ar_draft",
            "decoder.K=3",
            "prompt_ids=[5]",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "diffusion_draft" in bad.stderr and "Traceback" not in bad.stderr


def test_a_foreign_checkpoint_decodes_alone_with_its_own_end_of_text(tmp_path):
    """A Qwen2 checkpoint saved by transformers (another vocabulary, no tokenizer, no eos in its config) decoded with
    prompt_ids: no tiny world is built for it, no tokenizer is borrowed, and it continues as transformers does."""
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=311, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, eos_token_id=None, bos_token_id=None,
        initializer_range=0.5,  # weights large enough that greedy output does not repeat one token
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "foreign")
    runs = tmp_path / "runs"
    args = ["stage=decode", "model=tiny", f"run_root={runs}", f"model.verifier.path={tmp_path / 'foreign'}",
            "decoder=vanilla", "prompt_ids=[5,6,7]", "decoder.max_new_tokens=12"]  # fmt: skip
    cfg = compose_config(args)
    out = run_stage(cfg)
    assert not (runs / "world").exists()  # vanilla decoding loads the verifier alone: nothing to build
    assert cfg.model.verifier.tokenizer is None
    with torch.no_grad():
        want = hf.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=12, do_sample=False)[0, 3:].tolist()
    assert out.details["line"]["token_ids"] == want and len(want) == 12
    # the checkpoint's own generation_config.json decides where it stops
    stop = next(i for i in range(1, 12) if want[i] not in want[:i])  # a token the greedy output reaches first at i
    (tmp_path / "foreign" / "generation_config.json").write_text(json.dumps({"eos_token_id": [want[stop], 310]}))
    stopped = run_stage(compose_config(args))
    assert stopped.details["line"]["token_ids"] == want[: stop + 1]  # up to and including its end-of-text


def test_check_decodes_vanilla_too_and_says_they_agree(world_root, capsys):
    """``check=true``: the speculative decode is compared with a vanilla decode of the same prompt, and says so."""
    vanilla = _decode(world_root, "decoder=vanilla", f"prompt={PROMPT}", "precision=fp32")["token_ids"]
    capsys.readouterr()
    line = _decode(
        world_root, "decoder=diffusion_draft", "decoder.K=2", f"prompt={PROMPT}", "precision=fp32", "check=true"
    )
    out = capsys.readouterr().out.strip().splitlines()
    assert line["check"]["vanilla_token_ids"] == vanilla == line["token_ids"]
    assert line["check"]["agrees"] and line["check"]["lossless"] and line["check"]["first_parting"] is None
    assert out[-2] == f"check: agrees with decoder=vanilla token for token ({len(vanilla)} tokens, fp32)"
    assert json.loads(out[-1])["check"] == line["check"]  # the JSON line stays last
    assert "check" not in _decode(world_root, "decoder=ngram", f"prompt={PROMPT}")  # off by default


def test_check_refuses_what_it_cannot_compare(world_root):
    with pytest.raises(ConfigError, match="block-diffusion target.*decoder=static"):
        _decode(world_root, "decoder=threshold", "prompt=x", "check=true")
    with pytest.raises(ConfigError, match="only temperature 0 makes equal"):
        _decode(world_root, "decoder=ngram", "prompt=x", "decoder.temperature=1", "check=true")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_parting_from_vanilla_is_weighed_with_its_gap_and_bound(world_root, dtype):
    """The comparison ``check=true`` runs, on an output that parts from vanilla where it takes the verifier's second
    choice: the parting's index, both ids, the fp32 gap (as computed here by hand), and the bound, 0 in fp32 (no
    allowance) and twice the bf16 logit error in bf16."""
    from streakline.models import build
    from streakline.pipelines.decode import check_line, compare_with_vanilla

    cfg = attach_world(compose_config(["stage=decode", "model=micro", f"run_root={world_root}", "prompt=x"]), False)
    exact = build(cfg.model.verifier, "verifier", inference=True, dtype=torch.float32)
    model = exact if dtype == torch.float32 else build(cfg.model.verifier, "verifier", inference=True, dtype=dtype)
    prompt, common, at = [5, 6, 7, 8], [223, 223, 223], 3  # the two outputs share ``common``, then part
    with torch.no_grad():
        logits = exact(torch.tensor([prompt + common]))[0, -1]
    top, second = logits.topk(2).indices.tolist()
    vanilla = [*common, top, 223]
    check = compare_with_vanilla(model, lambda: exact, prompt, [*common, second, 223], vanilla)
    parting = check["first_parting"]
    assert not check["agrees"] and parting["token"] == at and parting["tokens"] == [second, top]
    assert parting["gap"] == pytest.approx(float(logits[second] - logits[top]), abs=1e-5) and parting["gap"] < 0
    assert parting["bound"] == pytest.approx(2 * parting["eps"])
    assert parting["near_tie"] == (abs(parting["gap"]) <= parting["bound"])
    if dtype == torch.float32:
        assert parting["eps"] == 0 and not check["lossless"]
        assert "fp32 has no near-tie allowance, so this is NOT lossless" in check_line(check, "fp32", None)
    else:
        assert parting["eps"] > 0 and check["lossless"] == parting["near_tie"]
        said = check_line(check, "bf16", None)
        assert f"at new token {at} ({second} against vanilla's {top})" in said
        assert ("a near-tie, which bf16 allows" in said) == parting["near_tie"]
    stopped = compare_with_vanilla(model, lambda: exact, prompt, vanilla[:2], vanilla)  # a prefix: nothing to weigh
    assert stopped["first_parting"]["why"] == "one output is a prefix of the other" and not stopped["lossless"]
