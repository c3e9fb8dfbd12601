"""One layer's Attention Matching fits at 32K tokens of Llama-3.1-8B's shape (as fit_group_peak.py: 128
problems, a GPU's block sizes, 16-bit operands), under benchmarks/profile_compress.py's OperatorCount: the
operators the fit launches (views apart), and its groups.

    PYTHONPATH=src:. OMP_NUM_THREADS=1 python fit_group_count.py 128
"""

import sys

import torch

from kvfold.methods.compaction.attention_matching import grouping, solve
from kvfold.methods.compaction.attention_matching.fit_folder import AMFit
from kvfold.runtime import exact_products
from tests.tools.scripts import load_script

problems = int(sys.argv[1]) if len(sys.argv) > 1 else 128
fit = load_script("benchmarks/fit_products.py")
profile = load_script("benchmarks/profile_compress.py")
args = fit._parse(["--device", "cpu", "--problems", str(problems)])
keys, values, log_mass, queries, valid, counts, given = fit._problems(torch, args, problems)
exact_products.FORCED = True
solve.fit_sizes = lambda device: solve.ACCELERATOR_FIT_SIZES
config = AMFit().fit_config()
real, found = grouping.groups_by_width, []
grouping.groups_by_width = lambda *a, **k: found.extend(real(*a, **k)) or found
ops = profile.OperatorCount()
with torch.inference_mode(), ops:
    solve.fit_problems(keys, values, log_mass, queries, valid, counts, 128**-0.5, config, given=given)
print(f"{problems} problems: {sum(ops.phases.values()):,} operators ({ops.views:,} views apart); "
      f"{sum(ops.phase_flops.values()) / 1e12:.3f} TFLOP")
print("groups", len(found), [len(rows) for rows, _ in found])
