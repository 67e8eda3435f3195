"""The tiny world's tokenizer: a byte-level BPE trained here on the tiny corpora, saved as a transformers folder.

    path = train_tokenizer(tiny_training_texts(n_math=20_000, seed=0), "runs/tiny/tokenizer", vocab_size=4096)
    tok = AutoTokenizer.from_pretrained(path)   # eos = bos = <|endoftext|>, pad = <|pad|>, mask = <|mask|>

Byte-level means every string round-trips exactly (``decode(encode(x)) == x``), whitespace and unicode included;
digits are split one per token before BPE so numbers in the math domain are spelled the same way wherever they
occur. Training is deterministic for the same texts and the folder is written atomically (temp folder + rename), so
a reader never sees half a tokenizer. Encoding adds no special tokens; callers join documents with the eos token.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from .corpora.code import code_texts
from .corpora.math import math_texts

EOS = "<|endoftext|>"
PAD = "<|pad|>"
MASK = "<|mask|>"
SPECIAL_TOKENS = (EOS, PAD, MASK)  # ids 0, 1, 2 in this order
BYTE_ALPHABET = 256

# Plain-text role markers: the tiny models never saw chat data, so the markers carry no learned meaning and need no
# special tokens. The {% generation %} block lets transformers return an assistant-token mask for loss masking.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- 'assistant:\\n' }}{% generation %}{{- message['content'] + eos_token }}{% endgeneration %}{{- '\\n' }}"
    "{%- elif message['role'] in ['system', 'user'] %}"
    "{{- message['role'] + ':\\n' + message['content'] + '\\n' }}"
    "{%- else %}"
    "{{- raise_exception('unknown chat role ' + message['role'] + '; use system, user or assistant') }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'assistant:\\n' }}{%- endif %}"
)


def tiny_training_texts(n_math: int, seed: int = 0) -> Iterator[str]:
    """The tokenizer's training mix: every code train file, then ``n_math`` train-split math problems."""
    for rec in code_texts("train"):
        yield rec["text"]
    for rec in math_texts("train", n_math, seed=seed):
        yield rec["text"]


def train_tokenizer(texts: Iterable[str], out_dir: str | os.PathLike, vocab_size: int = 4096) -> Path:
    """Train a byte-level BPE of exactly ``vocab_size`` tokens on ``texts``; save it to ``out_dir``; return the path.

    An existing ``out_dir`` is replaced. Raises ValueError when the texts are too few to reach ``vocab_size``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    floor = BYTE_ALPHABET + len(SPECIAL_TOKENS)
    if vocab_size <= floor:
        raise ValueError(f"vocab_size must exceed {floor} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(
            f"the training texts only support {tok.get_vocab_size()} tokens, fewer than vocab_size={vocab_size}; "
            "train on more text or ask for a smaller vocabulary"
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=PAD,
        mask_token=MASK,
        clean_up_tokenization_spaces=False,  # the default cleanup rewrites " ." to "." and breaks exact round trips
        chat_template=CHAT_TEMPLATE,
    )
    return _save_atomically(fast, Path(out_dir))


def _portable_class_name(config_path: Path) -> None:
    # transformers 5 records its internal backend class; the older, still-supported name loads on 4.x and 5.x alike.
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _save_atomically(fast, out: Path) -> Path:
    out = out.absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    # The temp folder sits beside the target so the final rename stays on one filesystem (and so is atomic).
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        fast.save_pretrained(str(tmp))
        _portable_class_name(tmp / "tokenizer_config.json")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a tokenizer folder is meant to be shared
        if out.exists():
            old = out.with_name(f".{out.name}.old-{secrets.token_hex(4)}")
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
