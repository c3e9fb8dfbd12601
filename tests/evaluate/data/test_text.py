"""The text of synthetic contexts: the prose haystack and word lists shipped as package data, needle placement."""

from __future__ import annotations

import random

import pytest

from kvfold.evaluate.data.text import haystack_sentences, insert_at_depths, load_haystack, unique, word_list


def test_prose_haystack_ships_with_the_package() -> None:
    text = load_haystack()
    assert 25_000 <= len(text.encode()) <= 40_000
    sentences = haystack_sentences()
    assert len(sentences) > 200
    assert all(s[0].isupper() and s[-1] in ".!?" for s in sentences)
    assert "magic" not in text.lower()  # no accidental needle-like phrases


def test_word_lists_ship_with_the_package() -> None:
    assert word_list("adjectives")[:3] == ("able", "amber", "ancient")
    assert word_list("nouns")[-1] == "zebra" and len(set(word_list("nouns"))) == len(word_list("nouns"))
    assert word_list("company_suffixes") == (
        "Company", "Works", "Industries", "Holdings", "Group", "Trading", "Partners", "Limited"
    )  # fmt: skip
    assert "because" in word_list("stopwords")
    with pytest.raises(KeyError):
        word_list("colours")


def test_needles_go_to_the_nearest_boundary_in_depth_order() -> None:
    units = ["aaaa", "bbbb", "cccc", "dddd"]  # 4 chars + 1 separator each: boundaries at 0, 5, 10, 15, 19
    needles = [(1.0, "END"), (0.0, "START"), (0.5, "MIDDLE"), (0.5, "MIDDLE2")]
    expected = ["START", "aaaa", "bbbb", "MIDDLE", "MIDDLE2", "cccc", "dddd", "END"]
    assert insert_at_depths(units, needles, " ") == expected


def test_unique_items_avoid_what_is_taken() -> None:
    taken = {"b"}
    items = unique(random.Random(0), lambda rng: rng.choice("abc"), 2, taken)
    assert sorted(items) == ["a", "c"] and taken == {"a", "b", "c"}
