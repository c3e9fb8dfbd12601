"""Metrics against hand-computed cases."""

from __future__ import annotations

import pytest

from kvfold.evaluate.data.samples import Sample
from kvfold.evaluate.scoring.metrics import (
    METRICS,
    classification_score,
    code_sim_score,
    count_score,
    exact,
    normalize_answer,
    qa_f1,
    retrieval_score,
    rouge_1,
    rouge_2,
    rouge_l,
    score,
    score_sample,
    score_sample_metrics,
    string_match_all,
    string_match_part,
)


def test_registry_names() -> None:
    assert set(METRICS) == {
        "string_match_all",
        "string_match_part",
        "qa_f1",
        "exact",
        "rouge_1",
        "rouge_2",
        "rouge_l",
        "classification_score",
        "retrieval_score",
        "count_score",
        "code_sim_score",
    }


# --- RULER string match --------------------------------------------------------------------------


def test_string_match_all_is_the_fraction_of_references_found() -> None:
    assert string_match_all("Numbers: 12 and 34.", ["12", "34", "56"]) == pytest.approx(200 / 3)
    assert string_match_all("none here", ["12"]) == 0.0


def test_string_match_is_case_insensitive() -> None:
    assert string_match_all("the key is ABC-def", ["abc-DEF"]) == 100.0
    assert string_match_part("BLUE", ["blue"]) == 100.0


def test_string_match_part_takes_the_best_reference() -> None:
    assert string_match_part("It was Paris.", ["London", "Paris"]) == 100.0
    assert string_match_part("It was Rome.", ["London", "Paris"]) == 0.0


# --- QA F1 / exact -------------------------------------------------------------------------------


def test_normalize_answer_drops_case_punctuation_and_articles() -> None:
    assert normalize_answer("  The Cat, sat on A mat! ") == "cat sat on mat"
    assert normalize_answer("an apple") == "apple"
    assert normalize_answer("theatre") == "theatre"  # articles only as whole words


def test_qa_f1_by_hand() -> None:
    # prediction tokens {cat, sat}; reference {cat, sat, down}: P = 2/2, R = 2/3, F1 = 0.8.
    assert qa_f1("The cat sat", ["a cat sat down"]) == pytest.approx(80.0)


def test_qa_f1_counts_repeated_tokens_once_per_match() -> None:
    # prediction [cat, cat, cat], reference [cat, sat]: overlap 1, P = 1/3, R = 1/2, F1 = 0.4.
    assert qa_f1("cat cat cat", ["cat sat"]) == pytest.approx(40.0)


def test_qa_f1_takes_the_best_reference_and_handles_no_overlap() -> None:
    assert qa_f1("Paris", ["London", "paris."]) == pytest.approx(100.0)
    assert qa_f1("Rome", ["London"]) == 0.0
    assert qa_f1("", ["London"]) == 0.0


def test_exact_uses_squad_normalisation() -> None:
    assert exact("The answer.", ["answer"]) == 100.0
    assert exact("an answer here", ["answer"]) == 0.0


# --- ROUGE ---------------------------------------------------------------------------------------


def test_rouge_single_sentence_by_hand() -> None:
    prediction, reference = "the cat sat on the mat", ["the cat is on the mat"]
    # Unigrams: clipped overlap the×2, cat, on, mat = 5 of 6 on each side.
    assert rouge_1(prediction, reference) == pytest.approx(500 / 6)
    # Bigrams: "the cat", "on the", "the mat" = 3 of 5 on each side.
    assert rouge_2(prediction, reference) == pytest.approx(60.0)
    # LCS "the cat on the mat" = 5 of 6 on each side.
    assert rouge_l(prediction, reference) == pytest.approx(500 / 6)


def test_rouge_precision_recall_asymmetry_by_hand() -> None:
    # ROUGE-1: overlap 2, P = 2/4, R = 2/2, F = 2/3. ROUGE-2: overlap 1 ("a b"), P = 1/3, R = 1, F = 1/2.
    assert rouge_1("a b c d", ["a b"]) == pytest.approx(200 / 3)
    assert rouge_2("a b c d", ["a b"]) == pytest.approx(50.0)
    assert rouge_l("a b c d", ["a b"]) == pytest.approx(200 / 3)


def test_rouge_l_is_summary_level_union_lcs() -> None:
    # Lin (2004) §3.2: reference w1..w5, candidate sentences "w1 w2 w6 w7 w8" and "w1 w3 w8 w9 w5".
    # LCS with each: {w1, w2} and {w1, w3, w5}; union 4 reference words. P = 4/10, R = 4/5, F = 8/15.
    prediction = "w1 w2 w6 w7 w8. w1 w3 w8 w9 w5"
    assert rouge_l(prediction, ["w1 w2 w3 w4 w5"]) == pytest.approx(800 / 15)
    # Sentences in swapped order: the union recovers all 4 words, a single LCS ("c d a b") only 2.
    assert rouge_l("c d. a b", ["a b c d"]) == 100.0
    assert rouge_l("c d a b", ["a b c d"]) == pytest.approx(50.0)


def test_rouge_uses_longbench_tokenisation() -> None:
    assert rouge_1("cat.", ["cat"]) == 100.0  # "." splits sentences and is dropped
    assert rouge_1("Cat", ["cat"]) == 0.0  # case is kept, as in LongBench's rouge package
    assert rouge_l("", ["cat"]) == 0.0
    assert rouge_l("dog", ["cat", "dog"]) == 100.0  # best reference


# --- LongBench task metrics ----------------------------------------------------------------------


def test_classification_score_by_hand() -> None:
    classes = ["Location", "Entity", "Human being"]
    assert classification_score("Location", ["Location"], classes) == 100.0
    assert classification_score("Location or Entity", ["Location"], classes) == 50.0
    assert classification_score("Entity", ["Location"], classes) == 0.0


def test_classification_drops_class_names_inside_the_reference() -> None:
    classes = ["location", "Other location"]
    # "location" is a strict substring of the reference, so it does not count as a competing match.
    assert classification_score("Other location", ["Other location"], classes) == 100.0


def test_classification_defaults_to_the_answers_as_classes() -> None:
    assert classification_score("Location", ["Location"]) == 100.0


def test_retrieval_score_by_hand() -> None:
    assert retrieval_score("Paragraph 3", ["Paragraph 3"]) == 100.0
    assert retrieval_score("Paragraph 3, or maybe 7", ["Paragraph 3"]) == 50.0
    assert retrieval_score("I do not know", ["Paragraph 3"]) == 0.0
    assert retrieval_score("Paragraph 13", ["Paragraph 3"]) == 0.0


def test_count_score_by_hand() -> None:
    assert count_score("12", ["12"]) == 100.0
    assert count_score("There are 12 paragraphs, not 13.", ["12"]) == 50.0
    assert count_score("twelve", ["12"]) == 0.0


def test_code_sim_uses_the_first_code_line() -> None:
    # SequenceMatcher("abcd", "abce").ratio() = 2 * 3 / 8.
    assert code_sim_score("abcd", ["abce"]) == pytest.approx(75.0)
    assert code_sim_score("```python\n# comment\n// note\nreturn x\nmore", ["return x"]) == 100.0
    assert code_sim_score("# only comments", ["return x"]) == 0.0


# --- dispatch ------------------------------------------------------------------------------------


def test_score_dispatches_and_passes_classes() -> None:
    assert score("qa_f1", "The cat sat", ["a cat sat down"]) == pytest.approx(80.0)
    assert score("classification_score", "Location or Entity", ["Location"], all_classes=["Location", "Entity"]) == 50.0


def test_score_rejects_unknown_metric_listing_valid_names() -> None:
    with pytest.raises(ValueError, match=r"unknown metric 'bleu'.*qa_f1.*string_match_all"):
        score("bleu", "x", ["x"])


def test_metrics_reject_empty_or_bare_string_answers() -> None:
    with pytest.raises(ValueError, match="at least one"):
        score("qa_f1", "x", [])
    with pytest.raises(TypeError, match="single str"):
        string_match_all("x", "x")


@pytest.mark.parametrize("name", sorted(METRICS))
def test_every_metric_is_bounded(name: str) -> None:
    for prediction, answers in [("", ["a"]), ("a b. c", ["a b c", "x"]), ("Paragraph 2 2", ["Paragraph 2"])]:
        assert 0.0 <= score(name, prediction, answers) <= 100.0


def test_score_sample_applies_first_line_rule_and_extra_metrics() -> None:
    sample = Sample("ctx", "\nq", ("blue sky",), "t", metric="qa_f1", first_line_only=True)
    assert score_sample(sample, "\nblue sky\nand a long continuation") == pytest.approx(100.0)
    summary = Sample("ctx", "\nq", ("the cat sat",), "xsum", metric="rouge_l", extra_metrics=("rouge_1", "rouge_2"))
    scores = score_sample_metrics(summary, "the cat sat")
    assert list(scores) == ["rouge_l", "rouge_1", "rouge_2"]
    assert scores == {"rouge_l": 100.0, "rouge_1": 100.0, "rouge_2": 100.0}
