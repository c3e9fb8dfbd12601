"""How Attention Matching's problems are grouped (kvfold.methods.compaction.attention_matching.grouping)."""

from __future__ import annotations

import torch

from kvfold.methods.compaction.attention_matching import grouping


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
