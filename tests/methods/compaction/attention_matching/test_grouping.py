"""How Attention Matching's problems are grouped (kvfold.methods.compaction.attention_matching.grouping)."""

from __future__ import annotations

import torch

from kvfold.methods.compaction.attention_matching import grouping
from kvfold.methods.compaction.attention_matching.solve import FitConfig, fit_problems
from kvfold.runtime.live_bytes import LiveBytes


def test_problems_are_grouped_widest_first_within_the_width_slack_and_memory():
    """A global budget gives the heads of one layer widths from a few entries to most of them:
    a group pads to its widest problem, so groups keep widths within ``WIDTH_SLACK``."""
    counts = torch.tensor([11, 1704, 160, 1600, 1500, 150, 9])
    todo = torch.arange(7)
    groups = grouping.groups_by_width(todo, counts, lambda t: t, group_bytes=1 << 40)
    assert [(g.tolist(), widest) for g, widest in groups] == [([1, 3, 4], 1704), ([2, 5], 160), ([0, 6], 11)]
    capped = grouping.groups_by_width(todo, counts, lambda t: t, group_bytes=3100)  # one 1600, two 1500s
    assert [g.tolist() for g, _ in capped] == [[1], [3], [4], [2, 5], [0, 6]]
    assert grouping.groups_by_width(todo[:0], counts, lambda t: t, group_bytes=1) == []


def test_a_gpu_group_takes_narrower_problems_while_their_padding_costs_less_than_a_group():
    """Where a group costs its launches, narrower problems join it padded to its width while their
    padding's multiply-adds stay within the budget in all; none pads past it, memory still caps a
    group, and with no budget (the CPU) the groups are the width slack's."""
    counts = torch.tensor([11, 1704, 160, 1600, 1500, 150, 9])
    todo = torch.arange(7)

    def groups(budget, group_bytes=1 << 40):
        padding = lambda widest, t: widest - t  # noqa: E731
        found = grouping.groups_by_width(todo, counts, lambda t: t, group_bytes, padding, budget)
        return [g.tolist() for g, _ in found]

    assert groups(0) == [[1, 3, 4], [2, 5], [0, 6]]
    assert groups(1544 + 1554) == [[1, 3, 4, 2, 5], [0, 6]]  # 160 and 150 padded to 1704; 11 would pass it
    assert groups(1544 + 1553) == [[1, 3, 4, 2], [5, 0, 6]]  # 150 alone would pass it: it starts a group
    assert groups(10**9) == [[1, 3, 4, 2, 5, 0, 6]]
    assert groups(10**9, group_bytes=3 * 1704) == [[1, 3, 4], [2, 5, 0, 6]]  # three of 1,704 at most


def test_a_groups_working_memory_stays_within_its_budget_counting_the_statistics_block_once(monkeypatch):
    """A group holds one block of attention features whatever its size (a few problems at a time within
    ``statistics_bytes``), then each problem's inputs and normal equations: a budget of that block and four
    problems' bytes fits sixteen problems in four groups, and the fit's peak (outputs apart) stays within it."""
    gen = torch.Generator().manual_seed(0)
    problems, entries, queries, dim, kept = 16, 256, 512, 8, 32
    keys, values = (torch.randn(problems, entries, dim, generator=gen) for _ in range(2))
    query = torch.randn(problems, queries, dim, generator=gen)
    given = torch.stack([torch.randperm(entries, generator=gen)[:kept].sort().values for _ in range(problems)])
    statistics_bytes = 2 * 64 * entries * 4  # two problems' blocks of 64 queries
    block = grouping.statistics_block_bytes(entries, queries, 4, 64, statistics_bytes)
    assert block == statistics_bytes
    budget = block + 4 * grouping.bytes_per_problem(True, entries, queries, dim, 4, 128)(kept)
    config = FitConfig(query_block=128, statistics_rows=64, statistics_bytes=statistics_bytes, group_bytes=budget)
    formed = []
    real = grouping.groups_by_width
    monkeypatch.setattr(grouping, "groups_by_width", lambda *args: formed.extend(real(*args)) or formed)
    with torch.inference_mode(), LiveBytes() as ledger:
        out = fit_problems(
            keys, values, torch.zeros(problems, entries), query, torch.ones(problems, queries, dtype=torch.bool),
            torch.full((problems,), kept), 0.3, config, given=given,
        )  # fmt: skip
    assert [len(rows) for rows, _ in formed] == [4, 4, 4, 4]
    results = sum(t.untyped_storage().nbytes() for t in (out.index, out.log_mass, out.values, out.lengths))
    assert ledger.peak - results < budget  # measured 0.72 of it
