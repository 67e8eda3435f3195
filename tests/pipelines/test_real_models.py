"""The real-model path end to end on CPU: ``stage=pipeline experiment=real model=diffucoder`` with a verifier and a
drafter made by ``transformers`` itself (Qwen2 layouts, their own tokenizer with a chat template), a local
conversations file for training prompts and a local benchmark file for evaluation; no tiny world is built.

    .venv/bin/python -m pytest tests/pipelines/test_real_models.py -q     (about a minute on 2 cores)
"""

import json
from pathlib import Path

import pytest
import torch
import transformers

from streakline.artifacts import read_manifest
from streakline.config import compose_config
from streakline.data import math_texts, train_tokenizer
from streakline.data.trajectories import load_trajectories
from streakline.pipelines import run_stage

pytestmark = pytest.mark.usefixtures("one_thread")

CHATS = [
    [("Tom has 4 pens and buys 3 more.", "He has 7 pens."), ("How many if he gives 2 away?", "5 pens.")],
    [("A box holds 6 eggs. How many in 2 boxes?", "12 eggs.")],
    [("Sara reads 5 pages a day.", "OK."), ("How many pages in 3 days?", "15 pages.")],
    [("What is 9 minus 4?", "5.")],
    [("Add 8 and 7.", "15.")],
    [("A pack has 10 cards. Half are red. How many red?", "5 red cards.")],
]
EVAL = [{"question": "Ben has 2 apples and finds 6 more. How many apples?", "answer": "8"},
        {"question": "A bus has 30 seats and 12 are taken. How many are free?", "answer": "18"}]  # fmt: skip


def _checkpoint(folder: Path, tokenizer, seed: int) -> Path:
    """A small Qwen2 made and saved by transformers, with the tokenizer beside it (as hub checkpoints come)."""
    config = transformers.Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None, initializer_range=0.2, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(seed)
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("real")
    texts = [f"{r['question']}\n{r['solution']}" for r in math_texts("train", 400, seed=0)]
    tokenizer = transformers.AutoTokenizer.from_pretrained(train_tokenizer(texts, tmp / "tokenizer", vocab_size=300))
    verifier = _checkpoint(tmp / "verifier", tokenizer, seed=0)
    drafter = _checkpoint(tmp / "drafter", tokenizer, seed=1)
    rows = [{"messages": [{"role": r, "content": c} for q, a in chat for r, c in (("user", q), ("assistant", a))]}
            for chat in CHATS]  # fmt: skip
    (tmp / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in EVAL))
    args = [
        "stage=pipeline", "experiment=real", "model=diffucoder", f"run_root={tmp / 'runs'}",
        f"model.verifier.path={verifier}", f"model.drafter.path={drafter}",
        "model.verifier.dtype=float32", "model.drafter.dtype=float32", "model.drafter.gamma=4",
        f"data.prompt_sources=[conversations@{tmp / 'chats.jsonl'}]", "data.max_prompts=6",
        "data.samples_per_prompt=1", "data.max_new_tokens=12", "data.num_shards=1", "data.batch_size=6",
        "trainer.max_steps=2", "trainer.save_every=2", "trainer.eval_every=2", "trainer.micro_batch_size=2",
        "trainer.warmup_steps=1", "trainer.windows_per_seq=2", "trainer.wandb_project=null",
        f"trainer.eval_sources=[gsm8k@{tmp / 'gsm8k.jsonl'}]", "trainer.eval_prompts=1",
        f"settings.evaluate.benchmarks=[gsm8k@{tmp / 'gsm8k.jsonl'}]", "settings.evaluate.prompts=2",
        "settings.evaluate.max_new_tokens=8", "settings.evaluate.temperatures=[0.0]", "settings.evaluate.k_grid=[1]",
        "settings.evaluate.drafter_temperature_grid=[1.0]",
    ]  # fmt: skip
    return tmp, tokenizer, run_stage(compose_config(args))


def test_the_pipeline_runs_on_real_checkpoints_without_a_tiny_world(real):
    tmp, _, out = real
    assert [s["stage"] for s in out.details["stages"]] == ["trajectories", "distill", "evaluate"]
    assert not (tmp / "runs" / "world").exists()
    records = json.loads((out.details["report"].folder / "results.json").read_text())["records"]
    assert {"vanilla", "ar_draft", "base", "streak"} <= {r["method"] for r in records}
    assert all(r["lossless"] for r in records) and {r["benchmark"] for r in records} == {"gsm8k"}


def test_trajectories_hold_every_turn_through_the_verifiers_chat_template(real):
    tmp, tokenizer, _ = real
    (folder,) = (tmp / "runs" / "real" / "trajectories").iterdir()
    first = load_trajectories(folder / "shards")[0]
    chat = [{"role": r, "content": c} for q, a in CHATS[0] for r, c in (("user", q), ("assistant", a))][:-1]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert first["prompt_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert read_manifest(folder).status == "complete"


def test_the_distilled_drafter_is_a_drop_in_transformers_checkpoint(real):
    tmp, _, _ = real
    (run,) = (tmp / "runs" / "real" / "distill").iterdir()
    export = run / "drafter"
    source = json.loads((tmp / "drafter" / "config.json").read_text())
    assert json.loads((export / "config.json").read_text()) == source  # every key, nothing rewritten
    assert (export / "tokenizer.json").is_file() and (export / "streakline.json").is_file()
    trained = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp / "drafter").eval()
    ids = torch.tensor([[5, 17, 42, 7]])
    with torch.no_grad():
        assert not torch.equal(trained(ids).logits, base(ids).logits)  # trained, and loadable as the original


def _into_hub_cache(cache: Path, repo_id: str, folder: Path) -> None:
    """Lay ``folder`` out as ``huggingface-cli download repo_id`` leaves it in the hub cache (refs/main -> a
    snapshot), which ``snapshot_download(local_files_only=True)`` resolves."""
    import shutil

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(folder, repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)


def test_hub_presets_resolve_from_the_local_cache_in_every_stage(real, tmp_path):
    """model=diffucoder with no paths: the verifier and drafter (weights and tokenizer) come from the local Hugging
    Face cache, as after huggingface-cli download, through trajectories, distill and evaluate."""
    import os
    import subprocess
    import sys

    tmp, _, _ = real
    cache = tmp_path / "hub"
    _into_hub_cache(cache, "Qwen/Qwen2.5-14B-Instruct", tmp / "verifier")
    _into_hub_cache(cache, "apple/DiffuCoder-7B-Instruct", tmp / "drafter")
    args = [
        "stage=pipeline", "experiment=real", "model=diffucoder", f"run_root={tmp_path / 'runs'}",
        "model.verifier.dtype=float32", "model.drafter.dtype=float32", "model.drafter.gamma=4",
        f"data.prompt_sources=[conversations@{tmp / 'chats.jsonl'}]", "data.max_prompts=3", "data.max_new_tokens=8",
        "data.num_shards=1", "trainer.max_steps=1", "trainer.save_every=1", "trainer.eval_every=1",
        "trainer.micro_batch_size=2", "trainer.warmup_steps=1", "trainer.windows_per_seq=2",
        "trainer.wandb_project=null",
        f"trainer.eval_sources=[gsm8k@{tmp / 'gsm8k.jsonl'}]", "trainer.eval_prompts=1",
        f"settings.evaluate.benchmarks=[gsm8k@{tmp / 'gsm8k.jsonl'}]", "settings.evaluate.prompts=1",
        "settings.evaluate.max_new_tokens=6", "settings.evaluate.temperatures=[0.0]", "settings.evaluate.k_grid=[1]",
        "settings.evaluate.drafter_temperature_grid=[1.0]",
    ]  # fmt: skip
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(root / "launch.py"), *args], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = (tmp_path / "runs" / "real" / "distill").iterdir()
    assert json.loads((run / "drafter" / "streakline.json").read_text())["source"].startswith(str(cache))
    assert (run / "drafter" / "tokenizer.json").is_file()  # the cached drafter's tokenizer went with the export
    # without the cache, the same command names the download
    env["HF_HUB_CACHE"] = str(tmp_path / "empty")
    missing = subprocess.run([sys.executable, str(root / "launch.py"), *args], cwd=root, env=env,
                             capture_output=True, text=True, timeout=600)  # fmt: skip
    assert missing.returncode == 2 and "huggingface-cli download Qwen/Qwen2.5-14B-Instruct" in missing.stderr


def _tokenizer_without_mask(folder: Path) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE with an end-of-text and a pad token but no mask token, as an AR model's tokenizer has."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from streakline.data.tokenizer import CHAT_TEMPLATE

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=290, special_tokens=["<|endoftext|>", "<|pad|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator([f"{r['question']}\n{r['solution']}" for r in math_texts("train", 200, seed=0)], trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>", chat_template=CHAT_TEMPLATE
    )
    fast.save_pretrained(folder)
    return fast


def test_distill_adds_the_mask_token_an_ar_checkpoint_lacks_and_the_export_carries_it(real, tmp_path):
    tmp = real[0]
    tokenizer = _tokenizer_without_mask(tmp_path / "tokenizer")
    assert "<|mask|>" not in tokenizer.get_vocab()
    verifier = _checkpoint(tmp_path / "verifier", tokenizer, seed=0)
    drafter = _checkpoint(tmp_path / "drafter", tokenizer, seed=1)
    args = [
        "stage=pipeline", "experiment=real", "experiment.stages=[trajectories,distill]", "model=diffucoder",
        f"run_root={tmp_path / 'runs'}", f"model.verifier.path={verifier}", f"model.drafter.path={drafter}",
        "model.verifier.dtype=float32", "model.drafter.dtype=float32", "model.drafter.gamma=4",
        f"data.prompt_sources=[conversations@{tmp / 'chats.jsonl'}]", "data.max_prompts=3", "data.max_new_tokens=8",
        "data.num_shards=1", "trainer.max_steps=1", "trainer.save_every=1", "trainer.eval_every=1",
        "trainer.micro_batch_size=2", "trainer.warmup_steps=1", "trainer.windows_per_seq=2",
        "trainer.wandb_project=null", "trainer.eval_sources=[]", "settings.evaluate.benchmarks=[]",
    ]  # fmt: skip
    run_stage(compose_config(args))
    (run,) = (tmp_path / "runs" / "real" / "distill").iterdir()
    export = run / "drafter"
    assert json.loads((export / "config.json").read_text())["vocab_size"] == len(tokenizer) + 1  # one row more
    saved = transformers.AutoTokenizer.from_pretrained(export)
    assert saved.get_vocab()["<|mask|>"] == len(tokenizer) and saved.mask_token == "<|mask|>"
    grown = transformers.AutoModelForCausalLM.from_pretrained(export)
    assert grown.get_input_embeddings().weight.shape[0] == len(tokenizer) + 1
