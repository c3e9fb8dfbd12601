"""Memory budgets (kvfold.pipeline.memory): a fraction of the 16-bit full cache's bytes spent on
tokens × bits, within the budget, by the rule or at the precision a spec names."""

from __future__ import annotations

import pytest

import kvfold
from kvfold.methods import build_method
from kvfold.pipeline.memory import MEMORY_RULE, entry_share, plan_memory, rule_format, split_memory
from kvfold.runtime.budget import Budget
from kvfold.runtime.quantize import QuantConfig
from tests.conftest import CharTokenizer, make_tiny_model

TEXT = "The vault code is 4712. Ships sail at dawn; the harbour keeps its lights on all night. " * 5


@pytest.fixture(scope="module")
def context():
    model = kvfold.enable(make_tiny_model("llama", max_position_embeddings=1024))
    return kvfold.prefill(model, CharTokenizer(), TEXT, use_chat_template=False, methods="snapkv")


@pytest.mark.parametrize("memory", [0.25, 0.0625, 0.03125, 0.015625])
@pytest.mark.parametrize("spec", ["snapkv", "snapkv@int2", "snapkv@16", "adakv:snapkv+keepkv", "snapkv@fp8"])
def test_a_memory_budget_is_kept_and_mostly_spent(context, spec, memory):
    small = context.compress(spec, memory=memory)
    ratio = small.memory_ratio
    assert ratio <= memory * (1 + 1e-9)
    assert ratio >= 0.6 * memory  # most of it spent on tokens
    assert small.memory == memory and small.token_budget is not None
    record = small.memory_record()
    assert record["memory"] == memory and record["memory_ratio"] == pytest.approx(ratio)
    if "@" in spec:
        named = QuantConfig.parse(spec.split("@")[1])
        assert small.cache.quant == named
    else:
        assert small.cache.quant == rule_format(memory)


def test_the_rule_quantizes_more_as_the_budget_shrinks():
    assert rule_format(1.0) is None
    assert rule_format(0.6) == QuantConfig(format="int8")
    assert rule_format(0.5) == rule_format(0.0625) == rule_format(1 / 32) == QuantConfig(format="int4")
    assert rule_format(1 / 64) == rule_format(1 / 128) == QuantConfig(format="int3")
    assert [row[0] for row in MEMORY_RULE] == sorted((row[0] for row in MEMORY_RULE), reverse=True)


def test_more_bits_keep_fewer_tokens_at_equal_bytes(context):
    tokens = {}
    for fmt in ("16", "int8", "int4", "int2"):
        plan = plan_memory(0.0625, build_method(f"snapkv@{fmt}"), context.cache, context.context_tokens)
        tokens[fmt] = plan.tokens.fraction
    assert tokens["16"] < tokens["int8"] < tokens["int4"] < tokens["int2"]
    share = entry_share(QuantConfig(format="int4"), 16, 16, log_mass=False)
    assert tokens["int4"] == pytest.approx(0.0625 / share, rel=0.05)


def test_a_compression_over_its_bytes_is_redone_smaller(context, monkeypatch):
    """The plan is a closed form; the bytes held decide: a plan that overshoots is shrunk until the
    cache fits."""
    from kvfold.pipeline import context as context_module

    real = context_module.plan_memory

    def generous(memory, method, cache, tokens):
        plan = real(memory, method, cache, tokens)
        return type(plan)(plan.memory, Budget(fraction=min(1.0, plan.tokens.fraction * 1.6)), plan.quant)

    monkeypatch.setattr(context_module, "plan_memory", generous)
    small = context.compress("snapkv", memory=0.0625)
    assert small.memory_ratio <= 0.0625


def test_a_short_context_drops_whole_tokens_then_refuses_a_budget_no_cache_fits(context):
    """A budget rounds up to whole tokens: on a short context a retry must keep fewer of them, and a
    memory smaller than one entry a row is refused, never exceeded."""
    small = context.compress("snapkv@16", memory=1 / 64)  # 6.7 tokens' bytes: 7 are over, 6 fit
    assert small.memory_ratio <= 1 / 64
    with pytest.raises(ValueError, match="too small for this context"):
        context.compress("snapkv@16", memory=1 / 2048)


def test_budget_and_memory_together_are_refused(context):
    with pytest.raises(ValueError, match="not both"):
        context.compress("snapkv", 0.1, memory=0.0625)
    with pytest.raises(ValueError, match="memory budget"):
        context.compress("snapkv", memory=1.5)


def test_a_conversation_splits_its_memory_by_the_closed_form():
    fraction, quant = split_memory(0.0625, build_method("kvzip+am_fit"), 64, 64)
    assert quant == QuantConfig(format="int4")
    assert fraction == pytest.approx(0.0625 / (80 / 256))
    fraction, quant = split_memory(0.0625, build_method("kvzip@16"), 64, 64)
    assert quant is None and fraction == pytest.approx(0.0625)


def test_quantization_only_runs_keep_every_token(context):
    small = context.compress("full@int4")
    assert small.cache.quant == QuantConfig(format="int4")
    assert all(int(layer.row_lengths().min()) == context.context_tokens for _, layer in small.cache.folded_layers)
    assert 0.2 < small.memory_ratio < 0.4
