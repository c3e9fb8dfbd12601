"""The kernel before splits (one program a row, Triton's default launch, query blocks of 16–64 and whole
pages), compiled for an H200 as ``tools/triton_targets.py`` compiles today's, for the table "before".

    git show e5ca71e^:src/kvfold/runtime/triton_kernels.py > /tmp/old_triton_kernels.py
    python docs/results/data/split-k-2026-11-29/old_kernel.py /tmp/old_triton_kernels.py
    PYTHONPATH=/tmp/triton36 python docs/results/data/split-k-2026-11-29/old_kernel.py /tmp/old_triton_kernels.py
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "tools"))

import triton  # noqa: E402
import triton.compiler as tc  # noqa: E402
import triton_targets  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402


def main() -> None:
    spec = importlib.util.spec_from_file_location("old_triton_kernels", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    triton_targets.POINTERS["first_page_ptr"] = "*i32"
    print(f"Triton {triton.__version__}, sm_90, Triton's default launch (as the old launcher)")
    print("| variant | shared bytes | warps | registers | spill stores / loads |")
    print("|---|---:|---:|---:|---|")
    for block_m in (16, 64):
        for bits, size in ((16, 32), (8, 32), (4, 32), (3, 32), (2, 32), (4, 16), (4, 64)):
            rows = "*bf16" if bits == 16 else "*u8"
            scales = "*bf16" if bits == 16 else "*fp16"
            types = {"keys_ptr": rows, "values_ptr": rows}
            types |= {f"{p}_ptr": scales for p in ("key_scale", "key_zero", "value_scale", "value_zero")}
            const = {"BITS": bits, "SIZE": size, "BLOCK_M": block_m, "BLOCK_D": 128, "BLOCK_DV": 128}
            fn = module.stored_part_kernel
            source = tc.ASTSource(fn=fn, signature=triton_targets.signature(fn, types, const), constexprs=const)
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
            report = triton_targets.ptxas_report(compiled.asm["ptx"], 90)
            print(
                f"| bits={bits} page={size} block_m={block_m} | {compiled.metadata.shared:,} | "
                f"{compiled.metadata.num_warps} | {report['registers']} | {report['spill_stores']} / "
                f"{report['spill_loads']} |"
            )


if __name__ == "__main__":
    main()
