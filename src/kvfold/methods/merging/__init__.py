"""Merging: evicted entries folded into the entries that stay (β = log of what they stand for).

Folders after ``+`` (``cam``, ``d2o_merge``, ``kvmerger``, ``keepkv``) and standalones (``d2o``,
``kvmerger_sets``, ``zsmerge``/``zeromerge``). What they share — the layer being folded, the
kept/evicted masks, merge records — is :mod:`kvfold.methods.core.folding`.
"""
