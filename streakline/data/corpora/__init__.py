"""Tiny-world corpora: ``code`` (the stdlib's own sources) and ``math`` (seeded word problems)."""
