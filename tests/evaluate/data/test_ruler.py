"""The synthetic RULER-style suite: answers, needle depth, determinism and length."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from kvfold.evaluate.data.ruler import (
    HEADLINE_TASKS,
    PROMPT_RESERVE_TOKENS,
    RULER_TASKS,
    SUITE_MAX_NEW_TOKENS,
    TASK_HAYSTACKS,
    VT_HOPS,
    generate_ruler,
)
from kvfold.evaluate.data.samples import Sample
from kvfold.evaluate.data.text import NOISE_SENTENCES, count_tokens, haystack_sentences, load_haystack

NIAH_TASKS = [t for t in RULER_TASKS if t.startswith("niah")]
# Tasks whose answers are spelled out in the context (cwe/fwe answers are frequent words instead).
LOOKUP_TASKS = [*NIAH_TASKS, "vt", "qa_1", "qa_2"]
NEEDLE = re.compile(r"One of the special magic \w+ for \S+ is: [^\s.]+\.")
VT_STATEMENT = re.compile(r"VAR [A-Z]{5} = (?:VAR [A-Z]{5}|\d+)\.")


def _total_tokens(tokenizer, sample: Sample) -> int:
    """Tokens the exchange takes under the generator's length accounting."""
    return (
        count_tokens(tokenizer, sample.context)
        + count_tokens(tokenizer, sample.question)
        + count_tokens(tokenizer, sample.answer_prefix)
        + sample.max_new_tokens
        + PROMPT_RESERVE_TOKENS
    )


@pytest.fixture(scope="module")
def real_suite(smollm_tokenizer) -> list[Sample]:
    """All 13 tasks, 3 samples each, at 2K tokens of the embedded model's tokenizer."""
    return generate_ruler(smollm_tokenizer, length=2048, samples_per_task=3, seed=7)


def _of(samples: list[Sample], task: str) -> list[Sample]:
    return [s for s in samples if s.task == task]


# --- the suite's shape ---------------------------------------------------------------------------


def test_thirteen_tasks_in_ruler_order() -> None:
    assert RULER_TASKS == (
        "niah_single_1",
        "niah_single_2",
        "niah_single_3",
        "niah_multikey_1",
        "niah_multikey_2",
        "niah_multikey_3",
        "niah_multivalue",
        "niah_multiquery",
        "vt",
        "cwe",
        "fwe",
        "qa_1",
        "qa_2",
    )


def test_sample_fields(real_suite: list[Sample]) -> None:
    questions = {"niah_multiquery": 4}  # the multi-query task asks each of its keys on its own
    assert [s.task for s in real_suite] == [t for t in RULER_TASKS for _ in range(3 * questions.get(t, 1))]
    for s in real_suite:
        assert s.metric == ("string_match_part" if s.task.startswith("qa") else "string_match_all")
        assert s.max_new_tokens == SUITE_MAX_NEW_TOKENS[s.task]
        assert s.haystack == TASK_HAYSTACKS[s.task] and s.haystack in ("noise", "prose")
        assert s.answer_prefix.startswith("Answer:")
        assert s.question.startswith("\n")
        assert s.length == 2048
        assert (s.depth is None) == (s.task in ("cwe", "fwe"))
    assert len({s.sample_id for s in real_suite}) == len(real_suite)


def test_headline_has_prose_and_noise_tasks() -> None:
    haystacks = Counter(TASK_HAYSTACKS[t] for t in HEADLINE_TASKS)
    assert len(HEADLINE_TASKS) >= 6 and "niah_multikey_1" not in HEADLINE_TASKS
    assert haystacks["prose"] >= 2 and haystacks["noise"] >= 1


def test_multiquery_questions_share_one_context(real_suite: list[Sample]) -> None:
    samples = _of(real_suite, "niah_multiquery")
    by_context = Counter(s.context for s in samples)
    assert sorted(by_context.values()) == [4, 4, 4]
    for context in by_context:
        asked = [s for s in samples if s.context == context]
        assert len({s.answers for s in asked}) == 4 and len({s.sample_id for s in asked}) == 4


# --- answers really are in the context -----------------------------------------------------------


def _check_answers_occur_once(samples: list[Sample], task: str) -> None:
    assert samples
    for s in samples:
        for answer in s.answers:
            # a tracked variable is named where it is assigned, and again where the next one copies it
            spelled = f"VAR {answer} =" if task == "vt" else answer
            assert s.context.count(spelled) == 1, (task, answer)


@pytest.mark.parametrize("task", LOOKUP_TASKS)
def test_answers_occur_in_the_context_exactly_once(real_suite: list[Sample], task: str) -> None:
    _check_answers_occur_once(_of(real_suite, task), task)


@pytest.mark.parametrize("task", LOOKUP_TASKS)
def test_answers_occur_exactly_once_with_any_tokenizer(word_tokenizer, task: str) -> None:
    # the same check where the model's tokenizer is not installed (the test above is then skipped)
    samples = generate_ruler(word_tokenizer, length=1500, samples_per_task=5, seed=12, tasks=[task])
    _check_answers_occur_once(samples, task)


@pytest.mark.parametrize("task", NIAH_TASKS)
def test_queried_keys_have_only_their_own_needles(real_suite: list[Sample], task: str) -> None:
    for s in _of(real_suite, task):
        keys = re.split(r", and |, | and ", re.search(r"for (.+) mentioned", s.question).group(1))
        needles = [
            re.fullmatch(r"One of the special magic \w+ for (\S+) is: (\S+)\.", n).groups()
            for n in NEEDLE.findall(s.context)
        ]
        # Every needle of a queried key holds an answer, and every answer has one needle.
        assert sorted(value for key, value in needles if key in keys) == sorted(s.answers)


def test_multi_needle_counts(real_suite: list[Sample]) -> None:
    for s in _of(real_suite, "niah_multivalue"):
        assert len(set(s.answers)) == 2 and len(NEEDLE.findall(s.context)) == 2
    for s in _of(real_suite, "niah_multiquery"):
        assert len(s.answers) == 1 and len(NEEDLE.findall(s.context)) == 4
    for s in _of(real_suite, "niah_multikey_1"):
        assert len(s.answers) == 1 and len(NEEDLE.findall(s.context)) == 4
    for task in ("niah_multikey_2", "niah_multikey_3"):  # the haystack is made of distractor needles
        for s in _of(real_suite, task):
            assert len(NEEDLE.findall(s.context)) > 20
    for s in _of(real_suite, "niah_multikey_3"):
        assert re.fullmatch(r"[0-9a-f-]{36}", s.answers[0])


def test_vt_chain_leads_from_the_value_to_every_answer(real_suite: list[Sample]) -> None:
    for s in _of(real_suite, "vt"):
        value = re.search(r"value (\d+)", s.question).group(1)
        assignments = dict(re.findall(r"VAR ([A-Z]{5}) = (?:VAR )?(\w+)\.", s.context))
        holding = {value}
        for _ in range(len(assignments)):
            holding |= {var for var, source in assignments.items() if source in holding}
        assert holding - {value} == set(s.answers)
        assert len(s.answers) == VT_HOPS + 1


def test_cwe_answers_are_the_most_common_words(real_suite: list[Sample]) -> None:
    for s in _of(real_suite, "cwe"):
        counts = Counter(re.findall(r"\d+\. (\S+)", s.context))
        answers = set(s.answers)
        assert len(answers) == 10
        assert min(counts[w] for w in answers) > max(c for w, c in counts.items() if w not in answers)


def test_fwe_answers_are_the_most_frequent_coded_words(real_suite: list[Sample]) -> None:
    for s in _of(real_suite, "fwe"):
        counts = Counter(s.context.split("\n", 1)[1].split())
        counts.pop("...")
        ranked = [c for _, c in counts.most_common()]
        assert [w for w, _ in counts.most_common(3)] == list(s.answers)
        assert ranked[0] > ranked[1] > ranked[2] > ranked[3]  # no ties at the top


def _documents(context: str) -> list[str]:
    return [d.split("\n", 1)[1] for d in context.split("\n\n") if d.startswith("Document ")]


def test_qa_answer_sits_in_a_document_about_the_asked_person(real_suite: list[Sample]) -> None:
    for s in _of(real_suite, "qa_1"):
        name = re.search(r"(?:did|was) ([A-Z][a-z]+ [A-Z][a-z]+)", s.question).group(1)
        assert s.context.count(f"{name} was born in") == 1  # one biography, hidden in prose
        sentence_start = s.answer_prefix.removeprefix("Answer: ")
        assert name in sentence_start and s.answers[0] not in s.answer_prefix
        # the prefix restates the start of the sentence that holds the answer, within a few words
        assert re.search(re.escape(sentence_start) + r"(?: \w+){0,2} " + re.escape(s.answers[0]), s.context)
    for s in _of(real_suite, "qa_2"):
        name = re.search(r"that ([A-Z][a-z]+ [A-Z][a-z]+) worked", s.question).group(1)
        (biography,) = [d for d in _documents(s.context) if d.startswith(f"{name} was born")]
        employer = re.search(r"for (.+?)\. Outside", biography).group(1)
        (profile,) = [d for d in _documents(s.context) if d.startswith(f"{employer} is ")]
        assert s.answers[0] in profile


# --- haystacks ----------------------------------------------------------------------------------

PROSE_NIAH_TASKS = [t for t in NIAH_TASKS if TASK_HAYSTACKS[t] == "prose"]
SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")  # how haystack_sentences splits the prose


def _haystack(sample: Sample) -> list[str]:
    """The sentences around the needles: the context after its instruction line, needles removed."""
    body = NEEDLE.sub(" ", VT_STATEMENT.sub(" ", sample.context.split("\n", 1)[1]))
    return [s for s in SENTENCE_BREAK.split(" ".join(body.split())) if s]


def test_haystack_label_says_what_the_needles_hide_in(word_tokenizer) -> None:
    tasks = [*NIAH_TASKS, "vt"]
    samples = generate_ruler(word_tokenizer, length=900, samples_per_task=2, seed=6, tasks=tasks)
    prose, noise = set(haystack_sentences()), set(NOISE_SENTENCES)
    for s in samples:
        sentences = _haystack(s)
        if s.task in ("niah_multikey_2", "niah_multikey_3"):  # noise made of distractor needles only
            assert s.haystack == "noise" and sentences == [], s.task
        elif s.haystack == "prose":
            assert len(sentences) > 10 and set(sentences) <= prose, s.task
        else:
            assert s.haystack == "noise" and len(sentences) > 10 and set(sentences) <= noise, s.task
    assert {s.task for s in samples if s.haystack == "prose"} == set(PROSE_NIAH_TASKS)


@pytest.mark.parametrize("task", PROSE_NIAH_TASKS)
def test_prose_haystack_is_deterministic_for_a_seed(word_tokenizer, task: str) -> None:
    first = [_haystack(s) for s in generate_ruler(word_tokenizer, 900, 3, seed=8, tasks=[task])]
    load_haystack.cache_clear()  # read the prose again, as a new process would
    haystack_sentences.cache_clear()
    again = [_haystack(s) for s in generate_ruler(word_tokenizer, 900, 3, seed=8, tasks=[task])]
    assert again == first
    # the seed, not the call, picks where in the prose each context starts
    other = [_haystack(s) for s in generate_ruler(word_tokenizer, 900, 3, seed=9, tasks=[task])]
    assert [h[0] for h in other] != [h[0] for h in first]
    assert len({h[0] for h in first}) == 3  # and the contexts of one seed start at different places


# --- needle depth --------------------------------------------------------------------------------


def _depth_check(sample: Sample, inserted: list[str], target: str, unit_chars: int) -> None:
    """The target needle starts at ``depth`` of the haystack's characters (inserted needles removed).

    Insertion picks the unit boundary nearest to ``depth * C`` (C = haystack characters without the
    inserted needles), so the error is at most half a unit plus its separator:
    (unit_chars + 1) / (2 C). The needle must also sit at a sentence boundary.
    """
    body = sample.context.split("\n", 1)[1].lstrip("\n")
    starts = {text: body.index(text) for text in inserted}
    assert all(body.count(text) == 1 for text in inserted)
    position = starts[target]
    before = sum(len(text) + 1 for text, start in starts.items() if start < position)
    haystack_chars = len(body) - sum(len(text) + 1 for text in inserted)
    measured = (position - before) / haystack_chars
    assert abs(measured - sample.depth) <= (unit_chars + 1) / (2 * haystack_chars) + 1e-9
    end = position + len(target)
    assert position == 0 or body[position - 2 : position] in {". ", "! ", "? "}
    assert end == len(body) or re.match(r" [A-Z]", body[end : end + 2])


@pytest.mark.parametrize("length", [700, 3000])
@pytest.mark.parametrize("task", NIAH_TASKS)
def test_needle_lies_at_the_stated_depth(word_tokenizer, task: str, length: int) -> None:
    samples = generate_ruler(word_tokenizer, length=length, samples_per_task=6, seed=3, tasks=[task])
    for s in samples:
        needles = NEEDLE.findall(s.context)
        target = next(n for n in needles if n.endswith(f"is: {s.answers[0]}."))
        if task in ("niah_multikey_2", "niah_multikey_3"):  # the haystack units are distractor needles
            inserted, unit_chars = [target], max(map(len, needles))
        else:
            inserted, unit_chars = needles, max(map(len, haystack_sentences()))
            if task == "niah_single_1":
                unit_chars = max(map(len, NOISE_SENTENCES))
        _depth_check(s, inserted, target, unit_chars)


def test_vt_chain_starts_at_the_stated_depth(word_tokenizer) -> None:
    for s in generate_ruler(word_tokenizer, length=1500, samples_per_task=6, seed=5, tasks=["vt"]):
        value = re.search(r"value (\d+)", s.question).group(1)
        target = f"VAR {s.answers[0]} = {value}."
        _depth_check(s, VT_STATEMENT.findall(s.context), target, max(map(len, NOISE_SENTENCES)))


def test_depths_spread_over_the_context(word_tokenizer) -> None:
    samples = generate_ruler(word_tokenizer, length=600, samples_per_task=40, tasks=["niah_single_1"])
    depths = [s.depth for s in samples]
    assert all(0.0 <= d < 1.0 for d in depths)
    assert min(depths) < 0.2 and max(depths) > 0.8


# --- determinism ---------------------------------------------------------------------------------


def test_same_seed_gives_identical_samples(word_tokenizer) -> None:
    first = generate_ruler(word_tokenizer, length=1200, samples_per_task=2, seed=11)
    again = generate_ruler(word_tokenizer, length=1200, samples_per_task=2, seed=11)
    assert first == again


def test_different_seed_gives_different_samples(word_tokenizer) -> None:
    a = generate_ruler(word_tokenizer, length=1200, samples_per_task=2, seed=1)
    b = generate_ruler(word_tokenizer, length=1200, samples_per_task=2, seed=2)
    for x, y in zip(a, b, strict=True):
        assert x.task == y.task and x.context != y.context


def test_samples_do_not_depend_on_how_many_or_which_tasks_are_asked(word_tokenizer) -> None:
    many = generate_ruler(word_tokenizer, length=1000, samples_per_task=3, seed=4)
    few = generate_ruler(word_tokenizer, length=1000, samples_per_task=1, seed=4, tasks=["fwe", "qa_2"])
    assert few == [s for s in many if s.task in ("fwe", "qa_2") and s.sample_id.endswith("/0")]


def test_samples_within_a_task_differ(word_tokenizer) -> None:
    samples = generate_ruler(word_tokenizer, length=800, samples_per_task=3, seed=0)
    for task in RULER_TASKS:
        assert len({s.context for s in _of(samples, task)}) == 3
        assert len({s.answers for s in _of(samples, task)}) == len(_of(samples, task))


# --- length --------------------------------------------------------------------------------------


def test_real_tokenizer_lengths_are_close_to_but_not_above_the_target(real_suite, smollm_tokenizer) -> None:
    # The context is filled with whole units (sentences, list items, documents) up to the budget,
    # so it stops less than one unit short of it: at 2K tokens that is within 10 %.
    for s in real_suite:
        total = _total_tokens(smollm_tokenizer, s)
        assert 0.9 * 2048 <= total <= 2048, (s.task, total)


@pytest.mark.parametrize("length", [1024, 4096])
def test_lengths_at_other_targets(smollm_tokenizer, length: int) -> None:
    tasks = ["niah_single_2", "niah_multikey_3", "cwe", "fwe", "qa_2"]
    for s in generate_ruler(smollm_tokenizer, length=length, samples_per_task=1, seed=2, tasks=tasks):
        assert 0.9 * length <= _total_tokens(smollm_tokenizer, s) <= length, s.task


def test_long_contexts_cycle_the_prose_haystack(word_tokenizer) -> None:
    words_in_haystack = len(load_haystack().split())
    (s,) = generate_ruler(word_tokenizer, 2 * words_in_haystack, 1, tasks=["niah_single_2"])
    assert len(s.context.split()) > 1.5 * words_in_haystack
    first_sentence = haystack_sentences()[0]
    assert s.context.count(first_sentence) >= 1


def test_reserve_tokens_shrink_the_context(word_tokenizer) -> None:
    (plain,) = generate_ruler(word_tokenizer, 1000, 1, tasks=["niah_single_1"])
    (reserved,) = generate_ruler(word_tokenizer, 1000, 1, tasks=["niah_single_1"], reserve_tokens=100)
    assert 90 <= count_tokens(word_tokenizer, plain.context) - count_tokens(word_tokenizer, reserved.context) <= 110


def test_mapping_style_tokenizer_is_accepted() -> None:
    def tokenizer(text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [0] * len(text.split())}

    (s,) = generate_ruler(tokenizer, 500, 1, tasks=["vt"])
    assert all(a in s.context for a in s.answers)


# --- errors --------------------------------------------------------------------------------------


def test_too_short_length_is_a_clear_error(word_tokenizer) -> None:
    with pytest.raises(ValueError, match="too small for task 'niah_single_1'.*increase length"):
        generate_ruler(word_tokenizer, 60, 1, tasks=["niah_single_1"])


def test_unknown_task_and_bad_counts(word_tokenizer) -> None:
    with pytest.raises(ValueError, match=r"unknown RULER task\(s\) \['niah'\]; valid tasks: niah_single_1"):
        generate_ruler(word_tokenizer, 1000, 1, tasks=["niah"])
    with pytest.raises(ValueError, match="samples_per_task"):
        generate_ruler(word_tokenizer, 1000, 0)
