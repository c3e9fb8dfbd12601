"""The question-answering tasks of the synthetic RULER suite: questions over generated documents.

Fictional biographies and company profiles stand in for RULER's SQuAD and HotpotQA documents
(RULER, Hsieh et al., 2024, §3): ``qa_1`` asks a fact stated in one biography hidden in the
prose haystack (SQuAD-like); ``qa_2`` is two-hop (HotpotQA-like): the person's biography names an
employer whose profile holds the answer, among distractor documents. See
:mod:`kvfold.evaluate.data.ruler` for the suite.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Mapping, Sequence

from kvfold.evaluate.data.ruler_tasks import Plan, Question
from kvfold.evaluate.data.text import Stream, cycle, haystack_sentences, insert_at_depths, load_haystack, word_list

__all__ = ["plan_qa1", "plan_qa2"]


def _article(word: str) -> str:
    return "an" if word[0].lower() in "aeiou" else "a"


def _person_name(rng: random.Random) -> str:
    return f"{rng.choice(word_list('first_names'))} {rng.choice(word_list('last_names'))}"


def _town(rng: random.Random) -> str:
    return rng.choice(word_list("town_starts")) + rng.choice(word_list("town_ends"))


def _company_name(rng: random.Random) -> str:
    adjective, noun = rng.choice(word_list("adjectives")).title(), rng.choice(word_list("nouns")).title()
    return f"{adjective} {noun} {rng.choice(word_list('company_suffixes'))}"


def _person(rng: random.Random, name: str, employer: str) -> dict[str, str]:
    """Facts of a fictional person."""
    return {
        "name": name,
        "city": _town(rng),
        "year": str(rng.randint(1900, 1999)),
        "field": rng.choice(word_list("fields")),
        "university": _town(rng),
        "occupation": rng.choice(word_list("occupations")),
        "employer": employer,
        "instrument": rng.choice(word_list("instruments")),
    }


def _biography(p: Mapping[str, str]) -> str:
    """A biography whose every sentence names the person in full.

    Each fact sits in its own sentence after the full name, so a question about one person can be
    answered by completing a sentence that starts the same way (see :data:`QA1_QUESTIONS`).
    """
    name = p["name"]
    return (
        f"{name} was born in {p['year']}. {name} grew up in the town of {p['city']}. {name} studied "
        f"{p['field']} at the University of {p['university']}. {name} later worked as "
        f"{_article(p['occupation'])} {p['occupation']} for {p['employer']}. Outside work, {name} "
        f"played the {p['instrument']}."
    )


def _company(rng: random.Random, name: str) -> dict[str, str]:
    """Facts of a fictional company."""
    return {
        "name": name,
        "industry": rng.choice(word_list("industries")),
        "year": str(rng.randint(1850, 1995)),
        "founder": _person_name(rng),
        "city": _town(rng),
        "staff": str(rng.randrange(20, 5000, 10)),
    }


def _company_profile(c: Mapping[str, str]) -> str:
    return (
        f"{c['name']} is {_article(c['industry'])} {c['industry']} company founded in {c['year']} by "
        f"{c['founder']}. Its headquarters are in {c['city']}, and it employs about {c['staff']} people."
    )


QA1_QUESTIONS = (
    ("In which town did {name} grow up?", "city", "{name} grew up in the town of"),
    ("In which year was {name} born?", "year", "{name} was born in"),
    ("What did {name} study at university?", "field", "{name} studied"),
    ("Which instrument did {name} play?", "instrument", "Outside work, {name} played the"),
    ("What did {name} work as?", "occupation", "{name} later worked as"),
)
"""``(question, fact, answer prefix)``: the prefix restates the start of the sentence holding the
fact, as a needle's answer prefix does ("... is"); it names only the person already named in the
question, never the fact. Measured on SmolLM2-135M (full cache, 2K): with a bare ``"Answer:"``
prefix the model answers in the right form with another person's fact (0 of 8)."""

QA2_QUESTIONS = (
    ("In which city is the company that {name} worked for headquartered?", "city"),
    ("Who founded the company that {name} worked for?", "founder"),
    ("In which year was the company that {name} worked for founded?", "year"),
)
"""``(question, fact of the company)`` of the two-hop task."""


def _distractor_documents(seed: str, person_name: str, company_name: str, answer: str) -> Callable[[int], list[str]]:
    """``docs(n)``: the first ``n`` distractor documents (biographies and company profiles).

    None of them is about the gold person or the gold company, and none contains the answer, so
    the answer occurs in the context exactly once.
    """

    def document(rng: random.Random) -> str:
        text = one_document(rng)
        while answer in text:
            text = one_document(rng)
        return text

    def one_document(rng: random.Random) -> str:
        if rng.random() < 0.5:
            name = _person_name(rng)
            while name == person_name:
                name = _person_name(rng)
            employer = _company_name(rng)
            return _biography(_person(rng, name, employer))
        name = _company_name(rng)
        while name == company_name:
            name = _company_name(rng)
        return _company_profile(_company(rng, name))

    return Stream(f"{seed}/documents", document).take


def _qa_context(distractors: Callable[[int], list[str]], gold: Sequence[tuple[float, str]], n: int) -> str:
    """Numbered documents: ``n`` distractors with the gold documents inserted at their depths."""
    documents = insert_at_depths(distractors(n), gold, "\n\n")
    numbered = "\n\n".join(f"Document {i + 1}:\n{doc}" for i, doc in enumerate(documents))
    return "The following documents are given.\n\n" + numbered


def _askable_questions(person: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """The :data:`QA1_QUESTIONS` whose answer occurs once in the person's biography and nowhere
    in the prose haystack (so the answer occurs in the context exactly once, at any length)."""
    prose = " ".join(load_haystack().split()).lower()
    biography = _biography(person).lower()
    askable = []
    for question in QA1_QUESTIONS:
        pattern = re.compile(rf"\b{re.escape(person[question[1]].lower())}\b")
        if len(pattern.findall(biography)) == 1 and not pattern.search(prose):
            askable.append(question)
    return askable


def plan_qa1(seed: str) -> Plan:
    """A fact about a generated person whose biography is hidden in the prose haystack."""
    rng = random.Random(seed)
    person = _person(rng, _person_name(rng), _company_name(rng))
    while not (askable := _askable_questions(person)):
        person = _person(rng, _person_name(rng), _company_name(rng))
    template, field, sentence_start = rng.choice(askable)
    depth = rng.random()
    sentences = haystack_sentences()
    start = rng.randrange(len(sentences))
    gold = [(depth, _biography(person))]
    asked = Question(
        "\n\nAnswer the question based on the text above. Only give the answer and no other words."
        f"\n\nQuestion: {template.format(name=person['name'])}",
        (person[field],),
        "Answer: " + sentence_start.format(name=person["name"]),
    )
    preamble = "The biography of a person is hidden in the text below. Memorize it.\n"

    def build(units: int) -> str:
        return preamble + " ".join(insert_at_depths(cycle(sentences, start, units), gold, " "))

    return Plan((asked,), build, depth)


def plan_qa2(seed: str) -> Plan:
    """A question about the company a generated person worked for, among generated documents."""
    rng = random.Random(seed)
    company = _company(rng, _company_name(rng))
    person = _person(rng, _person_name(rng), company["name"])
    depth = rng.random()
    template, field = rng.choice(QA2_QUESTIONS)
    answer = company[field]
    gold = [(depth, _company_profile(company)), (rng.random(), _biography(person))]
    distractors = _distractor_documents(seed, person["name"], company["name"], answer)
    asked = Question(
        "\n\nAnswer the question based on the given documents. Only give the answer and no other "
        f"words.\n\nQuestion: {template.format(name=person['name'])}",
        (answer,),
        "Answer:",
    )
    return Plan((asked,), lambda n: _qa_context(distractors, gold, n), depth)
