"""One layer's Attention Matching fits at 32K tokens of Llama-3.1-8B's shape (128 problems: 8 KV heads x 16
repeat chunks of 2,048 entries, 8,192 queries, 205 kept), with a GPU's block sizes and 16-bit operands, under
kvfold.runtime.live_bytes.LiveBytes (the memory the fit adds over its inputs) or, with "count", under
benchmarks/profile_compress.py's OperatorCount (the operators it launches, views apart); and its groups.

    PYTHONPATH=src:. OMP_NUM_THREADS=1 python fit_group_peak.py 128 [count]
"""

import sys

import torch

from kvfold.methods.compaction.attention_matching import grouping, solve
from kvfold.methods.compaction.attention_matching.fit_folder import AMFit
from kvfold.runtime import exact_products
from kvfold.runtime.live_bytes import LiveBytes
from tests.tools.scripts import load_script

problems = int(sys.argv[1]) if len(sys.argv) > 1 else 128
counting = sys.argv[2:] == ["count"]
fit = load_script("benchmarks/fit_products.py")
args = fit._parse(["--device", "cpu", "--problems", str(problems)])
keys, values, log_mass, queries, valid, counts, given = fit._problems(torch, args, problems)
exact_products.FORCED = True
solve.fit_sizes = lambda device: solve.ACCELERATOR_FIT_SIZES
config = AMFit().fit_config()
real, found = grouping.groups_by_width, []
grouping.groups_by_width = lambda *a, **k: found.extend(real(*a, **k)) or found
inputs = sum(t.untyped_storage().nbytes() for t in (keys, values, log_mass, queries, valid, counts, given))
mode = load_script("benchmarks/profile_compress.py").OperatorCount() if counting else LiveBytes()
with torch.inference_mode(), mode:
    solve.fit_problems(keys, values, log_mass, queries, valid, counts, 128**-0.5, config, given=given)
if counting:
    print(f"{problems} problems: {sum(mode.phases.values()):,} operators ({mode.views:,} views apart); "
          f"{sum(mode.phase_flops.values()) / 1e12:.3f} TFLOP")
else:
    print(f"{problems} problems: inputs {inputs / 2**20:,.1f} MiB; peak {mode.peak / 2**20:,.1f} MiB over them")
print("groups", len(found), [len(rows) for rows, _ in found])
