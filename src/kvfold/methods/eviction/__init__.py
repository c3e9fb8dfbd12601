"""Eviction: selectors that keep the best-scored entries and drop the rest (β stays 0).

One module per method: ``full``, ``streamingllm`` and ``random`` (:mod:`.plumbing`), ``snapkv`` and
``pyramidkv`` (:mod:`.snapkv`), ``h2o`` (:mod:`.h2o`), ``tova``, ``knorm``, ``expected_attention``,
``kvzip``, ``leverage``, ``compactor``, and the wrappers ``adakv:``, ``criticalkv:`` and ``global:``.
Each module holds its method's own scores and allocation (``snapkv_scores`` and
``pyramid_layer_budgets`` in :mod:`.snapkv`, ``adakv_head_budgets`` in :mod:`.adakv`, …); what several
methods share comes from :mod:`kvfold.methods.core` (window attention and pooling in
:mod:`~kvfold.methods.core.scoring`, top-k in :mod:`~kvfold.methods.core.selection`, budgets in
:mod:`~kvfold.methods.core.budgets`); the online methods run their decode-time half through
:mod:`kvfold.methods.core.online`. Other families reuse these scores by importing them from here.
"""
