# The blocks benchmarks/gpu.sh's scores phase times, compiled for sm_90 (run from the repository root: PYTHONPATH=src python docs/results/data/key-scores-2026-11-30/blocks_sweep.py)
import sys, inspect
sys.path.insert(0, "tools")
import triton, triton.compiler as tc
from triton.backends.compiler import GPUTarget
from triton_targets import ptxas_report, signature, tensor_core_instruction
from kvfold.runtime import triton_kernels
fn = triton_kernels.max_logit_kernel
for bn, bm in ((128, 64), (64, 64), (128, 128), (64, 128)):
    const = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_D": 128, "UPCAST": 0}
    sig = signature(fn, {"q_ptr": "*bf16", "k_ptr": "*bf16"}, const)
    c = triton.compile(tc.ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 1})
    print(f"{bn}x{bm}", c.metadata.shared, ptxas_report(c.asm["ptx"], 90), tensor_core_instruction(c.asm["ptx"]))
