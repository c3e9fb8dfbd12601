"""Eviction: selectors that keep the best-scored entries and drop the rest (β stays 0).

One module per method: ``full``, ``streamingllm`` and ``random`` (:mod:`.plumbing`), ``snapkv`` and
``pyramidkv`` (:mod:`.snapkv`), ``h2o`` (:mod:`.h2o`), ``tova``, ``knorm``, ``expected_attention``,
``kvzip``, and the wrappers ``adakv:`` and ``criticalkv:``. Scores come from
:mod:`kvfold.methods.core.scoring`, budgets from :mod:`kvfold.methods.core.budgets`; the online
methods run their decode-time half through :mod:`kvfold.methods.core.online`.
"""
