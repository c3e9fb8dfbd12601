"""Compile kvfold's Triton kernels for a GPU without one: every variant kvfold launches, for a target.

The tests run the kernels under Triton's interpreter on the CPU (``TRITON_INTERPRET=1``), which checks
what they compute but not that they compile: a block too large for shared memory, an operation the
compiler refuses, registers spilled to memory show only when a GPU compiles them. Triton's NVIDIA
backend carries its own ``ptxas``, so each variant (16-bit rows and 8-, 4-, 3- and 2-bit codes, query
blocks of 16, pages of 16, 32 and 64 entries, head dimension 128, and the merge of splits; KVzip's
scores over bfloat16 and float16 keys) is compiled here for the target (default: an H200, ``sm_90``)
with the launch options kvfold uses (``triton_attention.LAUNCH``, ``key_scores.LAUNCH``), and
``ptxas -v`` says its registers and spills.

    python tools/triton_targets.py                     # a table; exit 1 if a variant fails or spills
    python tools/triton_targets.py --arch 80 --json    # an A100, as JSON
    python tools/triton_targets.py --default-launch    # Triton's launch options instead of kvfold's

Run without ``TRITON_INTERPRET`` set (the interpreter replaces the kernels it would compile).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SHARED_LIMIT = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448}
"""Shared memory a block may use (opt-in maximum, bytes) by compute capability (CUDA's programming guide)."""

POINTERS = {
    "q_ptr": "*fp32",
    "split_row_ptr": "*i32",
    "split_start_ptr": "*i32",
    "split_end_ptr": "*i32",
    "slots_ptr": "*i64",
    "bias_ptr": "*fp32",
    "top_ptr": "*fp32",
    "den_ptr": "*fp32",
    "num_ptr": "*fp32",
    "split_top_ptr": "*fp32",
    "split_den_ptr": "*fp32",
    "split_num_ptr": "*fp32",
    "first_split_ptr": "*i32",
    "shift_ptr": "*fp32",
    "out_ptr": "*fp32",
}
"""Each pointer argument's element type (keys, values, scales and zero points depend on the variant)."""


def variants(head_dim: int = 128) -> list[tuple[str, str, dict[str, str], dict[str, int], dict[str, int]]]:
    """``(name, kernel, pointer types, constexprs, launch options)`` of each variant kvfold launches: a decode's
    every width of codes in pages of 32 entries, 4 bits in pages (key groups) of 16 and 64, and the merge
    (``triton_attention.LAUNCH``); KVzip's scores over 16-bit keys (``key_scores.LAUNCH``)."""
    from kvfold.runtime import key_scores
    from kvfold.runtime.triton_attention import LAUNCH, PAGE_PART, QUERY_BLOCK

    out = []
    for bits, size in ((16, 32), (8, 32), (4, 32), (3, 32), (2, 32), (4, 16), (4, 64)):
        rows = "*bf16" if bits == 16 else "*u8"
        scales = "*bf16" if bits == 16 else "*fp16"
        types = {"keys_ptr": rows, "values_ptr": rows}
        types |= {f"{p}_ptr": scales for p in ("key_scale", "key_zero", "value_scale", "value_zero")}
        const = {"BITS": bits, "SIZE": size, "PART": min(size, PAGE_PART), "BLOCK_M": QUERY_BLOCK}
        const |= {"BLOCK_D": head_dim, "BLOCK_DV": head_dim}
        out.append((f"stored_part bits={bits} page={size}", "stored_part_kernel", types, const, LAUNCH))
    const = {"BLOCK_M": QUERY_BLOCK, "BLOCK_DV": head_dim}
    out.append(("merge_splits", "merge_splits_kernel", {}, const, LAUNCH))
    for dtype in ("bf16", "fp16"):
        const = {"BLOCK_M": key_scores.BLOCK_ROWS, "BLOCK_N": key_scores.BLOCK_KEYS, "BLOCK_D": head_dim, "UPCAST": 0}
        types = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}"}
        out.append((f"max_logit {dtype}", "max_logit_kernel", types, const, key_scores.LAUNCH))
    return out


def signature(fn, types: dict[str, str], const: dict[str, int]) -> dict[str, str]:
    """Triton's signature of kernel ``fn``: each argument's type (``types``, then :data:`POINTERS`; ``i32``
    for sizes, ``fp32`` for the scale) or ``constexpr`` for those in ``const``."""
    names = list(inspect.signature(fn.fn).parameters)
    sig = {}
    for name in names:
        if name in const:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = types.get(name) or POINTERS[name]
        elif name == "scaling":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def ptxas_report(ptx: str, arch: int) -> dict[str, int]:
    """Registers and spill bytes ``ptxas -v`` reports for ``ptx``."""
    from triton.backends.nvidia import compiler as nvidia

    ptxas = nvidia.get_ptxas(arch).path  # the ptxas Triton compiles with for this target
    suffix = "a" if arch == 90 else ""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "k.ptx")
        src.write_text(ptx)
        done = subprocess.run(
            [ptxas, "-v", f"--gpu-name=sm_{arch}{suffix}", str(src), "-o", str(Path(tmp, "k.cubin"))],
            capture_output=True,
            text=True,
            check=True,
        )
    text = done.stderr + done.stdout
    registers = re.search(r"Used (\d+) registers", text)
    stores = re.search(r"(\d+) bytes spill stores", text)
    loads = re.search(r"(\d+) bytes spill loads", text)
    return {
        "registers": int(registers.group(1)) if registers else -1,
        "spill_stores": int(stores.group(1)) if stores else 0,
        "spill_loads": int(loads.group(1)) if loads else 0,
    }


def tensor_core_instruction(ptx: str) -> str | None:
    """The tensor-core instruction the kernel's matrix products compiled to: ``wgmma`` (a warp group's, sm_90),
    ``mma`` (a warp's), or None (products on the ordinary float units)."""
    if "wgmma.mma_async" in ptx:
        return "wgmma"
    return "mma" if re.search(r"\bmma\.sync", ptx) else None


def compile_all(arch: int = 90, default_launch: bool = False, only: str = "") -> list[dict]:
    """Each variant (whose name contains ``only``) compiled for ``sm_{arch}`` with kvfold's launch options
    (``default_launch``: Triton's own): shared memory, warps, registers, spills, or its error."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("triton_targets.py: unset TRITON_INTERPRET (the interpreter compiles nothing)")
    import triton
    import triton.compiler as tc
    from triton.backends.compiler import GPUTarget

    from kvfold.runtime import triton_kernels

    records = []
    for name, kernel, types, const, launch in variants():
        if only not in name:
            continue
        fn = getattr(triton_kernels, kernel)
        record: dict = {"variant": name, "arch": arch}
        options = {} if default_launch else dict(launch)
        try:
            source = tc.ASTSource(fn=fn, signature=signature(fn, types, const), constexprs=const)
            compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
            record |= {"shared": int(compiled.metadata.shared), "warps": int(compiled.metadata.num_warps)}
            record |= ptxas_report(compiled.asm["ptx"], arch)
            record["tensor_cores"] = tensor_core_instruction(compiled.asm["ptx"])
            record["fits"] = record["shared"] <= SHARED_LIMIT.get(arch, 49_152)
        except Exception as error:  # noqa: BLE001 - any compiler error is this variant's result
            record["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"
        records.append(record)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability × 10 (90: H100/H200)")
    parser.add_argument("--json", action="store_true", help="records as JSON")
    parser.add_argument("--default-launch", action="store_true", help="Triton's launch options, not kvfold's")
    parser.add_argument("--only", default="", help="the variants whose name contains this")
    args = parser.parse_args(argv)
    records = compile_all(args.arch, args.default_launch, args.only)
    if args.json:
        print(json.dumps(records, indent=1))
    else:
        print("| variant | shared bytes | warps | registers | spill stores / loads | tensor cores |")
        print("|---|---:|---:|---:|---|---|")
        for r in records:
            if "error" in r:
                print(f"| {r['variant']} | error: {r['error']} | | | | |")
            else:
                print(
                    f"| {r['variant']} | {r['shared']:,} | {r['warps']} | {r['registers']} "
                    f"| {r['spill_stores']} / {r['spill_loads']} | {r['tensor_cores'] or 'no'} |"
                )
    bad = [r for r in records if "error" in r or not r.get("fits") or r.get("spill_stores")]
    for r in bad:
        print(f"triton_targets.py: {r['variant']} does not compile cleanly for sm_{args.arch}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
