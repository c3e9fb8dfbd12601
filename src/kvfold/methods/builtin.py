"""The built-in methods: importing this module registers every one of them.

Each module below defines its methods with the ``@register`` decorator of
:mod:`kvfold.methods.core.base`, so importing it adds them to the registry. The package
:mod:`kvfold.methods` imports this module, so :func:`~kvfold.methods.core.base.build_method` and
:func:`~kvfold.methods.core.base.available_methods` always see every method; the registry itself
(in :mod:`kvfold.methods.core`) imports no method family. A new method module is added here.
"""

from kvfold.methods.compaction import grkv  # noqa: F401 - registers grkv
from kvfold.methods.compaction.attention_matching import fit_folder  # noqa: F401 - registers am_fit
from kvfold.methods.compaction.attention_matching import method as attention_matching  # noqa: F401 - the am_* variants
from kvfold.methods.eviction import (  # noqa: F401 - registers the eviction methods and wrappers
    adakv,
    compactor,
    criticalkv,
    expected_attention,
    global_budget,
    h2o,
    knorm,
    kvzip,
    leverage,
    plumbing,
    snapkv,
    tova,
)
from kvfold.methods.merging import cam, d2o, kvmerger  # noqa: F401 - registers the merging methods
from kvfold.methods.merging.keepkv import method as keepkv  # noqa: F401 - keepkv, h2o_cosine
from kvfold.methods.merging.zsmerge import method as zsmerge  # noqa: F401 - zsmerge, zeromerge
