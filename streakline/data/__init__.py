"""The data layer: tiny-world corpora, the shipped chat prompts, benchmark loaders, conversation sets, prompt sources
and the tiny-world tokenizer.

    from streakline.data import chat_prompts, code_texts, math_texts, load_benchmark, load_source, train_tokenizer

Ground level: imports no model code and no other streakline layer; datasets/transformers load only when used.
"""

from .benchmarks import BenchmarkError, benchmark_names, load_benchmark
from .corpora.chat import chat_prompts
from .corpora.code import code_dataset, code_texts, corpus_fingerprint
from .corpora.math import math_dataset, math_texts, problem
from .sources import load_source, prompt_for
from .tokenizer import tiny_training_texts, train_tokenizer

__all__ = [
    "BenchmarkError",
    "benchmark_names",
    "chat_prompts",
    "code_dataset",
    "code_texts",
    "corpus_fingerprint",
    "load_benchmark",
    "load_source",
    "math_dataset",
    "math_texts",
    "problem",
    "prompt_for",
    "tiny_training_texts",
    "train_tokenizer",
]
