"""Attention Matching compaction: ``am_omp``, ``am_omp_fast``, ``am_highest``, ``am_highest_fast``
and the ``am_fit`` folder.

Zweiger et al. 2026, "Fast KV Compaction via Attention Matching" (``papers/attention-matching.md``),
§2–3, Appendices A, C, E, F. A span of every KV head's cache is replaced by ``t`` entries
``(C_k, β, C_v)`` that reproduce, on reference queries, both the span's attention mass (eq. 2)
and its locally normalised attention output (eq. 1). By the mixture identity (App. A.2, eq. 5)
the compacted span then behaves right next to any other entries, including tokens appended
later. Keys are a subset of the span's own keys (§3.3), so their RoPE phases and the cache's
logical length are unchanged: appended tokens get the positions they would have had.

Modules: reference queries (:mod:`.queries`), the batched fits (:mod:`.solve`), nonuniform head
budgets (:mod:`.schedule`), a layer's spans and chunks compacted (:mod:`.compact`), fits by repeat
chunk that grow linearly with the context (:mod:`.fit_chunks`), text chunks compacted on their own
(:mod:`.text_chunks`), the registered variants (§4 "Compared Variants") and online compaction
(App. F.3) in :mod:`.method`, the β-and-value refit after any selector (``snapkv+am_fit``) in
:mod:`.fit_folder`, and the options both share (:mod:`.options`).

Variants (§4): ``am_omp`` (OMP keys, self-study + repeat-prefill queries), ``am_omp_fast`` (OMP
with k = 4 keys per step, refit every τ = 2 steps, App. C.1), ``am_highest`` (highest-attention
keys, NNLS β boxed to [−3, 3], self-study + repeat-prefill), ``am_highest_fast`` (the same with
repeat-prefill queries only).
"""
