"""ZSMerge / ZeroMerge (papers/zsmerge.md §3, papers/zeromerge.md §3): Algorithm 1 against a
literal implementation and the paper's Figure 2 setting worked by hand, Theorem 1 as a property
test, ``residual=0`` as plain eviction, the budget during generation, every tiny family, left-padded
batches and a bf16 model."""

from __future__ import annotations

import math

import pytest
import torch

import kvfold
from kvfold.methods import CompressionContext, SpecError, build_method
from kvfold.methods.core.online import OnlineEviction
from kvfold.methods.core.selection import topk_keep
from kvfold.methods.merging.zsmerge.merge import (
    COUNT,
    POSITION,
    SCORE,
    BudgetSplit,
    decayed_scores,
    prefill_scores,
    residual_stream,
    split_budget,
)
from kvfold.methods.merging.zsmerge.method import ZeroMerge, ZSMerge
from kvfold.methods.merging.zsmerge.online import ZSMergeOnline
from kvfold.runtime.cache import FoldedCache
from tests.conftest import make_tiny_model
from tests.runtime.test_attention import _CharTokenizer

F64 = torch.float64
CONTEXT = "the quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing. " * 2


# ---------------------------------------------------------------------------- a literal Algorithm 1


class Algorithm1:
    """Algorithm 1 of the paper for one KV head, written with Python lists, one token at a time."""

    def __init__(self, b_p: int, b_c: int, b_r: int, decay: float = 0.98, metric: str = "dot") -> None:
        self.b_p, self.b_c, self.b_r, self.decay, self.metric = b_p, b_c, b_r, decay, metric
        self.proximity: list[int] = []
        self.context: list[int] = []
        self.residual: list[list] = []  # [k, v, w, members]
        self.s: dict[int, float] = {}
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def step(self, token: int, k: torch.Tensor, v: torch.Tensor, attention: dict[int, float] | None) -> None:
        """One decoding step; ``attention`` None keeps the scores fixed (preset in ``self.s``)."""
        self.kv[token] = (k, v)
        if attention is not None:  # lines 4–5, eq. 5
            for t in self.proximity + self.context:
                self.s[t] = self.decay * self.s[t] + attention.get(t, 0.0)
            self.s[token] = attention.get(token, 0.0)
        self.proximity.append(token)  # line 6
        if len(self.proximity) > self.b_p:  # lines 7–9
            self.context.append(self.proximity.pop(0))
            if len(self.context) > self.b_c:  # lines 10–11 (ties: the newest goes)
                victim = min(self.context, key=lambda t: (self.s[t], -t))
                self.context.remove(victim)
                k_c, v_c = self.kv[victim]
                if len(self.residual) + 1 <= self.b_r:  # lines 12–13
                    self.residual.append([k_c.clone(), v_c.clone(), 1, [victim]])
                elif self.b_r > 0:  # line 15: eq. 6 then eq. 7
                    if self.metric == "dot":  # eq. 6
                        near = [float(slot[0] @ k_c) for slot in self.residual]
                    else:  # the nearest slot key
                        near = [-float((slot[0] - k_c).square().sum()) for slot in self.residual]
                    slot = self.residual[near.index(max(near))]
                    w = slot[2]
                    slot[0] = (w * slot[0] + k_c) / (w + 1)
                    slot[1] = (w * slot[1] + v_c) / (w + 1)
                    slot[2] = w + 1
                    slot[3].append(victim)


def _prompt(seed: int, rows: int, n: int, dim: int = 6):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(rows, n, dim, generator=g, dtype=F64)
    values = torch.randn(rows, n, dim, generator=g, dtype=F64)
    scores = torch.rand(rows, n, generator=g, dtype=F64)
    pad = torch.randint(0, n // 3, (rows,), generator=g)
    valid = torch.arange(n)[None, :] >= pad[:, None]  # left padding
    return keys, values, scores, valid


# ---------------------------------------------------------------------------- budget split, scores


def test_split_follows_the_papers_recommendation():
    """App. C.2: B_p/B = 0.5, B_r/(B − B_p) = 0.02; §4.4.1's B_r = 2 falls out at 10% of 2K."""
    split = split_budget(torch.tensor([400, 200, 100, 9, 1]), 0.5, 0.02)
    assert split.proximity.tolist() == [200, 100, 50, 5, 1]
    assert split.residual.tolist() == [4, 2, 1, 1, 0]
    assert split.total.tolist() == [400, 200, 100, 9, 1]
    counts = split_budget(torch.tensor([9, 4]), 3, 2)  # counts (≥ 1) instead of fractions
    assert (counts.proximity.tolist(), counts.context.tolist(), counts.residual.tolist()) == ([3, 3], [4, 0], [2, 1])
    assert split_budget(torch.tensor([200]), 0.5, 0).residual.tolist() == [0]


def test_prefill_scores_are_eq5_over_the_window():
    """s_t = Σ_w λ^{W−1−w} a_t^{(w)} over the last W queries, mean over each KV head's query heads."""
    g = torch.Generator().manual_seed(3)
    queries = torch.randn(2, 4, 5, 8, generator=g, dtype=F64)  # H_q = 4, H_kv = 2
    keys = torch.randn(2, 2, 12, 8, generator=g, dtype=F64)
    got = prefill_scores(queries, keys, 0.3, decay=0.9, kernel=1)
    want = torch.zeros(2, 2, 12, dtype=F64)
    for w in range(5):
        pos = 12 - 5 + w
        logits = torch.einsum("bgd,bgnd->bgn", queries[:, :, w], keys.repeat_interleave(2, dim=1)) * 0.3
        logits[..., pos + 1 :] = float("-inf")
        a = torch.softmax(logits, -1).view(2, 2, 2, 12).mean(2)
        want = 0.9 * want + a  # eq. 5, one prompt step at a time
    torch.testing.assert_close(got, want)
    online = decayed_scores(torch.zeros(2, 2, 0, dtype=F64), torch.rand(2, 4, 3, 7, dtype=F64), 0.5)
    assert online.shape == (2, 2, 7)


# ---------------------------------------------------------------------------- Algorithm 1 on a prompt


@pytest.mark.parametrize(
    "split",
    [(5, 7, 3), (0, 6, 2), (4, 0, 2), (3, 9, 0), (2, 3, 40), (30, 30, 30)],
    ids=["typical", "no-proximity", "no-context", "eviction", "slots-unfilled", "nothing-evicted"],
)
@pytest.mark.parametrize("metric", ["dot", "l2"])
def test_prefill_stream_equals_sequential_algorithm1(split, metric):
    """The vectorized stream == Algorithm 1 run token by token with the end-of-prefill scores."""
    b_p, b_c, b_r = split
    keys, values, scores, valid = _prompt(sum(split), rows=5, n=40)
    splits = BudgetSplit(*(torch.full((5,), x) for x in split))
    got = residual_stream(keys, values, scores, valid, splits, "merge", metric)
    for r in range(5):
        ref = Algorithm1(b_p, b_c, b_r, metric=metric)
        ref.s = {t: float(scores[r, t]) for t in range(40)}
        for t in torch.nonzero(valid[r]).flatten().tolist():
            ref.step(t, keys[r, t], values[r, t], None)
        assert torch.nonzero(got.kept[r]).flatten().tolist() == sorted(ref.proximity + ref.context)
        opened = int((got.counts[r] > 0).sum())
        assert opened == len(ref.residual)
        for j, (k, v, w, _) in enumerate(ref.residual):
            torch.testing.assert_close(got.keys[r, j], k, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(got.values[r, j], v, rtol=1e-12, atol=1e-12)
            assert got.counts[r, j] == w
        merged = sum(w for _, _, w, _ in ref.residual)
        if b_r:  # every token is kept or merged
            assert int(got.kept[r].sum()) + merged == int(valid[r].sum())
        else:  # pure eviction
            assert int(got.kept[r].sum()) == min(int(valid[r].sum()), b_p + b_c)


def test_pool_mode_keeps_the_same_tokens_and_pools_contiguous_groups():
    """The authors' code: same kept set, evicted tokens mean-pooled in position order, w = group size."""
    keys, values, scores, valid = _prompt(7, rows=3, n=40)
    splits = BudgetSplit(torch.full((3,), 6), torch.full((3,), 8), torch.tensor([3, 3, 0]))  # row 2: eviction
    merged = residual_stream(keys, values, scores, valid, splits, "merge")
    pooled = residual_stream(keys, values, scores, valid, splits, "pool")
    assert torch.equal(merged.kept, pooled.kept)
    assert pooled.counts[2].tolist() == [0, 0, 0]
    for r in range(2):
        evicted = torch.nonzero(valid[r] & ~pooled.kept[r]).flatten()
        groups = torch.tensor_split(evicted, 3)
        assert pooled.counts[r].tolist() == [len(gr) for gr in groups]
        for j, gr in enumerate(groups):
            torch.testing.assert_close(pooled.keys[r, j], keys[r, gr].mean(0))
            torch.testing.assert_close(pooled.values[r, j], values[r, gr].mean(0))


# ---------------------------------------------------------------------------- Figure 2, by hand


IMPORTANCE = {1: 9, 2: 1, 3: 5, 4: 2, 5: 7, 6: 3, 7: 8, 8: 4, 9: 5.2, 10: 0.5, 11: 10, 12: 1.5, 13: 2.5, 14: 11}
KEYS = {2: (1, 0), 4: (0, 1), 6: (2, 1), 8: (0, 2), 9: (1, 1), 10: (-1, 1), 3: (1, -1), 12: (0, -1), 13: (-2, 0),
        5: (1, 2)}  # fmt: skip
# Worked by hand with λ = 0.5 and a_t = IMPORTANCE[t] at every step, so s_t^{(T)} = imp_t·(2 − 0.5^{T−t}).
# Evictions (lowest s in the context set): T=8: 2, 9: 4 (both open residual slots r0, r1), then merges by
# max k_r·k_t: T=10: 6 → r0 (2 > 1); 11: 8 → r1 (2 > 1); 12: 9 → r0 (2 > 1.5; 9 goes before 3 although
# imp 5.2 > 5: 3 has accumulated longer, 9.99 > 9.75); 13: 10 → r1 (1.5 > −2/3); 14: 3 → r0 (2/3 > −5/3);
# 15: 12 → r0 (−1/4 > −4/3: dot products, not cosines, and negative); 16: 13 → r1 (2/3 > −2); 17: 5 → r1.
FIGURE2 = {
    12: ({10, 11, 12}, {1, 3, 5, 7}, [({2, 6, 9}, (4 / 3, 2 / 3)), ({4, 8}, (0, 1.5))]),
    13: ({11, 12, 13}, {1, 3, 5, 7}, [({2, 6, 9}, (4 / 3, 2 / 3)), ({4, 8, 10}, (-1 / 3, 4 / 3))]),
    14: ({12, 13, 14}, {1, 5, 7, 11}, [({2, 6, 9, 3}, (5 / 4, 1 / 4)), ({4, 8, 10}, (-1 / 3, 4 / 3))]),
    15: ({13, 14, 15}, {1, 5, 7, 11}, [({2, 6, 9, 3, 12}, (1, 0)), ({4, 8, 10}, (-1 / 3, 4 / 3))]),
    16: ({14, 15, 16}, {1, 5, 7, 11}, [({2, 6, 9, 3, 12}, (1, 0)), ({4, 8, 10, 13}, (-3 / 4, 1))]),
    17: ({15, 16, 17}, {1, 7, 11, 14}, [({2, 6, 9, 3, 12}, (1, 0)), ({4, 8, 10, 13, 5}, (-2 / 5, 6 / 5))]),
}


def _one_layer() -> tuple[FoldedCache, object]:
    cache = FoldedCache(num_layers=1)
    return cache, cache.layers[0]


def test_figure2_setting_step_by_step():
    """B_r = 2, B_c = 4, B_p = 3 (B = 9), T = 12 → 17: slot contents, counts, means and β by hand.

    Values are one-hot (v_t = e_t), so a residual slot's value is the mean of its members' one-hots
    and names them; keys are 2-D (zero-padded) so the dot products above can be checked by hand.
    """
    dim = 18
    policy = ZSMergeOnline(torch.tensor([9]), split_budget(torch.tensor([9]), 3, 2), {0: None}, alpha=1.0, decay=0.5)
    _, layer = _one_layer()
    for t in range(1, 18):
        k = torch.zeros(1, 1, 1, dim, dtype=F64)
        k[..., :2] = torch.tensor(KEYS.get(t, (0.5, 0.5)), dtype=F64)
        v = torch.zeros(1, 1, 1, dim, dtype=F64)
        v[..., t] = 1.0
        old = policy.slots(0, layer)["position"][0, 0].tolist() if t > 1 else []
        positions = [*old, t - 1]
        probs = torch.tensor([IMPORTANCE.get(p + 1, 1.0) if p >= 0 else 0.0 for p in positions], dtype=F64)
        layer.update(k, v)
        policy.after_forward(0, layer, torch.zeros(1, 1, 1, dim, dtype=F64), probs.view(1, 1, 1, -1))
        assert layer.physical_length <= 9
        if t not in FIGURE2:
            continue
        proximity, context, residual = FIGURE2[t]
        view = policy.slots(0, layer)
        keys, values, log_mass = layer.dense_buffers()
        plain = {p + 1 for p in view["position"][0, 0].tolist() if p >= 0}
        assert {p for p in plain if p > t - 3} == proximity, t
        assert plain - proximity == context, t
        got = []
        for j in torch.nonzero(view["slot_id"][0, 0] >= 0).flatten().tolist():
            members = set(torch.nonzero(values[0, 0, j]).flatten().tolist())
            w = len(members)
            assert torch.allclose(values[0, 0, j][list(members)], torch.full((w,), 1 / w, dtype=F64)), t
            assert math.isclose(float(log_mass[0, 0, j]), math.log(w), abs_tol=1e-6)  # β = α·log w, α = 1 (β: fp32)
            got.append((members, tuple(round(x, 9) for x in keys[0, 0, j, :2].tolist())))
        want = [(m, tuple(round(float(x), 9) for x in k)) for m, k in residual]
        assert sorted(got, key=lambda x: min(x[0])) == sorted(want, key=lambda x: min(x[0])), t
        assert int(torch.isfinite(log_mass).sum()) == 9


# ---------------------------------------------------------------------------- online == Algorithm 1


def _drive(
    policy: ZSMergeOnline,
    steps: list[int],
    batch: int,
    heads_q: int,
    heads: int,
    dim: int,
    seed: int,
    levels: int | None = None,
):
    """Feed tokens (``steps`` = tokens per forward) with random attention to a one-layer cache.

    ``levels``: attention values on a grid of that many quarter steps (exact in float64, so
    scores tie and the tie rule of Algorithm 1 matters).

    Returns the layer, the attention table ``a[token_step][b, hq, token]`` and every key and value.
    """
    g = torch.Generator().manual_seed(seed)
    total = sum(steps)
    keys = torch.randn(batch, heads, total, dim, generator=g, dtype=F64)
    values = torch.randn(batch, heads, total, dim, generator=g, dtype=F64)
    table = torch.rand(total, batch, heads_q, total, generator=g, dtype=F64)
    if levels is not None:
        table = torch.randint(0, levels, table.shape, generator=g).to(F64) / 4
    _, layer = _one_layer()
    seen = 0

    def run(callback=None):
        nonlocal seen
        for q in steps:
            # positions of the slots before the forward (B, H, n_old)
            old = policy.slots(0, layer)["position"] if seen else torch.zeros(batch, heads, 0, dtype=torch.long)
            new = torch.arange(seen, seen + q).expand(batch, heads, q)
            pos = torch.cat([old, new], dim=-1).repeat_interleave(heads_q // heads, dim=1)  # (B, H_q, n)
            probs = torch.zeros(batch, heads_q, q, pos.shape[-1], dtype=F64)
            for i in range(q):
                step = seen + i
                arrived = (pos >= 0) & (pos <= step)
                a = table[step].gather(-1, pos.clamp_min(0))
                probs[:, :, i] = torch.where(arrived, a, 0.0)
            layer.update(keys[:, :, seen : seen + q], values[:, :, seen : seen + q])
            policy.after_forward(0, layer, torch.zeros(batch, heads_q, q, dim, dtype=F64), probs)
            seen += q
            if callback is not None:
                callback(seen)

    return layer, table, keys, values, run


@pytest.mark.parametrize(
    "steps,decay,levels",
    [
        ([1] * 20 + [4] + [1] * 12, 0.9, None),
        # chunks: the vectorized path, over several score blocks (STEP_BLOCK = 64), then decode steps
        ([1] * 6 + [70] + [3] + [1] * 4 + [9] + [1] * 3, 0.9, None),
        ([1, 30] + [1] * 3 + [70] + [5] + [1] * 2, 0.0, 2),  # s = a ∈ {0, 1/8, 1/4}: ties, the newest goes
    ],
)
@pytest.mark.parametrize("metric", ["dot", "l2"])
def test_online_equals_sequential_algorithm1(steps, decay, levels, metric):
    """Decode steps and chunks, GQA (2 query heads per KV head), two batch rows with different
    budgets: the policy's slots == Algorithm 1 run token by token with the same attention."""
    budgets = torch.tensor([12, 9])
    split = split_budget(budgets, 0.4, 3)
    policy = ZSMergeOnline(budgets, split, {0: None}, alpha=0.6, decay=decay, slot_metric=metric)
    layer, table, keys, values, run = _drive(policy, steps, batch=2, heads_q=4, heads=2, dim=5, seed=11, levels=levels)
    refs = {
        (b, h): Algorithm1(
            int(split.proximity[b]), int(split.context[b]), int(split.residual[b]), decay=decay, metric=metric
        )
        for b in range(2)
        for h in range(2)
    }

    def check(seen: int) -> None:
        view = policy.slots(0, layer)
        k_cache, _, log_mass = layer.dense_buffers()
        assert layer.physical_length <= 12
        for (b, h), ref in refs.items():
            while len(ref.kv) < seen:
                t = len(ref.kv)
                a = {s: float(table[t, b, 2 * h : 2 * h + 2, s].mean()) for s in range(t + 1)}
                ref.step(t, keys[b, h, t], values[b, h, t], a)
            valid = view["valid"][b, h]
            plain = sorted(
                p for p, ok in zip(view["position"][b, h].tolist(), valid.tolist(), strict=True) if ok and p >= 0
            )
            assert plain == sorted(ref.proximity + ref.context), (seen, b, h)
            for t in ref.proximity + ref.context:
                slot = int(torch.nonzero(view["position"][b, h] == t).flatten()[0])
                assert math.isclose(float(view["score"][b, h, slot]), ref.s[t], rel_tol=1e-12, abs_tol=1e-12)
            assert int(((view["slot_id"][b, h] >= 0) & valid).sum()) == len(ref.residual)
            for j, (k, v, w, _) in enumerate(ref.residual):
                torch.testing.assert_close(view["residual_keys"][b, h, j], k, rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(view["residual_values"][b, h, j], v, rtol=1e-12, atol=1e-12)
                assert view["residual_counts"][b, h, j] == w
                slot = int(torch.nonzero(view["slot_id"][b, h] == j).flatten()[0])
                torch.testing.assert_close(k_cache[b, h, slot], k, rtol=1e-12, atol=1e-12)
                assert math.isclose(float(log_mass[b, h, slot]), 0.6 * math.log(w), abs_tol=1e-6)

    run(check)


# ---------------------------------------------------------------------------- Theorem 1


def _attention(q: torch.Tensor, keys: torch.Tensor, beta: torch.Tensor | None = None) -> torch.Tensor:
    logits = keys @ q / math.sqrt(keys.shape[-1])
    return torch.softmax(logits if beta is None else logits + beta, dim=-1)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.6, 1.0])
def test_theorem1_prefill_uncompressed_tokens_never_lose_attention(alpha):
    """Theorem 1 (App. A): for α ≤ 1, â_i ≥ a_i for every kept token, any query."""
    keys, values, scores, valid = _prompt(5, rows=4, n=60, dim=8)
    valid[:] = True
    splits = BudgetSplit(*(torch.full((4,), x) for x in (6, 8, 3)))
    res = residual_stream(keys * 2.0, values, scores, valid, splits, "merge")
    # the theorem is about merged entries: every token left out sits in a residual slot
    assert res.counts.sum(-1).tolist() == (60 - res.kept.sum(-1)).double().tolist() == [46.0] * 4
    g = torch.Generator().manual_seed(0)
    for r in range(4):
        kept = torch.nonzero(res.kept[r]).flatten()
        compressed = torch.cat([keys[r, kept] * 2.0, res.keys[r]])
        beta = torch.cat([torch.zeros(len(kept), dtype=F64), alpha * torch.log(res.counts[r])])
        for _ in range(50):
            q = torch.randn(8, generator=g, dtype=F64) * 3
            full = _attention(q, keys[r] * 2.0)[kept]
            ours = _attention(q, compressed, beta)[: len(kept)]
            assert bool((ours >= full * (1 - 1e-12)).all())


def test_l2_joins_the_nearest_slot_where_the_dot_product_joins_the_longest_key():
    """Two open slots, keys (10, 0) and (1, 0.1); a victim (1, 0) has the larger dot product with
    the first (eq. 6) and is nearer the second (``l2``)."""
    keys = torch.tensor([[[0.0, 0.0, 1.0], [10.0, 0.0, 0.0], [1.0, 0.1, 0.0], [1.0, 0.0, 0.0]]], dtype=F64)
    scores = torch.tensor([[100.0, 0.3, 0.2, 0.1]], dtype=F64)
    split = BudgetSplit(torch.tensor([0]), torch.tensor([1]), torch.tensor([2]))
    valid = torch.ones(1, 4, dtype=torch.bool)
    dot = residual_stream(keys, keys, scores, valid, split, "merge", "dot")
    l2 = residual_stream(keys, keys, scores, valid, split, "merge", "l2")
    assert dot.counts[0].tolist() == [2.0, 1.0] and l2.counts[0].tolist() == [1.0, 2.0]
    torch.testing.assert_close(l2.keys[0, 1], torch.tensor([1.0, 0.05, 0.0], dtype=F64))
    assert build_method("zsmerge[slot_metric=l2]").selector.slot_metric == "l2"
    with pytest.raises(SpecError, match="slot_metric"):
        build_method("zsmerge[slot_metric=cos]")


def test_theorem1_needs_alpha_at_most_one():
    """The bound is tight in α: with identical merged keys (Jensen exact) any α > 1 breaks it."""
    keys = torch.zeros(20, 4, dtype=F64)
    keys[:, 0] = 1.0
    keys[0] = torch.tensor([0.0, 2.0, 0.0, 0.0], dtype=F64)  # the one token kept
    scores = torch.zeros(1, 20, dtype=F64)
    scores[0, 0] = 1.0
    res = residual_stream(
        keys[None],
        keys[None],
        scores,
        torch.ones(1, 20, dtype=torch.bool),
        BudgetSplit(torch.tensor([0]), torch.tensor([1]), torch.tensor([1])),
        "merge",
    )
    assert res.counts[0].tolist() == [19.0]
    q = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=F64)
    compressed = torch.cat([keys[:1], res.keys[0]])
    full = _attention(q, keys)[0]
    assert _attention(q, compressed, torch.tensor([0.0, math.log(19)], dtype=F64))[0] >= full * (1 - 1e-12)
    assert _attention(q, compressed, torch.tensor([0.0, 1.2 * math.log(19)], dtype=F64))[0] < full


def test_theorem1_online_at_every_step():
    """During decoding too: after each step, kept tokens get ≥ their full-cache attention."""
    budgets = torch.tensor([10])
    policy = ZSMergeOnline(budgets, split_budget(budgets, 0.3, 3), {0: None}, alpha=1.0, decay=0.98)
    g = torch.Generator().manual_seed(1)
    queries = torch.randn(30, 6, dtype=F64) * 2
    layer, _, keys, _, run = _drive(policy, [1] * 30, batch=1, heads_q=2, heads=2, dim=6, seed=2)

    def check(seen: int) -> None:
        view = policy.slots(0, layer)
        k_cache, _, log_mass = layer.dense_buffers()
        # α = 1: Σ w = exp β over the cache is every token seen (the evicted ones are merged, not dropped)
        total = torch.where(view["valid"], log_mass.double().exp(), 0.0).sum(-1)
        torch.testing.assert_close(total, torch.full_like(total, float(seen)))
        for h in range(2):
            valid = view["valid"][0, h]
            plain = valid & (view["position"][0, h] >= 0)
            tokens = view["position"][0, h][plain]
            for q in queries[torch.randint(0, 30, (5,), generator=g)]:
                full = _attention(q, keys[0, h, :seen])[tokens]
                ours = _attention(q, k_cache[0, h][valid], log_mass[0, h][valid])
                ours = ours[plain[valid]]
                assert bool((ours >= full * (1 - 1e-12)).all()), seen

    run(check)


# ---------------------------------------------------------------------------- B_r = 0 is plain eviction


def _prefill(family: str, contexts, dtype=torch.float32):
    model = kvfold.enable(make_tiny_model(family).to(dtype))
    tok = _CharTokenizer()
    return kvfold.prefill(model, tok, contexts, use_chat_template=False), model


def test_residual_zero_is_plain_eviction_after_prefill():
    """zsmerge[residual=0] == top-k of the same scores with the B_p newest protected (§3.2)."""
    prefilled, model = _prefill("qwen2", [CONTEXT, "shorter, left padded"])
    method = build_method("zsmerge[residual=0]")
    compressed = prefilled.compress(method, 0.3)
    budgets = kvfold.Budget.parse(0.3).counts(prefilled.attention_mask.sum(-1))
    for layer_idx, layer in prefilled.cache.folded_layers:
        keys, values, log_mass, _ = layer.padded()
        valid = torch.isfinite(log_mass)
        scaling = model.model.layers[layer_idx].self_attn.scaling
        scores = prefill_scores(layer.captured_queries[:, :, -8:], keys, scaling, 0.98, 5, valid=valid)
        from_end = valid.long().flip(-1).cumsum(-1).flip(-1)
        recent = valid & (from_end <= ((budgets + 1) // 2)[:, None, None])  # B_p = round(0.5·B) newest
        keep, lengths = topk_keep(scores, budgets, protected=recent, valid=valid)
        k, v, beta, got_lengths = compressed.cache.layers[layer_idx].padded()
        assert torch.equal(got_lengths, lengths)
        slot = torch.arange(keep.shape[-1])[None, None] < lengths[..., None]
        want_k = keys.gather(2, keep[..., None].expand(-1, -1, -1, keys.shape[-1]))
        assert torch.equal(k[slot], want_k[slot])
        assert bool((beta[slot] == 0).all())


class _DecayedEviction(OnlineEviction):
    """Plain online eviction with ZSMerge's eq.-5 scores, built on the shared OnlineEviction."""

    def __init__(self, limits, recent, decay):
        super().__init__(limits, needs_attention=True, recent=recent)
        self.decay = decay

    def initial_scores(self, layer_idx, layer, count):
        return layer.entry_stats[SCORE][..., :count].float()

    def new_scores(self, layer_idx, layer, state, q_len, probs):
        s = decayed_scores(state, probs, self.decay)
        state.copy_(s[..., : state.shape[-1]])
        return s[..., state.shape[-1] :]


def test_residual_zero_is_plain_eviction_online():
    """Decode steps under zsmerge[residual=0] == the shared OnlineEviction with the same scores."""
    prefilled, model = _prefill("llama", CONTEXT)
    compressed = prefilled.compress("zsmerge[residual=0]", 0.25)
    budget = int(compressed.cache.layers[0].physical_length)
    ours, theirs = compressed.cache.copy(), compressed.cache.copy()
    ours.policy = compressed.policy
    theirs.policy = _DecayedEviction({i: budget for i, _ in theirs.folded_layers}, (budget + 1) // 2, 0.98)
    start = prefilled.input_ids.shape[1]
    for step in range(25):
        ids = torch.tensor([[(step * 7) % 90 + 2]])
        pos = torch.tensor([[start + step]])
        a = model(input_ids=ids, past_key_values=ours, position_ids=pos).logits
        b = model(input_ids=ids, past_key_values=theirs, position_ids=pos).logits
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        assert all(layer.physical_length == budget for _, layer in ours.folded_layers)


# ---------------------------------------------------------------------------- generation, families, batches


def test_budget_holds_at_every_step_and_mass_is_conserved():
    """The cache never exceeds its budget; Σ w over the entries = tokens seen; β = α·log w."""
    prefilled, model = _prefill("mistral", "xyz" * 40)
    compressed = prefilled.compress("zeromerge", 0.2)
    budget = compressed.budget.count(prefilled.context_tokens)
    cache = compressed.cache.copy()
    cache.policy = compressed.policy
    start = prefilled.input_ids.shape[1]
    for step in range(40):
        # step 20: a chunk of several tokens (like the question after compression)
        ids = torch.tensor([[5, 6, 7, 8, 9]]) if step == 20 else torch.tensor([[step % 90 + 2]])
        pos = torch.arange(cache.get_seq_length(), cache.get_seq_length() + ids.shape[1])[None]
        model(input_ids=ids, past_key_values=cache, position_ids=pos)
        for layer_idx, layer in cache.folded_layers:
            assert layer.physical_length <= budget
            view = cache.policy.slots(layer_idx, layer)
            assert bool((view["valid"].sum(-1) <= budget).all())
            assert bool((view["count"].sum(-1) == layer.logical_length).all())
            _, _, log_mass = layer.dense_buffers()
            valid = view["valid"]
            torch.testing.assert_close(log_mass[valid], 0.6 * torch.log(view["count"][valid]))
    assert cache.get_seq_length() == start + 44


def test_prefill_under_the_policy_equals_compress_then_decode():
    """A policy attached before the prefill brings each layer to budget itself, as compress does."""
    prefilled, model = _prefill("llama", CONTEXT)
    compressed = prefilled.compress("zsmerge", 0.3)
    cache = FoldedCache(model.config)
    ctx = CompressionContext(model, cache, prefilled.input_ids, prefilled.attention_mask, compressed.budget)
    cache.policy = compressed.method.online_policy(ctx)
    with torch.inference_mode():
        model(input_ids=prefilled.input_ids, past_key_values=cache)
    for layer_idx, layer in compressed.cache.folded_layers:
        want = layer.padded()
        got = cache.layers[layer_idx].padded()
        for x, y in zip(got, want, strict=True):
            torch.testing.assert_close(x, y)


def test_runs_on_every_family_with_a_left_padded_batch(tiny_family):
    contexts = [CONTEXT, "a much shorter context, which the batch pads on the left side"]
    prefilled, _ = _prefill(tiny_family, contexts)
    compressed = prefilled.compress("zsmerge", 0.4)
    budgets = compressed.budget.counts(prefilled.attention_mask.sum(-1))
    for _, layer in compressed.cache.folded_layers:
        _, _, beta, lengths = layer.padded()
        assert torch.equal(lengths, budgets[:, None].expand_as(lengths))
        assert bool((beta[torch.isfinite(beta)] >= 0).all())
        w = layer.entry_stats[COUNT]
        assert torch.equal(w.sum(-1), prefilled.attention_mask.sum(-1)[:, None].expand_as(lengths).float())
    assert compressed.kv_bytes < compressed.kv_bytes_full
    together = compressed.generate("why?", max_new_tokens=4, use_chat_template=False)
    for row, text in enumerate(contexts):
        alone, _ = _prefill(tiny_family, text)
        single = alone.compress("zsmerge", 0.4).generate("why?", max_new_tokens=4, use_chat_template=False)[0]
        assert together[row].token_ids == single.token_ids, (tiny_family, row)


def test_bf16_model_keeps_float32_scores_and_slots():
    prefilled, _ = _prefill("llama", CONTEXT, dtype=torch.bfloat16)
    compressed = prefilled.compress("zsmerge[prefill=pool]", 0.3)
    layer = compressed.cache.layers[0]
    assert layer.dtype == torch.bfloat16 and layer.entry_stats[SCORE].dtype == torch.float32
    assert layer.entry_stats[POSITION].dtype == torch.long
    answer = compressed.generate("ok?", max_new_tokens=3, use_chat_template=False)[0]
    assert answer.new_tokens >= 1


def test_presets_options_and_errors():
    assert isinstance(build_method("zeromerge").selector, ZeroMerge)
    assert build_method("zeromerge").selector.alpha == 0.6
    zs = build_method("zsmerge[alpha=0.3,residual=4,proximity=0.25,decay=0.9,window=16,kernel=1,prefill=pool]")
    assert isinstance(zs.selector, ZSMerge) and zs.query_window == 16
    assert build_method("zsmerge[online=false]").selector.online is False
    for bad in ("alpha=1.5", "residual=2.5", "proximity=-1", "kernel=4", "prefill=mean", "decay=2", "window=0"):
        with pytest.raises(SpecError):
            build_method(f"zsmerge[{bad}]")
