"""A synthetic RULER-style long-context suite, generated locally and deterministically.

The 13 tasks follow the designs of RULER (Hsieh et al., 2024, "RULER: What's the Real Context
Size of Your Long-Context Language Models?", §3 and Appendix B); the texts, word lists and
documents are this project's own, so nothing is downloaded:

* ``niah_*`` -- needle in a haystack. A needle reads ``"One of the special magic numbers for
  <key> is: <value>."``. Haystacks: ``noise`` (the repeated sentences "The grass is green. The sky
  is blue. ..."), ``essay`` (the project's own prose, ``kvfold/evaluate/data/haystack.txt``, cycled) and
  ``needle`` (the haystack is made of distractor needles). Keys are ``adjective-noun`` words or
  UUIDs, values are 7-digit numbers or UUIDs. As in RULER: ``single_1`` noise/words/numbers,
  ``single_2`` essay/words/numbers, ``single_3`` essay/words/UUIDs, ``multikey_1`` essay with 3
  distractor needles, ``multikey_2`` needle haystack of word keys and numbers, ``multikey_3``
  needle haystack of UUID keys and values, ``multivalue`` 4 values for one key (all must be
  reported), ``multiquery`` 4 keys, all asked.
* ``vt`` -- variable tracking: one chain ``VAR A = 12345.``, ``VAR B = VAR A.``, ... (4 hops)
  hidden in the noise haystack; every variable holding the value must be named.
* ``cwe`` -- common words extraction: a numbered word list in which 10 words occur far more often
  (30 times against at most 3 for the others at RULER's lengths; see
  :func:`~kvfold.evaluate.data.ruler_tasks.cwe_frequencies`).
* ``fwe`` -- frequent words extraction: "coded" random 6-letter words with Zipf (alpha = 2)
  frequencies behind a most frequent filler ``"..."``; the three most frequent words are asked.
  Counts are ``floor(c / rank**2)`` rather than sampled, so the top three are never tied.
* ``qa_1`` / ``qa_2`` -- questions over generated documents: fictional biographies and company
  profiles. ``qa_1`` asks a fact stated in one biography (SQuAD-like); ``qa_2`` is two-hop
  (HotpotQA-like): the person's biography names an employer whose profile holds the answer.
  The other documents are distractors.

**Length.** ``length`` counts tokens of the given tokenizer (``add_special_tokens=False``) for the
whole exchange, as RULER does::

    tokens(context) + tokens(question) + tokens(answer_prefix) + max_new_tokens
        + PROMPT_RESERVE_TOKENS + reserve_tokens  <=  length

The context is filled (whole haystack units: sentences, list items, documents) up to that bound,
so it ends within one unit of it. ``PROMPT_RESERVE_TOKENS`` (8) covers a BOS token and the
separators around the answer prefix; a chat template's own tokens are not included (pass them as
``reserve_tokens``). With SmolLM2's tokenizer at 4096 tokens, a NIAH context takes ~3910 tokens
(128 generation tokens, ~40 for question and answer prefix, ~100 with UUID keys), a QA context
~3980 and a VT context ~4000.

**Depth.** Each needle task draws a depth in [0, 1) per sample and stores it on
:attr:`Sample.depth`. The needle holding ``answers[0]`` is inserted at the haystack unit boundary
(a sentence boundary for prose) nearest to that fraction of the haystack's characters, measured
without the needles. Other needles get their own random depths.

**Determinism.** Sample ``i`` of a task depends only on ``(tokenizer, length, seed, task, i)``:
asking for more samples, or for other tasks, leaves it unchanged.

**Differences from RULER.** No worked example is put in the prompts; the QA documents are
generated instead of taken from SQuAD/HotpotQA; depth is measured in characters rather than
tokens; ``niah_single_3`` keeps RULER's word keys with UUID values (``niah_multikey_3`` has UUID
keys and values); the wording of instructions is this project's own.

**Where things are.** This module fits each context to its token budget and makes the samples;
the task plans are in :mod:`~kvfold.evaluate.data.ruler_tasks` (needles, variable tracking, common
and frequent words) and :mod:`~kvfold.evaluate.data.ruler_documents` (question answering); the
haystacks, word lists (package data, ``ruler_words.txt``) and needle placement in
:mod:`~kvfold.evaluate.data.text`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvfold.evaluate.data.ruler_documents import plan_qa1, plan_qa2
from kvfold.evaluate.data.ruler_tasks import NIAH_CONFIGS, VALUE_TOKENS, Plan, plan_cwe, plan_fwe, plan_niah, plan_vt
from kvfold.evaluate.data.samples import Sample, check_tasks
from kvfold.evaluate.data.text import TokenizerLike, count_tokens
from kvfold.runtime.errors import UserError

__all__ = [
    "HEADLINE_TASKS",
    "PROMPT_RESERVE_TOKENS",
    "RULER_MAX_NEW_TOKENS",
    "RULER_TASKS",
    "SUITE_MAX_NEW_TOKENS",
    "TASK_HAYSTACKS",
    "VT_HOPS",
    "generate_ruler",
]

RULER_TASKS: tuple[str, ...] = (
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
"""The 13 task names, in RULER's order."""

RULER_MAX_NEW_TOKENS: dict[str, int] = {
    **{task: 128 for task in RULER_TASKS if task.startswith("niah")},
    "vt": 30,
    "cwe": 120,
    "fwe": 50,
    "qa_1": 32,
    "qa_2": 32,
}
"""Generation budget per task: RULER's ``tokens_to_generate`` (used for official RULER files)."""

HEADLINE_TASKS: tuple[str, ...] = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "qa_1",
)
"""The tasks ``--dataset ruler`` runs by default. ``niah_multikey_1`` is left out: SmolLM2-135M
with the full cache answered 0 of 6 probes at 2K tokens (it returns the first needle whatever the
key). Every task stays runnable by name (``ruler:niah_multikey_1``, ``ruler:all``)."""

TASK_HAYSTACKS: dict[str, str] = {
    **{task: "prose" for task in RULER_TASKS if task.startswith("niah")},
    "niah_single_1": "noise",
    "niah_multikey_2": "noise",
    "niah_multikey_3": "noise",
    "vt": "noise",
    "cwe": "noise",
    "fwe": "noise",
    "qa_1": "prose",
    "qa_2": "prose",
}
"""What each task hides its facts in: ``noise`` (repeated filler sentences, a haystack of
distractor needles, word lists) or ``prose`` (English text: the project's essay, or documents)."""

VT_HOPS = 1
"""Assignments after the first in a variable-tracking chain (RULER: 4)."""

PROMPT_RESERVE_TOKENS = 8
"""Tokens kept free for a BOS token and the separators around the answer prefix."""

SUITE_MAX_NEW_TOKENS: dict[str, int] = {
    **{task: 4 + VALUE_TOKENS[c.value_kind] * c.num_values for task, c in NIAH_CONFIGS.items()},
    "vt": 30,
    "cwe": 120,
    "fwe": 50,
    "qa_1": 16,
    "qa_2": 32,
}
"""Greedy decoding limit per task in this suite: what the longest correct answer needs (RULER
gives needle tasks 128 tokens; a small model then repeats itself, and decoding dominates a sweep)."""


# --- fitting a context to its token budget ----------------------------------------------------


def _fit_units(count_at: Callable[[int], int], budget: int, minimum: int, task: str) -> int:
    """A unit count whose context fits in ``budget`` tokens: the largest, or one within 0.5 % of it.

    Estimates tokens per unit from two probes, then gallops and bisects from the estimate, so a
    long context is tokenised about ten times.
    """
    memo: dict[int, int] = {}

    def tokens(units: int) -> int:
        if units not in memo:
            memo[units] = count_at(units)
        return memo[units]

    if tokens(minimum) > budget:
        raise UserError(
            f"length is too small for task {task!r}: its smallest context takes {tokens(minimum)} tokens, "
            f"but only {budget} are left for the context; increase length"
        )
    probe = minimum + 64
    per_unit = max((tokens(probe) - tokens(minimum)) / 64, 1e-3)
    guess = minimum + max(int((budget - tokens(minimum)) / per_unit), 0)
    step = max(1, int(abs(budget - tokens(guess)) / per_unit) + 1)
    if tokens(guess) <= budget:
        lo, hi = guess, guess + step
        while tokens(hi) <= budget:
            lo, step = hi, step * 2
            hi = lo + step
    else:
        lo, hi = max(minimum, guess - step), guess
        while tokens(lo) > budget:
            hi, step = lo, step * 2
            lo = max(minimum, hi - step)
    while hi - lo > 1 and budget - tokens(lo) > budget // 200:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if tokens(mid) <= budget else (lo, mid)
    return lo


# --- public entry point --------------------------------------------------------------------------


def _plan(task: str, seed: str) -> Plan:
    """The plan for one context of ``task``."""
    if task in NIAH_CONFIGS:
        return plan_niah(NIAH_CONFIGS[task], seed)
    if task == "vt":
        return plan_vt(seed, VT_HOPS)
    if task == "cwe":
        return plan_cwe(seed)
    if task == "fwe":
        return plan_fwe(seed)
    return plan_qa1(seed) if task == "qa_1" else plan_qa2(seed)


def _generate_context(
    tokenizer: TokenizerLike, task: str, length: int, seed: int, index: int, reserve_tokens: int
) -> list[Sample]:
    """Context ``index`` of ``task``, fitted to the token budget, with one sample per question."""
    plan = _plan(task, f"kvfold-ruler/{seed}/{task}/{index}")
    max_new_tokens = SUITE_MAX_NEW_TOKENS[task]
    longest = max(count_tokens(tokenizer, q.question + q.answer_prefix) for q in plan.questions)
    budget = length - longest - max_new_tokens - PROMPT_RESERVE_TOKENS - reserve_tokens
    units = _fit_units(lambda n: count_tokens(tokenizer, plan.build(n)), budget, plan.min_units, task)
    context = plan.build(units)
    base_id = f"{task}/{length}/seed{seed}/{index}"
    return [
        Sample(
            context=context,
            question=q.question,
            answers=q.answers,
            task=task,
            answer_prefix=q.answer_prefix,
            max_new_tokens=max_new_tokens,
            metric="string_match_part" if task.startswith("qa") else "string_match_all",
            sample_id=base_id if len(plan.questions) == 1 else f"{base_id}/q{k}",
            depth=plan.depth if q.depth is None else q.depth,
            length=length,
            haystack=TASK_HAYSTACKS[task],
        )
        for k, q in enumerate(plan.questions)
    ]


def generate_ruler(
    tokenizer: TokenizerLike,
    length: int,
    samples_per_task: int,
    seed: int = 0,
    tasks: Sequence[str] | None = None,
    *,
    reserve_tokens: int = 0,
) -> list[Sample]:
    """Generates the synthetic RULER-style suite at a length measured in the model's tokens.

    Args:
        tokenizer: The model's Hugging Face tokenizer (or any callable returning ``input_ids``).
        length: Token budget of a whole exchange: context, question, answer prefix and
            ``max_new_tokens`` (see the module docstring).
        samples_per_task: Samples per task.
        seed: Generation seed; sample ``i`` of a task depends only on (tokenizer, length, seed, i).
        tasks: Task names from :data:`RULER_TASKS`; all of them when ``None``.
        reserve_tokens: Further tokens to keep free, e.g. for the model's chat template.

    Returns:
        ``samples_per_task`` samples per task, grouped by task in the order given.

    Raises:
        ValueError: On an unknown task name, a non-positive ``samples_per_task``, or a ``length``
            too small for a task's question and smallest context.

    Example:
        >>> samples = generate_ruler(tokenizer, 4096, 10, tasks=["niah_single_1"])  # doctest: +SKIP
        >>> samples[0].answers[0] in samples[0].context  # doctest: +SKIP
        True
    """
    selected = check_tasks(tasks, RULER_TASKS, "RULER")
    if samples_per_task < 1:
        raise UserError(f"samples_per_task must be a positive int; got {samples_per_task}")
    if length < 1:
        raise UserError(f"length must be a positive number of tokens; got {length}")
    return [
        sample
        for task in dict.fromkeys(selected)
        for index in range(samples_per_task)
        for sample in _generate_context(tokenizer, task, length, seed, index, reserve_tokens)
    ]
