"""Corpora: ``code`` (the stdlib's own sources) and ``math`` (seeded word problems) of the tiny world, and ``chat``
(the shipped chat prompt set, for instruction-tuned models)."""
