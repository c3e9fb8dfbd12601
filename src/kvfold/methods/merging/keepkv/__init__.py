"""KeepKV: electoral votes and zero inference-perturbation merging (Tian et al. 2025, "KeepKV:
Achieving Periodic Lossless KV Cache Compression for Efficient LLM Inference", §3, Algorithm 1,
Appendices A–B).

Instead of dropping an evicted entry ``(k_e, v_e)``, KeepKV merges it into its most
cosine-similar retained entry ``(k_c, v_c)`` (threshold ``T``; below it the entry is evicted)
so that the attention output of the step whose scores were used is exactly unchanged
(Theorem 3). Each entry carries **electoral votes** ``p`` (tokens it stands for, 1 at first),
which enter attention as ``β = log p`` (eq. 6). With ``s_i = exp(q·k_i·scaling)`` and
``w_i = p_i ŝ_i``, the ZIP-merge of eq. 7 / Algorithm 1 lines 8–10 is::

    k_r = (w_e k_e + w_c k_c) · ln((w_e + w_c)/(p_e + p_c)) / (w_e ln ŝ_e + w_c ln ŝ_c)
    v_r = (w_e v_e + w_c v_c) / (w_e + w_c)
    p_r = p_e + p_c

so that ``p_r s_r = Σ p_i s_i`` and ``p_r s_r v_r = Σ p_i s_i v_i`` for the scoring query.

**Several entries into one carrier.** All entries a carrier absorbs in one compression are
merged at once with the closed form of Appendix A.3 (eq. 25), the same three lines with sums
over ``K'_e = {absorbed} ∪ {c}``. It is exact for the scoring query whatever the number of
absorbed entries, and independent of their order (sequential pairwise merges are exact too,
but give an order-dependent key).

**Scores** ``ŝ`` (eq. 8): a bias-corrected exponential moving average of ``s`` over queries. After
the prefill it runs over the last ``window`` context queries (the last one weighs most); during
decoding each new query updates it, ``S ← α S + (1 − α) s``. The bias correction divides by the
weight of the queries that actually saw the entry (``1 − α^t`` for an entry seen by ``t``
queries), so entries inside the window are not under-scored. GQA: ``ŝ`` of a KV head is the
mean of ``s`` over its query heads (so with one query head and one query ``ŝ = s`` and Theorem 3
holds exactly). Scores are float32 (float64 for float64 models).

**Numerical safety.** Eq. 7 scales the convex key ``k̄ = Σ w_i k_i / Σ w_i`` by
``γ = ln(Σ w_i / Σ p_i) / (Σ w_i ln ŝ_i / Σ w_i)``, whose denominator vanishes when the logits
straddle 0: near that pole ``γ`` is huge or negative (a reflected key), exact for the scoring
query but wrong for every other one. The key falls back to the convex merge ``k̄`` (values and
votes as above) when ``|Σ w_i ln ŝ_i| ≤ eps · Σ w_i |ln ŝ_i|``, when ``γ`` is not finite, or when
``γ ∉ [1/max_scale, max_scale]`` (default 2; ``max_scale=inf`` keeps only the first two, the
literal formula). On SmolLM2 (2K-token RULER contexts, budget 0.2) the pole itself is hit by
about 1 carrier in 20 000, but 2% of the carriers get a reflected key and the literal formula
raises the relative attention-output error of ``h2o+keepkv`` to 2.1 (``h2o``: 0.27); with the
scale guard 6–13% of the carriers fall back and ``h2o+keepkv`` beats ``h2o``. Fallbacks are
counted (``ctx.report["keepkv_fallbacks"]``, ``KeepKVOnline.fallbacks``).

**Prefill order** (Appendix B, Table 3). ``merge-first`` (default): before the budget is
filled, an unprotected entry whose key has cosine ``> T`` with a higher-priority entry (kept
before it by the selector's order) is moved behind every entry that has none (Fast-NMS style),
so similar entries are merged rather than taking a slot, and the freed slots go to the next
dissimilar entries. ``evict_first``: the selector's choice is kept as is. Either way every entry
left out is merged into its most similar carrier if the cosine is ``> T``, else evicted.

**Online** (decoding): on top of the selector's online policy (``h2o``, ``h2o_cosine``,
``streamingllm``, ``tova``, ``knorm``): each step updates ``ŝ`` with the step's attention and,
before the policy removes its victim, ZIP-merges it into its most similar remaining entry, in
place in the dense buffers (work ∝ budget). **Chunked prefill** (:mod:`kvfold.pipeline.chunked`) runs the
same online half over the chunks after the first: each chunk's attention updates ``ŝ`` (its
queries in order, eq. 8) and the chunk's victims are merged at once (eq. 25) into the entries
that remain; a selector without an online mode (``snapkv``) cannot be chunked with KeepKV.

**Votes** are conserved: ``Σ p`` over the cache plus the votes of evicted (below-threshold)
entries equals the number of tokens seen (``votes_dropped`` in the reports).

Differences from the paper and its code: the paper states no ``α`` or ``w`` (we use 0.9 and
32; 0.5 / 0.99 / ``w`` = 64 change SmolLM2's fidelity by < 2%); it does not define how
merge-before-evict picks what to merge (ours is the Fast-NMS rule above), how several entries
enter one carrier (ours: eq. 25 at once), nor guards the key formula (``max_scale``). Its code has
no EMA, never scales the key (its key is the convex mean, ``eq7_scaling=false``), splits the budget
as ``h2o_cosine[split=authors_code]`` (the default; Appendix B's sentence reads the other way,
``split=paper_text``) and is MHA-only with batch 1. Ours: GQA (scores pooled over the group), batches with left
padding, per-layer budgets, float32 β (the merged key absorbs β's rounding, so a merge stays exact
as stored).
"""
