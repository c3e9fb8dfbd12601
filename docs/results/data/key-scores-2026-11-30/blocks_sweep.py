"""The blocks benchmarks/gpu.sh's scores phase times (keys x rows a program), compiled for sm_90 with
key_scores.LAUNCH: shared bytes, ptxas's registers and spills, the tensor-core instruction.

    PYTHONPATH=src python docs/results/data/key-scores-2026-11-30/blocks_sweep.py   # from the repository root
"""

import sys

sys.path.insert(0, "tools")  # tools/triton_targets.py

import triton  # noqa: E402
import triton.compiler as tc  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton_targets import ptxas_report, signature, tensor_core_instruction  # noqa: E402

from kvfold.runtime import key_scores, triton_kernels  # noqa: E402

fn = triton_kernels.max_logit_kernel
for keys, rows in ((128, 64), (64, 64), (128, 128), (64, 128)):
    const = {"BLOCK_M": rows, "BLOCK_N": keys, "BLOCK_D": 128, "UPCAST": 0}
    source = tc.ASTSource(fn=fn, signature=signature(fn, {"q_ptr": "*bf16", "k_ptr": "*bf16"}, const), constexprs=const)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(key_scores.LAUNCH))
    ptx = compiled.asm["ptx"]
    print(f"{keys}x{rows}", compiled.metadata.shared, ptxas_report(ptx, 90), tensor_core_instruction(ptx))
