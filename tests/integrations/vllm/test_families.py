"""``kvfold serve`` on each served family besides Llama (Mistral, Mixtral, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE,
Granite, Phi-3): a tiny random model of the family, its files answered as ``kvfold ask`` answers them.

Each family gets a model directory (random weights, SmolLM2's tokenizer and chat template, so the
prompts are the shared suite's), files compressed from a short logbook, and a server of its own. Qwen3
is served by a hub id from a Hugging Face cache (offline), the others from their directory. The
weights are drawn wider than transformers' default (``initializer_range``) so that a greedy token leads
its runner-up by far more than the two attentions' float32 differences.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

import kvfold
from kvfold.evaluate.data.logbook import FACTS, build_logbook
from kvfold.pipeline.context import greedy_decode
from kvfold.runtime.prompts import build_prompt, encode
from tests.integrations.vllm.conftest import (
    LOGPROB_TOLERANCE,
    start_server,
    stock_greedy,
    worst_logprob_difference,
)

MOE = {"num_experts_per_tok": 2}
QWEN_MOE = {"num_experts": 4, "moe_intermediate_size": 64}
FAMILY_MODELS = {
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 64}),
    "mixtral": (MixtralConfig, MixtralForCausalLM, {"sliding_window": None, "num_local_experts": 4, **MOE}),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, {**MOE, **QWEN_MOE, "shared_expert_intermediate_size": 64}),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, {"head_dim": 64, **MOE, **QWEN_MOE}),
    "granite": (
        GraniteConfig,
        GraniteForCausalLM,
        {"attention_multiplier": 0.1, "embedding_multiplier": 2.0, "residual_multiplier": 0.5, "logits_scaling": 2.0},
    ),
    "phi3": (Phi3Config, Phi3ForCausalLM, {"pad_token_id": None}),
}
"""Model type → transformers' config and model classes, and what the family's config adds. Qwen3's heads
are wider than ``hidden_size / heads`` (as in Qwen3-8B's config); Qwen2 has biases on q, k and v; Granite
scales its logits by its own ``attention_multiplier``; Phi-3 projects queries, keys and values in one
``qkv_proj``; the mixture-of-experts families route 2 of 4."""
# Heads of 32 and 64 channels: vLLM's CPU attention takes neither 16 nor most other widths.
SHAPE = {  # RoPE's base as in Qwen2.5, Qwen3 and Mistral-7B-v0.3 (Llama's 10,000 is transformers' default)
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "initializer_range": 0.2,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
}
FILES = {"am_fit": {"budget": 0.25}, "mem16": {"memory": 1 / 16}, "full": {"method": "full", "budget": 1.0}}
"""File name → how it is compressed from the logbook (``kvzip+am_fit`` unless named): float rows with β,
4-bit codes, every entry."""
ANSWER = 12
LOGBOOK = 600


HUB_FAMILY = "qwen3"
"""The family served by a hub id, from a Hugging Face cache of its own (offline), as a user who
downloaded the model would serve it; the others from a model directory."""
HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_model(family: str, tokenizer, out: Path) -> Path:
    """A tiny random model of ``family`` in ``out`` (safetensors, config, SmolLM2's tokenizer)."""
    config_cls, model_cls, extra = FAMILY_MODELS[family]
    torch.manual_seed(0)
    config = config_cls(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **SHAPE,
        **extra,
    )
    model_cls(config).eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


class Family:
    """One family's model directory, files, server, and kvfold's own model to check it against."""

    def __init__(self, family: str, spec: str, directory: Path, server, paths: dict[str, Path], model, tokenizer):
        self.family, self.spec, self.directory, self.server, self.paths = family, spec, directory, server, paths
        self.model, self.tokenizer = model, tokenizer

    def ask(self, name: str | None, question: str, **extra) -> dict:
        payload = {
            "model": self.spec,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": ANSWER,
            "temperature": 0,
            "return_token_ids": True,
            "ignore_eos": True,
            **extra,
        }
        if name is not None:
            payload["kv_transfer_params"] = {"kvfold_cache": name}
        status, body = self.server.request("/v1/chat/completions", payload)
        assert status == 200, body
        return body

    def suffix(self, question: str) -> list[int]:
        return encode(self.tokenizer, build_prompt(self.tokenizer, "", question).suffix, special=False)


@pytest.fixture(scope="module", params=sorted(FAMILY_MODELS))
def family(request, model_and_tokenizer, tmp_path_factory):
    """One family served: its model, its files, its server (stopped after the module's tests)."""
    torch.set_num_threads(1)
    _, tokenizer = model_and_tokenizer
    folder = tmp_path_factory.mktemp(request.param)
    spec, env = None, {}
    if request.param == HUB_FAMILY:
        spec = f"kvfold-tests/tiny-{request.param}"
        repository = folder / "hub" / f"models--{spec.replace('/', '--')}"
        directory = write_model(request.param, tokenizer, repository / "snapshots" / HUB_COMMIT)
        (repository / "refs").mkdir()
        (repository / "refs" / "main").write_text(HUB_COMMIT)
        env = {"HF_HUB_CACHE": str(folder / "hub"), "HF_HUB_OFFLINE": "1"}
    else:
        directory = write_model(request.param, tokenizer, folder / "model")
    spec = spec or str(directory)
    model, tokenizer = kvfold.load_model(str(directory))
    assert model.config.model_type == request.param
    caches = folder / "caches"
    caches.mkdir()
    logbook = build_logbook(tokenizer, LOGBOOK)
    context = kvfold.prefill(model, tokenizer, logbook, methods=["kvzip+am_fit"])
    paths = {}
    for name, how in FILES.items():
        how = dict(how)
        paths[name] = caches / f"{name}.kvc"
        compressed = context.compress(how.pop("method", "kvzip+am_fit"), **how)
        kvfold.save_context(compressed, paths[name], source_text=logbook)
    flags = ("--model", spec, "--", "--enforce-eager", "--max-num-seqs", "4")
    server = start_server(caches, folder, *flags, env=env)
    try:
        server.wait()
        yield Family(request.param, spec, directory, server, paths, model, tokenizer)
    finally:
        server.stop()


@pytest.mark.parametrize("name", sorted(FILES))
def test_a_familys_files_answer_as_kvfold_ask(family, name):
    """Greedy tokens (EOS ignored) of vLLM's model class of the family on kvfold's backend, against
    ``kvfold ask``'s on the same file (transformers' model of the family)."""
    context = kvfold.load_context(family.paths[name], family.model, family.tokenizer)
    for _, question, _ in FACTS[:2]:
        served = family.ask(name, question)["choices"][0]["token_ids"]
        ours = greedy_decode(
            family.model,
            family.tokenizer,
            context.decode_cache(),
            family.suffix(question),
            ANSWER,
            stop_at_eos=False,
        ).token_ids
        assert served == ours, (family.family, name, question)


@pytest.mark.parametrize("name", sorted(FILES))
def test_a_familys_log_probabilities_agree_with_kvfold(family, name):
    """Every step's top-5 log-probabilities, against kvfold's teacher-forced on vLLM's tokens."""
    question = FACTS[0][1]
    body = family.ask(name, question, logprobs=True, top_logprobs=5, return_tokens_as_token_ids=True)
    steps = body["choices"][0]["logprobs"]["content"]
    served = body["choices"][0]["token_ids"]
    cache = kvfold.load_context(family.paths[name], family.model, family.tokenizer).decode_cache()
    suffix = family.suffix(question)
    ids = torch.tensor([suffix + served[:-1]])
    start = cache.get_seq_length()
    with torch.inference_mode():
        positions = torch.arange(start, start + ids.shape[1])[None]
        logits = family.model(ids, past_key_values=cache, position_ids=positions).logits
    ours = torch.log_softmax(logits[0, len(suffix) - 1 :].double(), -1)
    worst = worst_logprob_difference(steps, ours)
    assert worst < LOGPROB_TOLERANCE, (family.family, name, worst)


def test_a_plain_request_is_the_familys_stock_model(family):
    """A request that names no file: vLLM's own attention on the family, as plain transformers answers."""
    body = family.ask(None, FACTS[1][1])
    served = body["choices"][0]["token_ids"]
    stock = AutoModelForCausalLM.from_pretrained(family.directory, dtype=torch.float32).eval()
    assert served == stock_greedy(stock, torch.tensor([body["prompt_token_ids"]]), ANSWER), family.family
