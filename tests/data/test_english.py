"""``streakline/data/english.py``: which pieces are words, which words are known, and the share of a text's words
that are, against hand counts.

    python -m pytest tests/data/test_english.py -q
"""

import pytest

from streakline.data.english import COMMON_WORDS, is_known, known_share, words


def test_words_are_the_pieces_with_letters_lower_cased_and_stripped():
    assert words("Write a haiku, please!") == ["write", "a", "haiku", "please"]
    assert words('What is 2+2? (Say "four".)') == ["what", "is", "say", "four"]  # 2+2 holds no letter
    assert words("__ ny3c__") == ["__ ny3c__".split()[1]]  # "__" has no letter; ny3c__ stays one piece


@pytest.mark.parametrize(
    ("word", "known"),
    [
        ("sort", True), ("sorting", True), ("sorted", True), ("stories", True), ("running", True),
        ("bigger", True), ("quickly", True), ("don't", True), ("step-by-step", True), ("input/output", True),
        ("ny3c__", False), ("andsfh3", False), ("mores", True), ("xqzt", False), ("is_prime(n)", False),
    ],
)  # fmt: skip
def test_a_word_is_known_as_listed_or_with_a_regular_ending(word, known):
    assert is_known(word) is known


def test_the_share_is_known_words_over_words():
    assert known_share("How do I sort a list in Python?") == 1.0
    # the noise: it, son, mores, each of its 11 pieces with letters
    noise = '__ ny3c__ it ta son mores andSfh3 each o00 c many"erri8k.esinatMfp isalet'
    assert len(words(noise)) == 11 and known_share(noise) == pytest.approx(4 / 11)
    assert known_share("1 + 2 = 3") == 0.0  # no words at all
    assert {"the", "write", "function", "python"} <= COMMON_WORDS
