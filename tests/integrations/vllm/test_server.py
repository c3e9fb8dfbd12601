"""``kvfold serve``: vLLM answers from saved caches as ``kvfold ask`` does (the shared server of conftest)."""

from __future__ import annotations

import math
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import kvfold
from kvfold.evaluate.data.logbook import FACTS
from kvfold.integrations.vllm.layout import read_cache_file
from kvfold.integrations.vllm.pool_layout import pool_rows, served_plan
from kvfold.integrations.vllm.settings import BLOCK_SIZE
from kvfold.runtime.models import resolve_spec
from kvfold.runtime.prompts import build_prompt, encode
from kvfold.store.format import read_info
from tests.integrations.vllm.conftest import (
    ANSWER_TOKENS,
    HELD_GIB,
    LOGPROB_TOLERANCE,
    MEMORY,
    METHODS,
    PAIR,
    SERVED,
    _free_port,
    stock_greedy,
    worst_logprob_difference,
)


def _answer_ids(response: dict, eos: set[int]) -> list[int]:
    ids = list(response["choices"][0]["token_ids"])
    return ids[:-1] if ids and ids[-1] in eos else ids


def _eos(model, tokenizer) -> set[int]:
    from kvfold.pipeline.context import eos_ids

    return eos_ids(model, tokenizer)


def test_the_server_lists_the_caches(server, saved):
    status, body = server.request("/v1/kvfold/caches")
    assert status == 200
    rows = {row["name"]: row for row in body["data"]}
    assert set(METHODS) <= set(rows)
    assert rows["am_fit"]["method"] == "kvzip+am_fit" and rows["am_fit"]["budget"] == 0.1


def test_a_full_cache_answers_as_kvfold_and_stock_transformers(server, saved, model_and_tokenizer):
    """No compression: the same 24 greedy tokens (EOS ignored) from vLLM, kvfold and plain transformers."""
    model, tokenizer = model_and_tokenizer
    name = f"code{PAIR[1][0]}"
    question = "Repeat the secret code of the archive, then describe the archive in a long sentence."
    status, body = server.ask(name, question, max_tokens=ANSWER_TOKENS, ignore_eos=True)
    assert status == 200, body
    served = list(body["choices"][0]["token_ids"])
    assert len(served) == ANSWER_TOKENS >= 16

    context = kvfold.load_context(saved[name], model, tokenizer)
    suffix = encode(tokenizer, build_prompt(tokenizer, "", question).suffix, special=False)
    from kvfold.pipeline.context import greedy_decode

    ours = greedy_decode(model, tokenizer, context.decode_cache(), suffix, ANSWER_TOKENS, stop_at_eos=False).token_ids

    stock = AutoModelForCausalLM.from_pretrained(resolve_spec("smollm2-135m")[0], dtype=torch.float32).eval()
    text = " ".join([PAIR[0].format(PAIR[1][0])] * 4)
    ids = torch.tensor([encode(tokenizer, build_prompt(tokenizer, text, question).context, special=True) + suffix])
    assert served == ours == stock_greedy(stock, ids, ANSWER_TOKENS)


@pytest.mark.parametrize("name", sorted(SERVED))
def test_compressed_caches_answer_the_five_questions_as_kvfold_ask(
    server, saved, references, model_and_tokenizer, name
):
    model, tokenizer = model_and_tokenizer
    eos = _eos(model, tokenizer)
    for _, question, _ in FACTS:
        status, body = server.ask(name, question)
        assert status == 200, body
        assert _answer_ids(body, eos) == references[name][question], question


@pytest.mark.parametrize("name", sorted(SERVED))
def test_log_probabilities_agree_with_kvfold(server, saved, model_and_tokenizer, name):
    """Every generated step's top-5 log-probabilities, against kvfold's teacher-forced on vLLM's tokens."""
    model, tokenizer = model_and_tokenizer
    question = FACTS[0][1]
    status, body = server.ask(name, question, logprobs=True, top_logprobs=5, return_tokens_as_token_ids=True)
    assert status == 200, body
    steps = body["choices"][0]["logprobs"]["content"]
    served = body["choices"][0]["token_ids"]
    context = kvfold.load_context(saved[name], model, tokenizer)
    cache = context.decode_cache()
    suffix = encode(tokenizer, build_prompt(tokenizer, "", question).suffix, special=False)
    ids = torch.tensor([suffix + served[:-1]])
    start = cache.get_seq_length()
    with torch.inference_mode():
        logits = model(ids, past_key_values=cache, position_ids=torch.arange(start, start + ids.shape[1])[None]).logits
    ours = torch.log_softmax(logits[0, len(suffix) - 1 :].double(), -1)
    assert worst_logprob_difference(steps, ours) < LOGPROB_TOLERANCE


@pytest.mark.parametrize("name", sorted(SERVED))
def test_a_request_holds_its_files_bytes_and_its_questions_blocks(server, saved, model_and_tokenizer, name):
    """vLLM's own block count for a request: ceil(file bytes / block bytes) for the file (within 5% of
    its rows' bytes, plus the last block), then the question's and answer's. A tenth of the context at
    keep 0.1, whatever the rows' lengths; ``--memory`` files at their fraction of the bytes."""
    model, tokenizer = model_and_tokenizer
    question = FACTS[2][1]
    status, body = server.ask(name, question)
    assert status == 200, body
    params = body["kv_transfer_params"]
    slots, blocks, block_size = params["kvfold_slots"], params["kvfold_blocks"], params["kvfold_block_size"]
    block_bytes = params["kvfold_block_bytes"]
    suffix = encode(tokenizer, build_prompt(tokenizer, "", question).suffix, special=False)
    prompt, generated = body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]
    assert prompt == slots + len(suffix) and slots % block_size == 0
    own = math.ceil((len(suffix) + generated - 1) / block_size)  # the last token's entry is never written
    assert blocks == slots // block_size + own
    cache, _ = read_cache_file(saved[name], model.config)
    served = served_plan(cache, model.config, BLOCK_SIZE, torch.float32)
    assert served.block_bytes == block_bytes and served.placeholders == slots
    file_bytes = sum(rows.nbytes() for rows in pool_rows(cache))  # float32 rows, as served here
    assert file_bytes <= (slots // block_size) * block_bytes <= 1.05 * file_bytes + block_bytes
    context_tokens = read_info(saved[name]).context_tokens[0]
    full_blocks = math.ceil(context_tokens / block_size)
    fraction = 2 * MEMORY[name] if name in MEMORY else 0.1  # float32 blocks: a 16-bit fraction is half of them
    assert slots // block_size <= math.ceil(1.1 * fraction * full_blocks) + 1


def test_prefix_caching_never_mixes_two_caches(server, saved, model_and_tokenizer):
    """Two caches of one length give the same prompt ids; the second must still answer from its own file."""
    model, tokenizer = model_and_tokenizer
    eos = _eos(model, tokenizer)
    question = "What is the secret code of the archive?"
    slots = {
        number: served_plan(
            read_cache_file(saved[f"code{number}"], model.config)[0], model.config, BLOCK_SIZE, torch.float32
        ).placeholders
        for number in PAIR[1]
    }
    assert len(set(slots.values())) == 1, slots  # the same placeholder prompt for both files
    answers = {}
    for number in PAIR[1]:
        status, body = server.ask(f"code{number}", question, max_tokens=16)
        assert status == 200, body
        assert body["kv_transfer_params"]["kvfold_slots"] == slots[number]
        answers[number] = tokenizer.decode(_answer_ids(body, eos))
        context = kvfold.load_context(saved[f"code{number}"], model, tokenizer)
        assert _answer_ids(body, eos) == context.generate(question, max_new_tokens=16)[0].token_ids
    assert PAIR[1][0] in answers[PAIR[1][0]] and PAIR[1][1] in answers[PAIR[1][1]]


def test_a_request_without_a_cache_is_plain_vllm_at_stock_bytes(server, saved, model_and_tokenizer):
    """A request without a cache: vLLM's tokens are transformers'; and every block of the engine holds
    what stock vLLM's Llama holds (vLLM's own KV tensors' bytes over its block count, as a file's
    request reports them): keys and values of 64 channels, no channel added for β."""
    model, tokenizer = model_and_tokenizer
    status, body = server.ask(None, "Name three colours.", max_tokens=12, ignore_eos=True)
    assert status == 200, body
    ids = torch.tensor([body["prompt_token_ids"]])
    assert body["choices"][0]["token_ids"] == stock_greedy(model, ids, 12)
    status, body = server.ask("kvzip", FACTS[0][1], max_tokens=2)
    assert status == 200, body
    config = model.config
    stock = BLOCK_SIZE * config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 4
    assert body["kv_transfer_params"]["kvfold_block_bytes"] == stock == 1_474_560


def test_bad_requests_get_an_error_and_the_server_keeps_serving(server, saved, scratch_cache, tmp_path, references):
    status, body = server.ask("no-such-cache", "Anything?")
    assert status == 404 and "no cache named" in body["error"]["message"]
    status, body = server.ask("../etc/passwd", "Anything?")
    assert status == 400

    damaged = scratch_cache("damaged", saved["kvzip"])
    data = bytearray(damaged.read_bytes())
    data[-100] ^= 0xFF
    damaged.write_bytes(bytes(data))
    status, body = server.ask("damaged", "Anything?")
    assert status == 422 and "checksum" in body["error"]["message"]

    truncated = scratch_cache("truncated")
    truncated.write_bytes(saved["kvzip"].read_bytes()[:5000])
    status, body = server.ask("truncated", "Anything?")
    assert status == 422 and "truncated" in body["error"]["message"]

    status, body = server.request(
        "/v1/chat/completions",
        {
            "model": "smollm2-135m",
            "messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}],
            "kv_transfer_params": {"kvfold_cache": "kvzip"},
        },
    )
    assert status == 400 and "exactly one message" in body["error"]["message"]

    status, body = server.request(
        "/v1/completions",
        {"model": "smollm2-135m", "prompt": "x", "kv_transfer_params": {"kvfold_cache": "kvzip"}},
    )
    assert status == 400 and "/v1/chat/completions only" in body["error"]["message"]

    question = FACTS[1][1]
    status, body = server.ask("kvzip", question)  # still serving
    assert status == 200
    assert body["choices"][0]["token_ids"][: len(references["kvzip"][question])] == references["kvzip"][question]


def test_caches_of_another_model_and_online_methods_are_refused(
    server, saved, scratch_cache, model_and_tokenizer, logbook
):
    model, tokenizer = model_and_tokenizer
    other = scratch_cache("other-model")
    text = logbook[:400]
    with torch.inference_mode():
        original = model.model.norm.weight.clone()
        model.model.norm.weight.mul_(1.5)  # another checkpoint of the same architecture
        try:
            kvfold.save_context(
                kvfold.prefill(model, tokenizer, text).compress("full", budget=1.0), other, source_text=text
            )
        finally:
            model.model.norm.weight.copy_(original)
    status, body = server.ask("other-model", "Anything?")
    assert status == 422 and "another model" in body["error"]["message"] and "weights" in body["error"]["message"]

    online = scratch_cache("online")
    small = kvfold.prefill(model, tokenizer, text).compress("streamingllm", budget=0.5)
    kvfold.save_context(small, online, source_text=text)
    status, body = server.ask("online", "Anything?")
    assert status == 422 and "online policy" in body["error"]["message"]


def test_the_server_started_with_no_memory_flag_while_memory_was_held(server):
    """The shared server was started without ``--kv-space`` while another process held 3 GiB: it sized
    its KV space from the free memory (the announcement says how) and vLLM's memory checks passed."""
    assert "--kv-space" not in server.command
    assert server.held_rss >= HELD_GIB << 30
    start = server.log.read_text().splitlines()[0]
    sized = re.search(r"KV space ([\d.]+) GiB \(at least ([\d.]+) GiB .*; ([\d.]+) GiB free", start)
    assert sized, start
    space, need, free = map(float, sized.groups())
    assert need <= space <= 2.0
    assert (
        f"Explicitly set ({space:.2f}" in server.vllm_log.read_text() or "for KV cache" in server.vllm_log.read_text()
    )


def _serve(*flags: str, timeout: float = 240) -> tuple[int, list[str], float]:
    """``kvfold serve`` over an empty folder until it exits: status, stderr's lines, seconds."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        command = [str(Path(sys.executable).with_name("kvfold")), "serve", "--caches", folder, *flags]
        start = time.monotonic()
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=_serve_env())
        return done.returncode, done.stderr.splitlines(), time.monotonic() - start


def _serve_env() -> dict[str, str]:
    import os

    from tests.integrations.vllm.conftest import SERVE_ENV

    return dict(os.environ, **SERVE_ENV)


def test_a_kv_space_beyond_the_memory_is_one_line_and_status_2():
    status, lines, seconds = _serve("--port", str(_free_port()), "--kv-space", "10000")
    assert status == 2 and len(lines) == 1 and seconds < 60, lines
    assert lines[0].startswith("kvfold serve: error: --kv-space 10000:") and "pass a smaller --kv-space" in lines[0]


def test_a_start_that_fails_in_vllm_is_one_line_naming_the_log(tmp_path):
    """The port is taken: vLLM fails while starting; kvfold serve prints the cause and the flag in one line
    after its announcement, keeps vLLM's whole log in the file it names, and exits with 2."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        log = tmp_path / "vllm.log"
        status, lines, seconds = _serve("--port", str(port), "--kv-space", "0.5", "--log", str(log))
    assert status == 2 and len(lines) == 2 and seconds < 120, lines
    assert lines[0].startswith("kvfold serve: starting vLLM") and "KV space 0.5 GiB (--kv-space)" in lines[0]
    assert (
        lines[1]
        == f"kvfold serve: error: the port is in use by another program: pass another --port N (full log: {log})"
    )
    assert "Traceback" in log.read_text() or "in use" in log.read_text()


def _craft_row_lengths_past_the_entries(source: Path, target: Path) -> str:
    """Copy cache file ``source`` to ``target`` with layer 0's row lengths 5 past its stored entries and
    the checksum recomputed (as anyone who edits a file can); the tensor changed."""
    import json
    import struct

    from safetensors.torch import load_file, save_file

    from kvfold.store.format import METADATA_KEY, checksum

    raw = source.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(json.loads(raw[8 : 8 + length])["__metadata__"][METADATA_KEY])
    tensors = {name: t.clone() for name, t in load_file(str(source)).items()}
    name = next(n for n in sorted(tensors) if n.startswith("layer.0.") and n.endswith("lengths"))
    tensors[name] = tensors[name] + 5
    header["checksum"] = {"algorithm": "sha256", "value": checksum(header, tensors.items())}
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(target), metadata={METADATA_KEY: json.dumps(header)})
    return name


def test_a_crafted_file_whose_rows_point_past_its_entries_is_refused_in_one_line(
    server, saved, scratch_cache, references
):
    crafted = scratch_cache("crafted")
    _craft_row_lengths_past_the_entries(saved["kvzip"], crafted)
    status, body = server.ask("crafted", "Anything?")
    assert status == 422, body
    message = body["error"]["message"]
    assert "\n" not in message and message.startswith("cache 'crafted' cannot be served:"), message
    question = FACTS[0][1]
    status, body = server.ask("kvzip", question)  # still serving
    assert status == 200
    assert body["choices"][0]["token_ids"][: len(references["kvzip"][question])] == references["kvzip"][question]
