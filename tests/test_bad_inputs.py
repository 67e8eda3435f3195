"""The catalogue of bad inputs: a mistake in a setting, a checkpoint, a tokenizer, a data file, an artifact or the
environment ends the command with one line on stderr that names the thing at fault and the fix, exit status 2, no
traceback, and the run root exactly as it was (no file changed, added or removed, apart from Hydra's own logs).

Every case runs the real command line (``launch.py ...`` as ``__main__``) in a child process against one run root
built here from the micro world: trajectories, a SPOT order model and a Spiffy graph, plus copies of the trajectories
with a cut shard and a garbled manifest, and a folder of bad files. The run root is hashed before and after each
case. The children are forked from a warm parent that has done the imports (``tests/forked_cli.py``: 3-5 s a case
less); the traceback test and the two-writers test start ``python launch.py`` cold.

    .venv/bin/python -m pytest tests/test_bad_inputs.py -q
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from streakline.artifacts import DiskFullError, read_manifest
from streakline.config import compose_config
from streakline.hashing import sha256_cache
from streakline.pipelines import run_stage
from tests.forked_cli import WarmLauncher

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENT = "cat"
DATA = ["data.max_prompts=6", "data.samples_per_prompt=1", "data.max_new_tokens=12", "data.num_shards=2",
        "data.batch_size=6"]  # fmt: skip
SPOT = ["stage.prompts=4", "stage.max_new_tokens=12", "stage.num_shards=1", "stage.batch_size=4", "stage.top_k=8",
        "stage.horizon=4", "stage.d_model=32", "stage.layers=1", "stage.heads=4", "stage.ffn=64", "stage.max_block=8",
        "stage.steps=5", "stage.train_batch=16"]  # fmt: skip
SPIFFY = ["stage.prompt_sources=[tiny-math-train]", "stage.prompts=3", "stage.max_new_tokens=12", "stage.horizon=3",
          "stage.budget=4", "stage.batch_size=3", "stage.top_k=8"]  # fmt: skip
DECODE = ["stage=decode", "decoder=vanilla", "prompt_ids=[5,6]", "decoder.max_new_tokens=4"]
FILES = ["data.mix_weights=[]"]  # one prompt source instead of the preset's two weighted ones


@dataclass(frozen=True)
class Case:
    """One bad input: the arguments after ``model=micro run_root=<root>`` (``{bad}``, ``{world}``, ``{spot}`` and
    ``{graph}`` are filled in), and the phrases the one line must hold: the thing at fault, then the fix."""

    name: str
    args: tuple[str, ...]
    says: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()


def case(name: str, args: list[str], *says: str, env: dict[str, str] | None = None) -> Case:
    return Case(name, tuple(args), says, tuple((env or {}).items()))


CASES = [
    # ------------------------------------------------------------------ configs
    case("unknown stage", ["stage=trajectorys"], "'trajectorys' is not an option of stage",
         "did you mean 'trajectories'"),
    case("unknown model preset", ["model=dreem"], "'dreem' is not an option of model", "model=NAME takes one of"),
    case("unknown experiment", ["experiment=nightly"], "'nightly' is not an option of experiment", "nightly_fig7"),
    case("unknown method", ["stage=distill", "method=streaks"], "'streaks' is not an option of method", "streak"),
    case("unknown key", ["trainer.zero_stag=2"], "unknown config key 'trainer.zero_stag'", "did you mean 'zero_stage'"),
    case("bad choice", ["stage=distill", "trainer.zero_stage=4"], "trainer.zero_stage=4 is not valid", "0, 2, 3"),
    case("negative temperature", [*DECODE, "decoder.temperature=-1"], "decoder.temperature=-1.0", "must be >= 0"),
    case("unknown stage setting", ["stage=spot", "stage.stepz=3"], "unknown setting 'stepz' of stage=spot",
         "did you mean 'steps'"),
    case("unknown setting of a chained stage", ["stage=pipeline", "settings.sweep.pointz=1"],
         "unknown setting 'pointz' of stage=sweep", "valid:"),
    case("masked-diffusion loss on a DFlash drafter", ["stage=distill", *DATA, "model.drafter=micro-dflash",
         "method=mdm"], "method=mdm adapts a standalone diffusion drafter", "trains with dflash_ce, dpace"),
    case("a start from a run that is not there", ["stage=distill", *DATA, "trainer.init_from='distill:method=mdm'"],
         "that distill run has not finished", "make it first with python launch.py"),
    case("decode without a prompt", ["stage=decode", "decoder=vanilla"], "stage=decode needs exactly one of",
         "prompt_ids=[1,2,3]"),
    case("bad debug flag", [*DECODE, "debug=maybe"], "debug=maybe is not valid", "debug=true"),
    case("a window wider than any completion", ["stage=distill", *DATA, "method.gamma=100000"],
         "method.gamma=100000 is wider than any completion", "choose method.gamma <="),
    case("a top-k of zero", [*DECODE, "decoder.top_k=0"], "decoder.top_k=0 keeps no token", "decoder.top_k=null"),
    case("a plateau stop without a held-out check", ["stage=distill", *DATA, "trainer.patience=3",
         "trainer.eval_prompts=0"], "trainer.patience=3 stops on the held-out check", "trainer.patience=null"),
    case("a soft-streak stop without the soft streak", ["stage=distill", *DATA, "trainer.patience=3",
         "trainer.stop_metric=soft_streak", "trainer.eval_soft_streak=false"],
         "trainer.stop_metric=soft_streak stops on the check's soft streak", "trainer.eval_soft_streak=true"),
    case("a time budget of nothing", ["stage=distill", *DATA, "trainer.max_minutes=0"],
         "trainer.max_minutes=0.0 is not valid", "must be > 0"),
    case("ngram sizes the wrong way round", [*DECODE, "decoder=ngram", "decoder.ngram_min=5"],
         "decoder.ngram_max=4 is below decoder.ngram_min=5", "e.g. decoder.ngram_min=2 decoder.ngram_max=4"),
    case("word for a step count", ["stage=distill", *DATA, "trainer.max_steps=abc"],
         "trainer.max_steps=abc is not valid", "takes an integer"),
    case("word for a learning rate", ["stage=distill", *DATA, "trainer.lr=abc"], "trainer.lr=abc is not valid",
         "takes a number"),
    case("fraction for an integer", [*DECODE, "decoder.K=1.5"], "decoder.K=1.5 is not valid", "takes an integer"),
    case("hub id where a preset goes", [*DECODE, "model.verifier=org/name"], "'org/name' is not a checkpoint preset",
         "use model.verifier.hub_id=org/name"),
    case("top_p of zero", ["stage=trajectories", *DATA, "data.top_p=0"], "data.top_p=0", "(0, 1]"),
    # ------------------------------------------------------------------ checkpoints
    case("verifier path missing", [*DECODE, "model.verifier.path={bad}/nowhere"],
         "nowhere is not a checkpoint folder (no config.json there)", "a folder written by save_pretrained"),
    case("config does not match weights", [*DECODE, "model.verifier.path={bad}/shapes"],
         "do not have the shapes its config.json implies", "take both from the same checkpoint"),
    case("config.json not JSON", [*DECODE, "model.verifier.path={bad}/badjson"], "config.json is not valid JSON",
         "copy it again"),
    case("weights missing", [*DECODE, "model.verifier.path={bad}/noweights"], "no model.safetensors",
         "fetch them again"),
    case("weights cut short", [*DECODE, "model.verifier.path={bad}/cut"], "cannot read the weights in",
         "copy or download it again"),
    case("unknown model_type", [*DECODE, "model.verifier.path={bad}/mistral"],
         "model_type 'mistral' is not a family streakline reads", "llama (llama)",
         "model.verifier.family=<family>"),
    case("resume from nothing", ["stage=distill", *DATA, "trainer.resume_from={bad}/nowhere"],
         "trainer.resume_from=", "give a distill run folder"),
    # ------------------------------------------------------------------ tokenizers
    case("tokenizer folder missing", [*DECODE, "model.verifier.tokenizer={bad}/nowhere"], "does not exist",
         "point it at a tokenizer folder"),
    case("tokenizer folder without a tokenizer", [*DECODE, "model.verifier.tokenizer={bad}/empty_dir"],
         "holds no tokenizer.json", "model.verifier.tokenizer=<folder with the tokenizer>"),
    case("tokenizer larger than the model", [*DECODE, "model.verifier.tokenizer={bad}/tok_385"],
         "has 385 tokens but model.verifier", "embedding rows"),
    case("drafter tokenizer differs from the trajectories'", ["stage=distill", *DATA,
         "model.drafter.tokenizer={bad}/tok_other"], "the drafter's tokenizer is", "shares the verifier's tokenizer"),
    # ------------------------------------------------------------------ data files
    case("empty prompt file", ["stage=trajectories", *FILES, "data.prompt_sources=[gsm8k@{bad}/empty.jsonl]"],
         "empty.jsonl has no records", "one JSON object per line"),
    case("malformed prompt file", ["stage=trajectories", *FILES, "data.prompt_sources=[gsm8k@{bad}/malformed.jsonl]"],
         "malformed.jsonl:2 is not valid JSON"),
    case("many malformed lines", ["stage=trajectories", *FILES,
         "data.prompt_sources=[gsm8k@{bad}/many_malformed.jsonl]"], "many_malformed.jsonl:2 is not valid JSON",
         "nor are lines 4, 6, 8", ", 40 and 5 more (25 malformed lines)", "data.skip_bad_lines=true"),
    case("non-UTF-8 prompt file", ["stage=trajectories", *FILES, "data.prompt_sources=[gsm8k@{bad}/latin1.jsonl]"],
         "latin1.jsonl:1 is not UTF-8", "iconv"),
    case("prompt file without the fields", ["stage=trajectories", *FILES,
         "data.prompt_sources=[gsm8k@{bad}/nofields.jsonl]"], "its records have fields ['foo']",
         "needs prompt from 'question'"),
    case("prompt file of numbers", ["stage=trajectories", *FILES, "data.prompt_sources=[gsm8k@{bad}/numbers.json]"],
         "numbers.json: record 1 is not an object with named fields"),
    case("system-only chat row", ["stage=trajectories", *FILES,
         "data.prompt_sources=[conversations@{bad}/system_only.jsonl]"], "system_only.jsonl:1: no user turn in it",
         "its turns are system only"),
    case("prompt file missing", ["stage=trajectories", *FILES, "data.prompt_sources=[gsm8k@{bad}/nowhere.jsonl]"],
         "no benchmark file at", "check the path"),
    case("prompt parquet damaged", ["stage=trajectories", *FILES, "data.prompt_sources=[gsm8k@{bad}/cut.parquet]"],
         "is not a readable parquet file", "copy or export it again"),
    case("unknown prompt source", ["stage=trajectories", *FILES, "data.prompt_sources=[gsm8kk]"],
         "unknown prompt source 'gsm8kk'", "conversations@/path/to/file.jsonl"),
    case("source without a file after @", ["stage=trajectories", *FILES, "data.prompt_sources=[gsm8k@]"],
         "names no file after '@'", "gsm8k@/path/to/file.jsonl"),
    case("unknown evaluation benchmark", ["stage=evaluate", "stage.benchmarks=[humaneva]"],
         "unknown prompt source 'humaneva'", "benchmarks: tiny-math"),
    case("non-UTF-8 evaluation file", ["stage=evaluate", "stage.benchmarks=[gsm8k@{bad}/latin1.jsonl]"],
         "latin1.jsonl:1 is not UTF-8"),
    case("trajectory shard cut short", ["stage=distill", *DATA, "experiment.name=cut"], "corrupt",
         "delete it and rerun stage=trajectories"),
    case("trajectory manifest garbled", ["stage=distill", *DATA, "experiment.name=garbled"],
         "manifest.json in", "delete the folder and rerun"),
    case("no trajectories", ["stage=distill", *DATA, "experiment.name=empty"], "no complete trajectories",
         "python launch.py stage=trajectories model=micro"),
    # ------------------------------------------------------------------ artifacts
    case("order model for another rule", ["stage=decode", "decoder=spot", "decoder.rule=threshold",
         "decoder.artifact={spot}", "prompt_ids=[5]"], "learnt the commit order of rule 'static'",
         "stage.rule=threshold"),
    case("graph for another rule", ["stage=decode", "decoder=spiffy", "decoder.rule=threshold",
         "decoder.artifact={graph}", "prompt_ids=[5]"], "calibrated for rule 'static'", "stage=spiffy"),
    case("no order model", ["stage=decode", "decoder=spot", "experiment.name=empty", "prompt_ids=[5]"],
         "no trained order model", "stage=spot"),
    case("target block size no artifact was made for", ["stage=decode", "decoder=spiffy", "model.target.block_size=4",
         "prompt_ids=[5]"], "no Spiffy graph for target micro-target (block size 4)",
         "refused after building a new world", "stage=spiffy"),
    case("order model path wrong", ["stage=decode", "decoder=spot", "decoder.artifact={bad}/nowhere",
         "prompt_ids=[5]"], "is not an order-model folder", "stage=spot run"),
    case("graph file not a graph", ["stage=decode", "decoder=spiffy", "decoder.artifact={bad}/numbers.json",
         "prompt_ids=[5]"], "is not a Spiffy graph", "recalibrate it"),
    # ------------------------------------------------------------------ sizes
    case("trajectory prompts past the position limit", ["stage=trajectories", *DATA, "data.max_new_tokens=2045"],
         "do not fit the verifier's max_position_embeddings=2048", "data.long_prompts=skip"),
    case("gamma past the position limit", ["stage=decode", "decoder=diffusion_draft", "decoder.gamma=100000",
         "prompt_ids=[5]"], "beyond the verifier's max_position_embeddings", "lower decoder.max_new_tokens"),
    case("max_new_tokens past the position limit", [*DECODE, "decoder.max_new_tokens=5000"],
         "needs 5001 positions", "lower decoder.max_new_tokens"),
    case("prompt id outside the vocabulary", ["stage=decode", "decoder=vanilla", "prompt_ids=[99999]"],
         "prompt_ids has id 99999", "vocabulary has 384"),
    # ------------------------------------------------------------------ environment
    case("slurm without multirun", [*DECODE, "launcher=slurm"], "launcher=slurm submits jobs", "add -m"),
    case("slurm not installed", ["-m", "launcher=slurm", *DECODE], "sbatch and srun are not on",
         "drop launcher=slurm", env={"PATH": str(Path(sys.executable).parent)}),
    case("run root not creatable", [*DECODE, "run_root=/proc/streakline"],
         "run_root=/proc/streakline cannot be created", "set run_root=<a writable folder>"),
    case("run root under a file", [*DECODE, "run_root={bad}/empty.jsonl/runs"], "empty.jsonl/runs cannot be created",
         "set run_root=<a writable folder>"),
    case("vllm backend without vllm", ["stage=trajectories", "data.backend=vllm"], "data.backend=vllm needs",
         "data.backend=native"),
    case("a GPU that is not there", [*DECODE, "model.verifier.devices=[cuda:0]"],
         "model.verifier.devices=[cuda:0] names cuda:0, but this machine has no GPU",
         "model.verifier.devices=null"),
    case("two GPUs that are not there", [*DECODE, "model.verifier.devices=[cuda:0,cuda:1]"],
         "model.verifier.devices=[cuda:0,cuda:1] names cuda:0", "model.verifier.devices=null"),
    case("disk full writing the first shard", ["stage=trajectories", *DATA, "experiment.name=full"],
         "the disk is full: writing shard-00000-of-00002.parquet in", "free there", "free some space there",
         env={"STREAKLINE_DISK_FULL_AT": "atomic:shard-00000-of-00002.parquet"}),
]  # fmt: skip


def _tree(root: Path) -> dict[str, str]:
    """Every file and folder under ``root`` but Hydra's logs and the file-hash cache (``hashing.sha256_cache``: what
    a data file hashed to, kept by path, size and mtime; no artifact), with a content hash for files."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if rel == "hydra" or rel.startswith("hydra/") or rel == sha256_cache(root).name:
            continue
        out[rel] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
    return out


def _bad_files(bad: Path, world: Path) -> None:
    bad.mkdir()
    (bad / "empty_dir").mkdir()
    (bad / "empty.jsonl").write_text("")
    (bad / "malformed.jsonl").write_text('{"question": "a", "answer": "b"}\n{not json\n')
    good, broken = '{"question": "q", "answer": "a"}', "{not json"
    (bad / "many_malformed.jsonl").write_text("".join(f"{good}\n{broken}\n" for _ in range(25)))
    (bad / "latin1.jsonl").write_bytes('{"question": "café", "answer": "b"}\n'.encode("latin-1"))
    (bad / "nofields.jsonl").write_text('{"foo": "a"}\n')
    (bad / "system_only.jsonl").write_text('{"messages": [{"role": "system", "content": "be brief"}]}\n')
    (bad / "numbers.json").write_text("[1, 2]")
    (bad / "cut.parquet").write_bytes(b"PAR1" + b"\0" * 40)
    shutil.copytree(world / "verifier", bad / "shapes")
    config = json.loads((bad / "shapes/config.json").read_text())
    (bad / "shapes/config.json").write_text(json.dumps({**config, "hidden_size": config["hidden_size"] * 2}))
    shutil.copytree(world / "verifier", bad / "badjson")
    (bad / "badjson/config.json").write_text('{"model_type": ')
    shutil.copytree(world / "verifier", bad / "mistral")  # a family of its own name: not one read here
    config = json.loads((bad / "mistral/config.json").read_text())
    (bad / "mistral/config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    shutil.copytree(world / "verifier", bad / "noweights")
    (bad / "noweights/model.safetensors").unlink()
    shutil.copytree(world / "verifier", bad / "cut")
    weights = (bad / "cut/model.safetensors").read_bytes()
    (bad / "cut/model.safetensors").write_bytes(weights[: len(weights) // 2])
    # one token more than the models have rows
    shutil.copytree(world / "tokenizer", bad / "tok_385")
    conf = json.loads((bad / "tok_385/tokenizer_config.json").read_text())
    conf["additional_special_tokens"] = ["<|extra|>"]
    (bad / "tok_385/tokenizer_config.json").write_text(json.dumps(conf))
    # the same size, but another special-token set: another tokenizer identity
    shutil.copytree(world / "tokenizer", bad / "tok_other")
    conf = json.loads((bad / "tok_other/tokenizer_config.json").read_text())
    conf["unk_token"] = "w"
    (bad / "tok_other/tokenizer_config.json").write_text(json.dumps(conf))


@pytest.fixture(scope="module")
def catalogue(micro_world, tmp_path_factory):
    """``(run root, placeholders)``: a copy of the micro world with this module's artifacts, and the bad files."""
    base = tmp_path_factory.mktemp("bad_inputs")
    root = base / "runs"
    shutil.copytree(micro_world[0] / "world", root / "world")
    common = ["model=micro", f"run_root={root}", f"experiment.name={EXPERIMENT}"]
    run_stage(compose_config(["stage=trajectories", *common, *DATA]))
    spot = run_stage(compose_config(["stage=spot", *common, *SPOT]))
    spiffy = run_stage(compose_config(["stage=spiffy", *common, *SPIFFY]))
    (trajectories,) = (root / EXPERIMENT / "trajectories").iterdir()
    for experiment in ("cut", "garbled"):
        shutil.copytree(trajectories, root / experiment / "trajectories" / trajectories.name)
    shard = sorted((root / "cut/trajectories" / trajectories.name / "shards").glob("*.parquet"))[0]
    shard.write_bytes(shard.read_bytes()[:300])
    (root / "garbled/trajectories" / trajectories.name / "manifest.json").write_text("garbage{")
    (world,) = (root / "world/bootstrap").iterdir()
    _bad_files(base / "bad", world)
    places = {"bad": str(base / "bad"), "world": str(world), "spot": str(spot.artifact), "graph": str(spiffy.artifact)}
    return root, places


@pytest.fixture(scope="module")
def launcher():
    with WarmLauncher(cwd=ROOT) as warm:
        yield warm


@pytest.mark.parametrize("bad", CASES, ids=[c.name for c in CASES])
def test_a_bad_input_gets_one_line_status_2_and_changes_nothing(catalogue, launcher, bad):
    if bad.name == "vllm backend without vllm" and torch.cuda.is_available():
        pytest.skip("a GPU is here, so vLLM may be too")
    if "GPU" in bad.name and torch.cuda.is_available():
        pytest.skip("a GPU is here")
    root, places = catalogue
    args = ["model=micro", f"run_root={root}", f"experiment.name={EXPERIMENT}", *(a.format(**places) for a in bad.args)]
    before = _tree(root)
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "STREAKLINE_DEBUG")}
    env.update(bad.env)
    proc = launcher.run(args, env)
    # the child's own logging (DeepSpeed's accelerator notice, progress bars) is not ours; our line is the last
    lines = [line for line in proc.stderr.splitlines() if line.startswith("streakline:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr[-3000:]
    for phrase in bad.says:
        assert phrase in lines[0], f"{phrase!r} not in: {lines[0]}"
    assert _tree(root) == before, "the run root changed"


def test_debug_shows_the_traceback_of_a_user_error(catalogue):
    root, places = catalogue
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    args = ["model=micro", f"run_root={root}", *DECODE, f"model.verifier.path={places['bad']}/shapes"]
    plain = subprocess.run([sys.executable, "launch.py", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    debug = subprocess.run(
        [sys.executable, "launch.py", *args, "debug=true"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert plain.returncode == 2 and "Traceback" not in plain.stderr
    assert debug.returncode != 0 and "Traceback" in debug.stderr
    assert "CheckpointError" in debug.stderr and "_check_shapes" in debug.stderr


def _launch(root: Path, *args: str, env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
    base = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "STREAKLINE_DEBUG")}
    return subprocess.Popen(
        [sys.executable, str(ROOT / "launch.py"), "model=micro", f"run_root={root}", *args], cwd=ROOT,
        env={**base, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw,
    )  # fmt: skip


def test_two_runs_of_one_config_at_once_one_writes_and_the_other_refuses(catalogue, tmp_path):
    """The first run holds its folder's lock (stalled right after taking it); the second, the same command, is refused
    with one line naming the first's PID and host and changes nothing; the first then finishes alone."""
    import socket

    root, _ = catalogue
    args = ["stage=trajectories", *DATA, "experiment.name=lock"]
    go = tmp_path / "go"
    stall = {"STREAKLINE_STALL_AT": "run:trajectories:locked", "STREAKLINE_STALL_UNTIL": str(go)}
    first = _launch(root, *args, env=stall)
    try:
        for line in first.stderr:  # wait until it holds the lock
            if line.startswith("stalled at run:trajectories:locked"):
                break
        else:
            pytest.fail(f"the first run never took the lock: {first.wait()}")
        before = _tree(root)
        second = _launch(root, *args)
        _, err = second.communicate(timeout=300)
        lines = [line for line in err.splitlines() if line.startswith("streakline:")]
        assert second.returncode == 2 and "Traceback" not in err and len(lines) == 1, err[-3000:]
        assert "is being written by another process" in lines[0]
        assert f"PID {first.pid} on host {socket.gethostname()}, running since 20" in lines[0]
        assert _tree(root) == before, "the refused run changed the run root"
    finally:
        go.touch()
        _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    (folder,) = (root / "lock" / "trajectories").iterdir()
    assert read_manifest(folder).status == "complete" and not (folder / ".lock").exists()
    assert len(list((folder / "shards").glob("shard-*.parquet"))) == 2


def test_a_full_disk_mid_run_keeps_the_finished_shard_and_a_rerun_completes(catalogue, monkeypatch):
    root, _ = catalogue
    cfg = ["stage=trajectories", "model=micro", f"run_root={root}", *DATA]
    monkeypatch.setenv("STREAKLINE_DISK_FULL_AT", "atomic:shard-00001-of-00002.parquet")
    with pytest.raises(DiskFullError, match=r"writing shard-00001-of-00002.parquet in .*shards failed \(.* free"):
        run_stage(compose_config([*cfg, "experiment.name=full-mid"]))
    (folder,) = (root / "full-mid" / "trajectories").iterdir()
    kept = folder / "shards" / "shard-00000-of-00002.parquet"
    assert kept.is_file() and not (folder / "shards" / "shard-00001-of-00002.parquet").exists()
    written = kept.stat().st_mtime_ns
    monkeypatch.delenv("STREAKLINE_DISK_FULL_AT")  # space freed
    done = run_stage(compose_config([*cfg, "experiment.name=full-mid"]))
    assert done.folder == folder and not done.cached and kept.stat().st_mtime_ns == written  # kept, not redone
    (clean,) = (root / EXPERIMENT / "trajectories").iterdir()  # the catalogue's uninterrupted run, same settings
    for shard in sorted((clean / "shards").glob("shard-*.parquet")):
        assert (folder / "shards" / shard.name).read_bytes() == shard.read_bytes(), shard.name


def test_json_and_jsonl_files_that_start_with_a_byte_order_mark_are_read(tmp_path):
    from streakline.data import load_source

    bom = "\ufeff"
    (tmp_path / "bom.jsonl").write_text(bom + '{"question": "a", "answer": "b"}\n{"question": "c", "answer": "d"}\n')
    (tmp_path / "bom.json").write_text(bom + '[{"question": "a", "answer": "b"}]')
    (tmp_path / "chat.jsonl").write_text(bom + '{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert [r["prompt"] for r in load_source(f"gsm8k@{tmp_path}/bom.jsonl")] == ["a", "c"]
    assert [r["reference"] for r in load_source(f"gsm8k@{tmp_path}/bom.json")] == ["b"]
    assert load_source(f"conversations@{tmp_path}/chat.jsonl")[0]["messages"] == [{"role": "user", "content": "hi"}]


def test_a_run_root_on_a_read_only_filesystem_is_named_as_such(tmp_path):
    mount = tmp_path / "ro"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a read-only filesystem here: {made.stderr.decode().strip()}")
    try:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "launch.py"), "model=micro", f"run_root={mount}", *DECODE], cwd=ROOT,
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        subprocess.run(["umount", str(mount)], check=True)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("streakline:")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert f"run_root={mount} is on a read-only filesystem" in lines[0] and "not writable by this user" not in lines[0]


def test_skip_bad_lines_leaves_malformed_lines_out_and_counts_them(catalogue, tmp_path):
    from streakline.pipelines.common.lookup import trajectories_key
    from streakline.world import attach_world

    root, _ = catalogue
    lines = [json.dumps({"question": f"what is {i} + {i}?", "answer": str(2 * i)}) for i in range(3)]
    (tmp_path / "some_bad.jsonl").write_text("\n".join([lines[0], "{cut", lines[1], "[1, 2", lines[2]]) + "\n")
    cfg = ["stage=trajectories", "model=micro", f"run_root={root}", "experiment.name=skip", *DATA, *FILES,
           f"data.prompt_sources=[gsm8k@{tmp_path}/some_bad.jsonl]"]  # fmt: skip
    done = run_stage(compose_config([*cfg, "data.skip_bad_lines=true"]))
    assert done.metrics["skipped_bad_lines"] == 2 and done.metrics["rows"] == 3
    assert read_manifest(done.folder).metrics["skipped_bad_lines"] == 2
    # in the key only when true: a run that may leave rows out is another run; at false, keys are as before
    strict, lenient = (attach_world(compose_config([*cfg, f"data.skip_bad_lines={v}"])) for v in ("false", "true"))
    assert "skip_bad_lines" not in trajectories_key(strict, "tok")["data"]
    assert trajectories_key(lenient, "tok")["data"]["skip_bad_lines"] is True


def test_a_log_file_that_cannot_be_written_drops_records_without_a_traceback(catalogue, tmp_path):
    """Hydra's log file under a run root whose disk filled mid-run: every record it takes fails with ENOSPC, as
    /dev/full fails every write. The records are dropped (``cli``: ``logging.raiseExceptions = False``), not each
    printed as a 'Logging error' traceback before the stage's own output; the stage itself goes on."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here to stand for a full disk")
    root, _ = catalogue
    chats = tmp_path / "chats.jsonl"  # loading it logs a record (data/conversations.py), which the handler must drop
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"hi {i}"}]}) + "\n"
                             for i in range(6)))  # fmt: skip
    proc = _launch(
        root,
        "stage=trajectories",
        *DATA,
        "experiment.name=log-full",
        "data.mix_weights=[]",
        f"data.prompt_sources=[conversations@{chats}]",
        "hydra.job_logging.handlers.file.filename=/dev/full",
    )
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "Logging error" not in err and "No space left" not in err, err[-3000:]
