"""benchmarks/bench_table.py: the list of paths each method's run took, under its table (what the GPU run's
README says about which kernels ran)."""

from __future__ import annotations

from tests.tools.scripts import load_script


def _module():
    return load_script("benchmarks/bench_table.py")


def test_the_paths_list_names_each_methods_paths_once():
    records = [
        {"method": "full", "stored_attention": None, "repeat_attention": None, "repeat_scores": None},
        {
            "method": "kvzip",
            "stored_attention": "triton (256 programs a layer, at most 2 pages each)",
            "repeat_attention": "fused (CUDA flash kernel)",
            "repeat_scores": "fused (Triton)",
        },
        {"method": "kvzip", "stored_attention": "torch", "repeat_scores": "fused (Triton)"},
        {"method": "streamingllm", "stored_attention": "torch"},
        {"method": "kvzip+am_fit", "repeat_scores": "fused (Triton)", "fit_products": "16-bit operands, float32 sums"},
    ]
    assert _module().path_lines(records) == [
        "- kvzip: stored rows: triton (256 programs a layer, at most 2 pages each); "
        "repeat pass's attention: fused (CUDA flash kernel); KVzip's scores: fused (Triton)",
        "- streamingllm: stored rows: torch",
        "- kvzip+am_fit: KVzip's scores: fused (Triton); fits' logits: 16-bit operands, float32 sums",
    ]
