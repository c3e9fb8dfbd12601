"""Per-sample scoring metrics, each returning a score in [0, 100].

Every metric takes the model's prediction and the sample's reference answers. The RULER metrics
(``string_match_all``, ``string_match_part``) follow RULER's definitions; the others follow
LongBench's (``qa_f1``, ``rouge_*``, ``classification_score``, ``retrieval_score``,
``count_score``, ``code_sim_score``), which take the best score over the references. A task's
score is the mean of its per-sample scores.

Deviations from the reference implementations, all deliberate:

* ROUGE is computed here, with LongBench's tokenisation (the text is split into sentences at
  ``"."``, sentences into whitespace tokens, case kept). ROUGE-N counts clipped n-gram matches
  and ROUGE-L is the summary-level union-LCS score, both as defined by Lin (2004); the ``rouge``
  package LongBench calls counts each distinct n-gram once, so scores can differ slightly.
* ``code_sim_score`` uses :class:`difflib.SequenceMatcher` where LongBench uses ``fuzzywuzzy``,
  and is not rounded to an integer percentage.
* ``classification_score`` drops every matched class name that is a strict substring of the
  reference (LongBench's loop that does this can skip entries while removing them).
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

from kvfold.evaluate.data.samples import Sample
from kvfold.runtime.errors import UserError

__all__ = [
    "METRICS",
    "classification_score",
    "code_sim_score",
    "count_score",
    "exact",
    "normalize_answer",
    "qa_f1",
    "retrieval_score",
    "rouge_1",
    "rouge_2",
    "rouge_l",
    "score",
    "score_sample",
    "score_sample_metrics",
    "string_match_all",
    "string_match_part",
]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def _check_answers(answers: Sequence[str]) -> None:
    """Rejects an empty reference list or a bare string passed as the list."""
    if isinstance(answers, str):
        raise TypeError(f"answers must be a sequence of strings, got a single str {answers!r}")
    if not answers:
        raise UserError("answers must contain at least one reference string")


# --- RULER -------------------------------------------------------------------------------------


def string_match_all(prediction: str, answers: Sequence[str]) -> float:
    """RULER's score for multi-answer tasks: the percentage of references found in the prediction.

    Matching is case-insensitive substring containment.

    Example:
        >>> string_match_all("The numbers are 12 and 34.", ["12", "34", "56"])  # 2 of 3
        66.66666666666667
    """
    _check_answers(answers)
    text = prediction.lower()
    return 100.0 * sum(ref.lower() in text for ref in answers) / len(answers)


def string_match_part(prediction: str, answers: Sequence[str]) -> float:
    """RULER's score for QA: 100 if any reference occurs (case-insensitively) in the prediction."""
    _check_answers(answers)
    text = prediction.lower()
    return 100.0 * max(ref.lower() in text for ref in answers)


# --- SQuAD / LongBench QA ------------------------------------------------------------------------


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lowercase, drop punctuation, drop articles, collapse whitespace.

    Example:
        >>> normalize_answer("The  Cat, sat!")
        'cat sat'
    """
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _token_f1(prediction_tokens: Sequence[str], reference_tokens: Sequence[str]) -> float:
    """Bag-of-tokens F1 in [0, 1]."""
    overlap = sum((Counter(prediction_tokens) & Counter(reference_tokens)).values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(prediction_tokens)
    recall = overlap / len(reference_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, answers: Sequence[str]) -> float:
    """LongBench/SQuAD token F1 after :func:`normalize_answer`, best over the references, ×100.

    Example:
        >>> round(qa_f1("The cat sat", ["a cat sat down"]), 6)  # P = 2/2, R = 2/3
        80.0
    """
    _check_answers(answers)
    predicted = normalize_answer(prediction).split()
    return 100.0 * max(_token_f1(predicted, normalize_answer(ref).split()) for ref in answers)


def exact(prediction: str, answers: Sequence[str]) -> float:
    """SQuAD exact match: 100 if the normalised prediction equals a normalised reference."""
    _check_answers(answers)
    predicted = normalize_answer(prediction)
    return 100.0 * max(predicted == normalize_answer(ref) for ref in answers)


# --- ROUGE ---------------------------------------------------------------------------------------


def _rouge_sentences(text: str) -> list[list[str]]:
    """LongBench's ROUGE tokenisation: sentences split at ``"."``, then whitespace tokens."""
    return [piece.split() for piece in text.split(".") if piece.split()]


def _f_measure(hits: float, predicted_total: int, reference_total: int) -> float:
    """F1 in [0, 100] from a hit count and the two totals."""
    if hits <= 0 or predicted_total == 0 or reference_total == 0:
        return 0.0
    precision = min(1.0, hits / predicted_total)
    recall = min(1.0, hits / reference_total)
    return 100.0 * 2 * precision * recall / (precision + recall)


def _ngrams(tokens: Sequence[str], n: int) -> Counter[tuple[str, ...]]:
    """Multiset of the n-grams of a token sequence."""
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def _rouge_n_single(prediction: str, reference: str, n: int) -> float:
    """ROUGE-N F1 of one prediction against one reference (clipped n-gram counts)."""
    predicted = _ngrams([t for s in _rouge_sentences(prediction) for t in s], n)
    expected = _ngrams([t for s in _rouge_sentences(reference) for t in s], n)
    hits = sum((predicted & expected).values())
    return _f_measure(hits, sum(predicted.values()), sum(expected.values()))


def _lcs_reference_positions(reference: Sequence[str], candidate: Sequence[str]) -> set[int]:
    """Indices into ``reference`` of one longest common subsequence with ``candidate``."""
    rows, cols = len(reference), len(candidate)
    table = [[0] * (cols + 1) for _ in range(rows + 1)]
    for i, ref_token in enumerate(reference):
        above, here = table[i], table[i + 1]
        for j, cand_token in enumerate(candidate):
            here[j + 1] = above[j] + 1 if ref_token == cand_token else max(above[j + 1], here[j])
    positions: set[int] = set()
    i, j = rows, cols
    while i and j:
        if reference[i - 1] == candidate[j - 1]:
            positions.add(i - 1)
            i, j = i - 1, j - 1
        elif table[i - 1][j] >= table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return positions


def _rouge_l_single(prediction: str, reference: str) -> float:
    """Summary-level ROUGE-L F1 (Lin 2004, §3.2): union LCS of each reference sentence."""
    candidate_sentences = _rouge_sentences(prediction)
    reference_sentences = _rouge_sentences(reference)
    hits = 0
    for ref_sentence in reference_sentences:
        union: set[int] = set()
        for cand_sentence in candidate_sentences:
            union |= _lcs_reference_positions(ref_sentence, cand_sentence)
        hits += len(union)
    return _f_measure(hits, sum(map(len, candidate_sentences)), sum(map(len, reference_sentences)))


def rouge_1(prediction: str, answers: Sequence[str]) -> float:
    """ROUGE-1 F-measure ×100, best over the references."""
    _check_answers(answers)
    return max(_rouge_n_single(prediction, ref, 1) for ref in answers)


def rouge_2(prediction: str, answers: Sequence[str]) -> float:
    """ROUGE-2 F-measure ×100, best over the references."""
    _check_answers(answers)
    return max(_rouge_n_single(prediction, ref, 2) for ref in answers)


def rouge_l(prediction: str, answers: Sequence[str]) -> float:
    """Summary-level ROUGE-L F-measure ×100, best over the references (LongBench's ``rouge_score``).

    Example:
        >>> round(rouge_l("the cat sat on the mat", ["the cat is on the mat"]), 4)  # LCS 5 of 6
        83.3333
    """
    _check_answers(answers)
    return max(_rouge_l_single(prediction, ref) for ref in answers)


# --- LongBench task-specific -------------------------------------------------------------------


def _classification_single(prediction: str, reference: str, classes: Sequence[str]) -> float:
    """1/k if the reference is among the k class names found in the prediction, else 0."""
    matched = [name for name in classes if name in prediction]
    matched = [name for name in matched if not (name in reference and name != reference)]
    return 1.0 / len(matched) if reference in matched else 0.0


def classification_score(prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None) -> float:
    """LongBench's classification score (``trec``), ×100, best over the references.

    The class names found in the prediction (case-sensitive substrings) are collected, names that
    are strict substrings of the reference are dropped, and the score is ``1/k`` when the
    reference is one of the ``k`` remaining names.

    Args:
        prediction: Model output.
        answers: Reference labels.
        all_classes: The task's label set; defaults to ``answers`` when not given.

    Example:
        >>> classification_score("Location or Entity", ["Location"], ["Location", "Entity", "Human"])
        50.0
    """
    _check_answers(answers)
    classes = list(all_classes) if all_classes else list(answers)
    return 100.0 * max(_classification_single(prediction, ref, classes) for ref in answers)


def _fraction_equal(numbers: Sequence[str], target: str) -> float:
    """Fraction of ``numbers`` equal to ``target`` (0 when there are none)."""
    return sum(n == target for n in numbers) / len(numbers) if numbers else 0.0


def retrieval_score(prediction: str, answers: Sequence[str]) -> float:
    """LongBench's ``passage_retrieval`` score ×100: share of the numbers in the prediction that are
    the reference paragraph's number (taken from ``"Paragraph N"``, else the first number).

    Example:
        >>> retrieval_score("Paragraph 3, or maybe 7", ["Paragraph 3"])
        50.0
    """
    _check_answers(answers)
    predicted = re.findall(r"\d+", prediction)
    best = 0.0
    for ref in answers:
        ids = re.findall(r"Paragraph (\d+)", ref) or re.findall(r"\d+", ref)
        if ids:
            best = max(best, _fraction_equal(predicted, ids[0]))
    return 100.0 * best


def count_score(prediction: str, answers: Sequence[str]) -> float:
    """LongBench's ``passage_count`` score ×100: share of the numbers in the prediction equal to the
    reference count.

    Example:
        >>> count_score("There are 12 paragraphs, not 13.", ["12"])
        50.0
    """
    _check_answers(answers)
    predicted = re.findall(r"\d+", prediction)
    return 100.0 * max(_fraction_equal(predicted, str(ref).strip()) for ref in answers)


def _first_code_line(prediction: str) -> str:
    """First line that is not a comment or a Markdown fence (``` ` ```, ``#``, ``//``), else ``""``."""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def code_sim_score(prediction: str, answers: Sequence[str]) -> float:
    """LongBench's code-completion score ×100: similarity ratio of the prediction's first code line
    to the reference line (:class:`difflib.SequenceMatcher`), best over the references.

    Example:
        >>> code_sim_score("# comment\\nreturn x", ["return x"])
        100.0
    """
    _check_answers(answers)
    line = _first_code_line(prediction)
    return 100.0 * max(difflib.SequenceMatcher(None, line, ref).ratio() for ref in answers)


# --- registry ------------------------------------------------------------------------------------

METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
    "qa_f1": qa_f1,
    "exact": exact,
    "rouge_1": rouge_1,
    "rouge_2": rouge_2,
    "rouge_l": rouge_l,
    "classification_score": classification_score,
    "retrieval_score": retrieval_score,
    "count_score": count_score,
    "code_sim_score": code_sim_score,
}
"""Metric name → ``metric(prediction, answers) -> score in [0, 100]``."""


def score(
    metric_name: str,
    prediction: str,
    answers: Sequence[str],
    *,
    all_classes: Sequence[str] | None = None,
) -> float:
    """Scores one prediction with the named metric.

    Args:
        metric_name: A key of :data:`METRICS`.
        prediction: Model output.
        answers: Reference answers.
        all_classes: Label set, used only by ``classification_score``.

    Returns:
        The per-sample score in [0, 100].

    Raises:
        ValueError: If the metric name is unknown or ``answers`` is empty.

    Example:
        >>> score("string_match_part", "It is 42.", ["42", "forty-two"])
        100.0
    """
    try:
        metric = METRICS[metric_name]
    except KeyError:
        raise UserError(f"unknown metric {metric_name!r}; valid metrics: {', '.join(sorted(METRICS))}") from None
    if metric is classification_score:
        return classification_score(prediction, answers, all_classes)
    return metric(prediction, answers)


def _prepare_prediction(sample: Sample, prediction: str) -> str:
    """Applies the sample's prediction post-processing (LongBench's first-line rule)."""
    if sample.first_line_only:
        return prediction.lstrip("\n").split("\n")[0]
    return prediction


def score_sample(sample: Sample, prediction: str) -> float:
    """Scores a prediction for a sample with the sample's own metric, in [0, 100]."""
    text = _prepare_prediction(sample, prediction)
    return score(sample.metric, text, sample.answers, all_classes=sample.all_classes)


def score_sample_metrics(sample: Sample, prediction: str) -> dict[str, float]:
    """Scores a prediction with the sample's metric followed by its ``extra_metrics``.

    Returns:
        ``{metric_name: score}``; the first key is ``sample.metric``.
    """
    text = _prepare_prediction(sample, prediction)
    names = dict.fromkeys((sample.metric, *sample.extra_metrics))
    return {name: score(name, text, sample.answers, all_classes=sample.all_classes) for name in names}
