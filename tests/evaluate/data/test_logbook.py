"""The built-in logbook: deterministic, every fact inside, at the depth asked for."""

from kvfold.evaluate.data.logbook import FACTS, build_logbook
from tests.evaluate.conftest import WordTokenizer


def test_the_logbook_is_deterministic_and_holds_every_fact_in_order():
    text = build_logbook(WordTokenizer(), target_tokens=400)
    assert text == build_logbook(WordTokenizer(), target_tokens=400)
    places = [text.index(fact) for fact, _, _ in FACTS]
    assert places == sorted(places)
    assert text != build_logbook(WordTokenizer(), target_tokens=400, seed=8)


def test_the_logbook_grows_to_about_the_length_asked_for():
    tokenizer = WordTokenizer()
    short = len(tokenizer(build_logbook(tokenizer, target_tokens=300)).input_ids)
    long = len(tokenizer(build_logbook(tokenizer, target_tokens=1200)).input_ids)
    assert 0.95 * 300 < short < long and long > 0.95 * 1200
