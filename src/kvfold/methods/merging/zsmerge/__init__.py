"""ZSMerge / ZeroMerge: online residual merging with compensated attention.

Liu, Liu and Tang, *ZSMerge: Zero-Shot KV Cache Compression for Memory-Efficient Long-Context
LLMs* (``papers/zsmerge.md`` §3) and its earlier version *ZeroMerge* (``papers/zeromerge.md`` §3).
Per KV head the budget is split three ways (§3.2, eq. 3), ``B = B_p + B_c + B_r``:

* **proximity** ``B_p`` — the most recent tokens (a FIFO);
* **context** ``B_c`` — the tokens with the highest contribution score, eq. 5:
  ``s_t ← λ·s_t + a_t`` with ``a_t`` the attention the step's query gives token ``t`` (GQA: mean
  over the query heads of the KV head), ``λ = 0.98``;
* **residual** ``B_r`` — slots that absorb the context tokens Algorithm 1 evicts: the first ``B_r``
  evicted tokens open the slots, each later one joins the slot of largest key dot product
  ``r̂ = argmax_r k_r·k_t`` (eq. 6) as an incremental mean of keys and values, ``w_r̂ += 1`` (eq. 7).

Compensated attention (§3.5, eq. 8) adds ``α·log w`` to the logit of every entry: that is the
cache's log-mass β, so the kvfold attention computes eq. 8 with no change. ``α = 1`` in ZSMerge,
``α = 0.6`` in ZeroMerge; for ``α ≤ 1`` Theorem 1 holds: an uncompressed token never receives less
attention than in the full cache (the property test in ``tests/methods/merging/zsmerge/test_zsmerge.py``).

Two moments, one algorithm:

* **after prefill** (:meth:`ZSMerge.compress`) the cache is brought to budget. Scores are eq. 5
  run over the last ``window`` prefill queries (App. B: ``window_size = 8``), max-pooled along the
  tokens with ``kernel`` (the authors' code). ``prefill="merge"`` (default, the paper) then runs
  Algorithm 1 over the prompt: tokens pass, in position order, through the proximity FIFO into the
  context set; whenever the context set exceeds ``B_c`` its lowest-scored token is evicted into
  the residual slots. Only the end-of-prefill scores exist (per-step scores for every prompt
  token would cost O(N²)), so the stream uses them throughout: the context set kept is exactly the
  top-``B_c`` by score, and the evicted tokens are merged in the order Algorithm 1 evicts them
  (a priority-queue order, not position order). The stream is one loop over prompt tokens whose
  every step is vectorized over all layers, batch rows and KV heads at once
  (:func:`residual_stream`, checked token for token against a literal implementation of
  Algorithm 1 in the tests). ``prefill="pool"`` is the authors' code instead: the same tokens are
  kept and the evicted ones are mean-pooled, in position order, into ``B_r`` contiguous groups
  (weight = group size).
* **online** (:class:`ZSMergeOnline`, the attention's decode-time policy) every forward replays
  Algorithm 1 for its new tokens, in place in the layer's dense buffers: O(budget) work per
  token, one merge per token, and the cache never holds more than the budget. Residual slots are
  kept in float32 (float64 for float64 models) beside the cache, so a bf16 cache does not round
  away merges into a slot that already holds hundreds of tokens.
* **chunked prefill** (:mod:`kvfold.pipeline.chunked`): the first chunk is a prompt brought to budget by
  the online policy (:meth:`ZSMergeOnline.adopt`: window scores, Algorithm 1 over it); every later
  token goes through Algorithm 1 with the scores of eq. 5 updated by its own query's attention
  (one masked minimum per token, the rest vectorized over the chunk), so the residual slots and
  their counts carry over from chunk to chunk.

``residual=0`` is pure eviction with the same scores (``B_c`` takes the residual's share, as in
§3.2: "this configuration subsumes eviction-based methods when B_r = 0"); ``alpha=0`` keeps the
merged slots but without compensation ("degenerating to an eviction-like policy").

Measured (``kvfold fidelity``, SmolLM2-135M, RULER 2K, 26 samples): with the paper's defaults the
attention-output error is only 1–2% below ``residual=0`` at 50–10% cache and 8% *above* it at 5%
(one residual slot absorbing ~1,900 tokens), far from §4.3's −60.5% / −43.8% / −37.4%. A larger
``residual`` share helps somewhat (≈10% at 20% cache with ``residual=0.5``); α > 1 hurts, so the
limit is the uniform mean of the merged values, not the mass compensation.
"""
