"""kvfold as an lm-evaluation-harness model, on a tiny random Llama saved with a tiny trained tokenizer.

Skipped when lm-eval is not installed (``pip install kvfold[lm-eval]``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import kvfold  # noqa: E402
from kvfold.integrations.lm_eval import ContextSplit, KVFoldLM  # noqa: E402
from tests.conftest import make_tiny_model  # noqa: E402

TASK_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "lm_eval_task"
DOCS = [json.loads(line) for line in (TASK_DIR / "kvfold_tiny.jsonl").read_text().splitlines()]


def save_tiny_model(directory: Path) -> Path:
    """A tiny random Llama and a byte-level BPE tokenizer trained on the task's documents, saved as an HF directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [f"{d['context']}\n\nQuestion: {d['question']}\nAnswer: {' '.join(d['choices'])}" for d in DOCS]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    model = make_tiny_model(
        "llama",
        vocab_size=len(tokenizer),
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        max_position_embeddings=1024,
        initializer_range=0.2,  # sharper than the default 0.02: greedy text that depends on positions
    )
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def stock(tiny_dir):
    """The same weights in stock transformers (SDPA attention, no kvfold)."""
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


def make_lm(tiny_dir: Path, **kwargs) -> KVFoldLM:
    return KVFoldLM(pretrained=str(tiny_dir), device="cpu", **kwargs)


def prompt(doc: dict) -> str:
    return f"{doc['context']}\n\nQuestion: {doc['question']}\nAnswer:"


def ll_requests(docs: list[dict]) -> list[Instance]:
    pairs = [(prompt(d), " " + c) for d in docs for c in d["choices"]]
    return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]


@torch.inference_mode()
def stock_loglikelihood(model, lm: KVFoldLM, context: str, continuation: str) -> tuple[float, bool]:
    """Sum of the continuation's log-probs from one stock forward over context + continuation."""
    if context:
        ctx, cont = lm._encode_pair(context, continuation)
    else:  # lm-eval conditions an empty context on the BOS token
        ctx, cont = [lm.prefix_token_id], lm.tok_encode(continuation, add_special_tokens=False)
    ids = torch.tensor([ctx + cont])
    logits = model(ids).logits[0, len(ctx) - 1 : -1].float()
    target = torch.tensor(cont)
    logprobs = torch.log_softmax(logits, -1).gather(-1, target[:, None])
    return float(logprobs.sum()), bool((logits.argmax(-1) == target).all())


def greedy_request(model, lm: KVFoldLM) -> tuple[str, str]:
    """A (context, continuation): the stock model's greedy text, whose tokens survive re-encoding."""
    for n in (3, 2, 1):
        for doc in DOCS:
            ids = torch.tensor([lm.tok_encode(prompt(doc))])
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            pair = (prompt(doc), lm.tok_decode(out[0, ids.shape[1] :].tolist()))
            if stock_loglikelihood(model, lm, *pair)[1]:
                return pair
    raise AssertionError("no greedy continuation survives re-tokenization")


# --------------------------------------------------------------------------- budget 1.0 = stock transformers


@pytest.mark.parametrize(("batch_size", "split"), [(1, "paragraph"), (3, "paragraph"), (3, "all"), (2, "tokens:5")])
def test_full_budget_loglikelihood_equals_stock(tiny_dir, stock, batch_size, split):
    """Whatever the split and batching, budget 1.0 is the uncompressed model."""
    lm = make_lm(tiny_dir, method="snapkv", budget=1.0, batch_size=batch_size, context_split=split)
    requests = ll_requests(DOCS[:3])
    requests.append(Instance("loglikelihood", {}, greedy_request(stock, lm), len(requests)))
    requests.append(Instance("loglikelihood", {}, ("", "The river was calm"), len(requests)))
    ours = lm.loglikelihood(requests, disable_tqdm=True)
    expected = [stock_loglikelihood(stock, lm, *r.args) for r in requests]
    assert expected[-2][1] and not expected[0][1]
    for (ll, is_greedy), (ll_ref, greedy_ref) in zip(ours, expected, strict=True):
        assert ll == pytest.approx(ll_ref, abs=1e-4)
        assert is_greedy == greedy_ref
    assert lm.compressions == len({r.args[0] for r in requests})  # one per distinct context


def test_full_budget_generate_equals_stock_greedy(tiny_dir, stock):
    lm = make_lm(tiny_dir, method="full", budget=1.0)
    for doc in DOCS[:3]:
        ids = torch.tensor([lm.tok_encode(prompt(doc))])
        out = stock.generate(ids, max_new_tokens=10, do_sample=False)
        reference = lm.tok_decode(out[0, ids.shape[1] :].tolist())
        assert reference, "the stock model generated nothing to compare with"
        stop = reference[len(reference) // 2 : len(reference) // 2 + 2]
        gen = [
            Instance("generate_until", {}, (prompt(doc), {"until": [], "max_gen_toks": 10}), 0),
            Instance("generate_until", {}, (prompt(doc), {"until": [stop], "max_gen_toks": 10}), 1),
        ]
        assert lm.generate_until(gen, disable_tqdm=True) == [reference, reference.split(stop)[0]]
        forwards: list[int] = []
        handle = lm.model.register_forward_hook(lambda *_, marks=forwards: marks.append(1))
        try:
            for request in gen:
                lm.generate_until([request], disable_tqdm=True)
                forwards.append(0)
        finally:
            handle.remove()
        full_run, stopped = (sum(run) for run in _runs(forwards))
        assert stopped < full_run, "decoding goes on after an until string"


def _runs(marks: list[int]) -> list[list[int]]:
    """Split a list of 1s at its 0s."""
    runs, current = [], []
    for mark in marks:
        if mark:
            current.append(mark)
        else:
            runs.append(current)
            current = []
    return runs


# ----------------------------------------------------------------- compression is applied, as kvfold's pipeline


@torch.inference_mode()
def pipeline_loglikelihood(lm: KVFoldLM, context: str, continuation: str, method: str, budget: float) -> float:
    """kvfold's own path: prefill the context's paragraph before the question, compress, teacher-force the rest."""
    ctx, cont = lm._encode_pair(context, continuation)
    head = context.rstrip()[: context.rstrip().rfind("\n\n")]
    prefilled = kvfold.prefill(lm.model, lm.tokenizer, head)
    cut = prefilled.input_ids.shape[1]
    assert prefilled.input_ids[0].tolist() == ctx[:cut], "the paragraph must tokenize as a prefix of the prompt"
    compressed = prefilled.compress(method, budget)
    cache = compressed.cache.copy()
    tail = (ctx + cont)[cut:]
    start = cache.get_seq_length()
    logits = lm.model(
        input_ids=torch.tensor([tail[:-1]]),
        past_key_values=cache,
        position_ids=torch.arange(start, start + len(tail) - 1)[None],
    ).logits[0]
    predicting = torch.cat([prefilled.last_logits, logits], dim=0)[-len(cont) :].float()
    return float(torch.log_softmax(predicting, -1).gather(-1, torch.tensor(cont)[:, None]).sum())


@pytest.mark.parametrize("method", ["snapkv", "streamingllm+keepkv"])
def test_compressed_loglikelihood_differs_from_full_and_equals_pipeline(tiny_dir, method):
    requests = ll_requests(DOCS[:2])
    full = make_lm(tiny_dir, method="full").loglikelihood(requests, disable_tqdm=True)
    lm = make_lm(tiny_dir, method=method, budget=0.3, batch_size=2)
    ours = lm.loglikelihood(requests, disable_tqdm=True)
    assert max(abs(a[0] - b[0]) for a, b in zip(ours, full, strict=True)) > 1e-3, "compression changed nothing"
    for request, (ll, _) in zip(requests, ours, strict=True):
        assert ll == pytest.approx(pipeline_loglikelihood(lm, *request.args, method, 0.3), abs=1e-4)
    assert lm.compressions == 2  # one compression per context, shared by its 4 choices
    assert lm.get_model_info()["kvfold_kv_ratio"] < 0.5


@pytest.mark.parametrize("method", ["snapkv", "streamingllm"])
def test_generate_equals_kvfold_answer(tiny_dir, method):
    """The lm-eval answer is kvfold's own ``CompressedContext.answer`` for the same context/question split."""
    lm = make_lm(tiny_dir, method=method, budget=0.3)
    full = make_lm(tiny_dir, method="full")
    requests, expected = [], []
    for i, doc in enumerate(DOCS[:3]):
        question = f"Question: {doc['question']}\nAnswer:"
        compressed = kvfold.prefill(lm.model, lm.tokenizer, doc["context"]).compress(method, 0.3)
        expected.append(compressed.answer(question, max_new_tokens=8))
        text = doc["context"] + "\n\n" + question + "\n"  # kvfold's prompt format without a chat template
        requests.append(Instance("generate_until", {}, (text, {"until": [], "max_gen_toks": 8}), i))
    assert lm.generate_until(requests, disable_tqdm=True) == expected
    assert full.generate_until(requests, disable_tqdm=True) != expected, "compression changed no answer"


@pytest.mark.parametrize("split", ["paragraph", "all"])
def test_batched_rows_equal_single_rows(tiny_dir, split):
    requests = ll_requests(DOCS[:4])
    single = make_lm(tiny_dir, method="snapkv", budget=0.3, context_split=split)
    batched = make_lm(tiny_dir, method="snapkv", budget=0.3, batch_size=4, context_split=split)
    single, batched = (lm.loglikelihood(requests, disable_tqdm=True) for lm in (single, batched))
    for a, b in zip(single, batched, strict=True):
        assert a[0] == pytest.approx(b[0], abs=1e-4)


# --------------------------------------------------------------------------- arguments, split rules, registration


def test_context_split_rules():
    ids = list(range(100))
    assert ContextSplit.parse("paragraph").cut(ids, 90) == 90
    assert ContextSplit.parse("paragraph").cut(ids, 10) == 100 - 64  # at most 64 tokens stay whole
    assert ContextSplit.parse("paragraph", max_suffix_tokens=8).cut(ids, 0) == 92
    assert ContextSplit.parse("tokens:32").cut(ids, None) == 68
    assert ContextSplit.parse("tokens:500").cut(ids, None) == 1  # at least one token is compressed
    assert ContextSplit.parse("all").cut(ids, None) == 100
    assert ContextSplit.parse("line").char_position("a\n\nb\nc") == 4
    assert ContextSplit.parse("paragraph").char_position("a\n\nb\nc") == 1
    assert ContextSplit.parse("paragraph").char_position("no blank line") == 0
    assert ContextSplit.parse(r"sep:\nQ").separator == "\nQ"
    assert ContextSplit.parse(r"sep:\nQ").label() == r"sep:\nQ"
    with pytest.raises(ValueError, match="valid: paragraph, line, sep:TEXT, tokens:N, all"):
        ContextSplit.parse("sentence")


def test_split_falls_on_the_prompt_tokens(tiny_dir):
    lm = make_lm(tiny_dir)
    text = prompt(DOCS[0])
    ids = lm.tok_encode(text)
    cut = lm.split_point(text, ids)
    head = text[: text.rfind("\n\n")]
    assert ids[:cut] == lm.tok_encode(head)
    assert lm.tok_decode(ids[cut:]) == text[len(head) :]
    assert make_lm(tiny_dir, context_split="all").split_point(text, ids) == len(ids)


def test_bad_arguments_say_what_is_valid(tiny_dir):
    with pytest.raises(ValueError, match="methods: .*snapkv.*kvfold methods"):
        make_lm(tiny_dir, method="snapkvv")
    with pytest.raises(ValueError, match=r"fraction in \(0, 1\]"):
        make_lm(tiny_dir, budget=1.5)
    with pytest.raises(ValueError, match="unknown context_split"):
        make_lm(tiny_dir, context_split="middle")
    with pytest.raises(ValueError, match="unknown argument.*budjet.*valid: pretrained"):
        make_lm(tiny_dir, budjet=0.1)
    with pytest.raises(NotImplementedError, match="loglikelihood_rolling"):
        make_lm(tiny_dir).loglikelihood_rolling([])
    sampling = Instance("generate_until", {}, ("a b", {"do_sample": True, "temperature": 0.7}), 0)
    with pytest.raises(ValueError, match="decodes greedily"):
        make_lm(tiny_dir).generate_until([sampling])


def test_registered_with_lm_eval_and_brackets_in_model_args(tiny_dir):
    from lm_eval.api.registry import get_model

    assert get_model("kvfold") is KVFoldLM
    assert get_model("hf").__name__ == "HFLM"  # lm-eval's own models are still found
    lm = KVFoldLM.create_from_arg_string(
        f"pretrained={tiny_dir},method=snapkv[window=8,pooling=max]+keepkv,budget=0.2,context_split=tokens:16",
        {"device": "cpu", "batch_size": None},
    )
    assert lm.method_spec == "snapkv[window=8,pooling=max]+keepkv"
    assert lm.budget.fraction == 0.2
    assert lm.context_split.label() == "tokens:16"


# --------------------------------------------------------------------------- end to end through lm-eval


def test_simple_evaluate_kvfold_equals_hf_at_full_budget(tiny_dir):
    """The local tasks of benchmarks/lm_eval_task through lm-eval: hf, kvfold at 1.0 (equal) and at 0.1."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = ["kvfold_tiny_mc", "kvfold_tiny_gen"]
    manager = TaskManager(include_path=str(TASK_DIR), include_defaults=False)  # lm-eval's own tasks take seconds

    def run(model: str, model_args: str) -> dict:
        return lm_eval.simple_evaluate(
            model=model,
            model_args=model_args,
            tasks=tasks,
            device="cpu",
            batch_size=1,
            log_samples=True,
            task_manager=manager,
        )

    hf = run("hf", f"pretrained={tiny_dir},dtype=float32")
    full = run("kvfold", f"pretrained={tiny_dir},method=snapkv,budget=1.0")
    small = run("kvfold", f"pretrained={tiny_dir},method=snapkv,budget=0.1")
    for task in tasks:
        assert full["results"][task] == pytest.approx(hf["results"][task], abs=1e-9)
    resps = {name: _responses(r, tasks) for name, r in (("hf", hf), ("full", full), ("small", small))}
    assert len(resps["hf"]) == 8 * 4 + 8
    for ours, theirs in zip(resps["full"], resps["hf"], strict=True):
        if isinstance(theirs, str):
            assert ours == theirs
        else:
            assert ours[0] == pytest.approx(theirs[0], abs=1e-4) and ours[1] == theirs[1]
    changed = [a != b for a, b in zip(resps["small"], resps["full"], strict=True)]
    assert sum(changed) > len(changed) // 2, "budget 0.1 left most responses unchanged"
    assert small["config"]["kvfold_budget"] == 0.1 and small["config"]["kvfold_kv_ratio"] < 0.3


def _responses(results: dict, tasks: list[str]) -> list:
    """Every raw response of the run, in document and choice order."""
    out = []
    for task in tasks:
        for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"]):
            for resp in sample["resps"]:
                out.append(resp[0] if isinstance(resp[0], str) else tuple(resp[0]))
    return out


# --------------------------------------------------------------------------- the embedded SmolLM2, chat template


@pytest.mark.model
def test_smollm2_chat_prompt_full_equals_stock_and_answers_equal_kvfold(smollm2):
    """A real BPE tokenizer and chat template: budget 1.0 is stock transformers; compressed answers are kvfold's."""
    model, tokenizer = smollm2
    doc = DOCS[0]
    question = f"Question: {doc['question']}\nAnswer:"
    lm = KVFoldLM(pretrained=model, tokenizer=tokenizer, method="full")
    text = lm.apply_chat_template([{"role": "user", "content": doc["context"] + "\n\n" + question}])
    requests = [Instance("loglikelihood", {}, (text, city), i) for i, city in enumerate(doc["choices"])]
    ours = lm.loglikelihood(requests, disable_tqdm=True)
    model.set_attn_implementation("sdpa")
    try:
        expected = [stock_loglikelihood(model, lm, *r.args) for r in requests]
    finally:
        model.set_attn_implementation("kvfold")
    for (ll, greedy), (ll_ref, greedy_ref) in zip(ours, expected, strict=True):
        assert ll == pytest.approx(ll_ref, abs=1e-4) and greedy == greedy_ref
    for method in ("snapkv", "streamingllm"):
        compressed = kvfold.prefill(model, tokenizer, doc["context"]).compress(method, 0.3)
        expected_answer = compressed.answer(question, max_new_tokens=12)
        lm = KVFoldLM(pretrained=model, tokenizer=tokenizer, method=method, budget=0.3)
        request = Instance("generate_until", {}, (text, {"until": [], "max_gen_toks": 12}), 0)
        assert lm.generate_until([request], disable_tqdm=True) == [expected_answer]


def test_whole_prompt_split_leaves_the_first_continuation_token_to_the_prefill(tiny_dir):
    """Under ``all`` the token after the prompt comes from the uncompressed prefill (documented)."""
    requests = ll_requests(DOCS[:1])
    lm = make_lm(tiny_dir, method="snapkv", budget=0.1, context_split="all")
    full = make_lm(tiny_dir, method="full", context_split="all")
    one_token = [r for r in requests if len(lm._encode_pair(*r.args)[1]) == 1]
    assert one_token, "no one-token continuation among the choices"
    assert lm.loglikelihood(one_token, disable_tqdm=True) == full.loglikelihood(one_token, disable_tqdm=True)
    assert lm.get_model_info()["kvfold_kv_ratio"] < 0.2
