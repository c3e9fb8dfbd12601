"""Shared mechanisms every method composes; nothing here imports a method.

* :mod:`.spec` — the spec grammar (``adakv:snapkv+grkv[lam=0.1]``);
* :mod:`.base` — roles (standalone, selector, wrapper, folder), the registry and the composition
  that turns a spec into a compressed cache;
* :mod:`.scoring` — what the attention-based scorers share (window attention, GQA and token
  pooling, z-scores); each method's own score lives in its module under :mod:`kvfold.methods.eviction`;
* :mod:`.selection` — top-k selection with protected entries;
* :mod:`.budgets` — how many entries each layer and head keeps (the shared schedules);
* :mod:`.folding` — what folders share: the layer they fold, kept/evicted masks, merge records;
* :mod:`.online` — the decode-time policy (evict in place within the budget);
* :mod:`.model` — what methods read from the model (attention modules, scaling, RoPE tables).
"""
