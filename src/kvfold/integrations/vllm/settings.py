"""The vLLM settings that serve kvfold caches: the architecture name, the connector's configuration keys,
:func:`engine_settings`, and the size of the KV space (:func:`plan_kv_space`; imports neither vLLM nor
torch)."""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfold.runtime.errors import UserError

ARCHITECTURES = {
    "llama": "KvfoldLlamaForCausalLM",
    "mistral": "KvfoldMistralForCausalLM",
    "mixtral": "KvfoldMixtralForCausalLM",
    "qwen2": "KvfoldQwen2ForCausalLM",
    "qwen2_moe": "KvfoldQwen2MoeForCausalLM",
    "qwen3": "KvfoldQwen3ForCausalLM",
    "qwen3_moe": "KvfoldQwen3MoeForCausalLM",
    "granite": "KvfoldGraniteForCausalLM",
    "phi3": "KvfoldPhi3ForCausalLM",
}
"""Model type (a transformers config's ``model_type``) → the architecture name under which vLLM's model
class of that family, on kvfold's attention backend, is registered with vLLM
(:mod:`kvfold.integrations.vllm.model`)."""
SERVED_MODEL_TYPES = tuple(ARCHITECTURES)
"""Model families the plugin serves."""
EXTRA_CACHES = "kvfold_caches"
"""``kv_connector_extra_config`` key: the folder of cache files."""
EXTRA_SHIFT = "kvfold_keep_positions"
"""``kv_connector_extra_config`` key (default True): turn the question's queries to the context's
positions for the file's entries (False only to show that answers depend on it)."""
BLOCK_SIZE = 32
"""Tokens per KV block (vLLM's CPU attention takes multiples of 32; its default 128 pads more)."""


def engine_settings(
    caches: str,
    *,
    model_type: str = "llama",
    keep_positions: bool = True,
    prefix_caching: bool = True,
    dtype: str = "float32",
) -> dict[str, Any]:
    """The vLLM engine arguments that serve kvfold caches from folder ``caches`` (``vllm.LLM(**...)`` or
    ``AsyncEngineArgs``): the model family ``model_type`` (:data:`SERVED_MODEL_TYPES`) on kvfold's
    attention backend, ``dtype`` (float32 by default), the connector, prefix caching salted per file.
    ``keep_positions=False`` exists for a test that shows the queries' turn matters.

    Raises:
        UserError: a model type the plugin does not serve.
    """
    if model_type not in ARCHITECTURES:
        raise UserError(f"kvfold serve serves {', '.join(SERVED_MODEL_TYPES)} models; this one is {model_type!r}")
    return {
        "hf_overrides": {"architectures": [ARCHITECTURES[model_type]]},
        "dtype": dtype,
        "block_size": BLOCK_SIZE,
        "enable_prefix_caching": prefix_caching,
        "kv_transfer_config": {
            "kv_connector": "KvfoldConnector",
            "kv_connector_module_path": "kvfold.integrations.vllm.connector",
            "kv_role": "kv_consumer",
            "kv_load_failure_policy": "fail",
            "kv_connector_extra_config": {EXTRA_CACHES: str(caches), EXTRA_SHIFT: keep_positions},
        },
    }


GIB = 1 << 30
KV_FRACTION = 0.25
"""Share of the memory left free (after the server's own) that the default KV space takes."""
KV_CAP = 2 * GIB
"""Most bytes the default KV space takes (about 46K tokens of SmolLM2 in float32: five full contexts);
``--kv-space`` takes more."""
SERVER_BYTES = 3 * GIB
"""Memory the server needs besides its weights and its KV space: the API server and the engine's Python,
torch and vLLM runtimes (measured: about 2.7 GiB for SmolLM2-135M on vLLM 0.32's CPU build)."""
WEIGHT_COPIES = 2
"""Copies of the weights the server holds: vLLM's engine, and the API server's transformers model that
checks files against the model's fingerprint."""


CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head widths vLLM 0.32's CPU attention takes (``CPUAttentionBackend.get_supported_head_sizes()``, copied
so that ``kvfold serve`` checks a model without importing vLLM; a test of the vLLM suite compares the two).
Another width fails in vLLM's kernel at the first request, a plain one too."""


def head_size(config: Any) -> int:
    """Channels of one attention head, from a transformers config (``head_dim``, else hidden ÷ heads)."""
    return int(getattr(config, "head_dim", None) or int(config.hidden_size) // int(config.num_attention_heads))


def check_head_size(config: Any) -> None:
    """Refuse, in one line, a model whose heads vLLM's CPU attention does not take (:data:`CPU_HEAD_SIZES`).

    Raises:
        UserError: the width is not one of them.
    """
    width = head_size(config)
    if width not in CPU_HEAD_SIZES:
        raise UserError(
            f"vLLM's CPU attention takes heads of {', '.join(map(str, CPU_HEAD_SIZES))} channels; "
            f"this model's have {width}"
        )


def check_query_scaling(config: Any) -> None:
    """Refuse, in one line, Mistral's query scaling by position (``llama_4_scaling``).

    vLLM's Mistral attention multiplies each query by ``1 + β·log(1 + ⌊position / original⌋)`` when
    the config names it; transformers' Mistral model, which compresses the files and answers
    ``kvfold ask``, does not scale queries, so past the original window the served answers would
    differ from the library's.

    Raises:
        UserError: the config names it.
    """
    if getattr(config, "llama_4_scaling", None):
        raise UserError(
            "query scaling by position (llama_4_scaling) is not supported: transformers' Mistral model, which "
            "compresses the files, does not scale queries, so served answers would differ; "
            "serve a checkpoint without it"
        )


def kv_bytes_per_token(config: Any, dtype_bytes: int = 4) -> int:
    """Bytes of vLLM's KV cache for one token (keys and values, every layer and KV head, float32 by
    default), from a transformers config (or anything with its attributes): stock vLLM's, since the
    plugin keeps the heads' width."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    return int(config.num_hidden_layers) * 2 * kv_heads * head_size(config) * dtype_bytes


def weights_bytes(model_dir: str | os.PathLike, dtype_bytes: int = 4) -> int:
    """Bytes of the model's weights in float32: the elements of its ``.safetensors`` files (read from
    their headers), or twice the size of its other weight files (``.bin``, ``.pt``, ``.gguf``)."""
    total = 0
    for path in Path(model_dir).iterdir():
        if path.suffix == ".safetensors":
            with path.open("rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
            for name, entry in header.items():
                if name != "__metadata__":
                    total += math.prod(entry["shape"]) * dtype_bytes
        elif path.suffix in (".bin", ".pt", ".gguf"):
            total += 2 * path.stat().st_size
    return total


def available_memory() -> int:
    """Bytes of memory free for a new process: ``MemAvailable`` of ``/proc/meminfo``, less where a
    cgroup's limit (``memory.max`` less ``memory.current``) leaves less."""
    free = None
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
                break
    if free is None:
        raise OSError("/proc/meminfo has no MemAvailable line")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        current = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            free = min(free, max(0, int(limit) - current))
    except (OSError, ValueError):
        pass
    return free


@dataclass(frozen=True)
class KvSpace:
    """The KV space a server gets (:func:`plan_kv_space`).

    Attributes:
        bytes: its size.
        need: the least it must hold: one full context and the largest cache served, in whole blocks.
        free: the memory free when it was sized.
        server: the memory the server needs besides it (weights and runtimes).
    """

    bytes: int
    need: int
    free: int
    server: int

    def describe(self) -> str:
        """One line: the size and how it was chosen."""
        return (
            f"KV space {self.bytes / GIB:.2f} GiB (at least {self.need / GIB:.2f} GiB for a full context and the "
            f"largest cache; {self.free / GIB:.1f} GiB free, {self.server / GIB:.1f} GiB for the server)"
        )


def plan_kv_space(*, per_token: int, max_model_len: int, largest_cache_tokens: int, weights: int, free: int) -> KvSpace:
    """The default KV space: :data:`KV_FRACTION` of the memory left after the server's own
    (:data:`WEIGHT_COPIES` × ``weights`` + :data:`SERVER_BYTES`), at most :data:`KV_CAP`, and never less
    than one full context (``max_model_len`` tokens) plus the largest cache served, in whole blocks.

    Raises:
        UserError: less memory is free than the server and that least KV space need (one line: what to
            pass instead).
    """

    def blocks(tokens: int) -> int:
        return -(-tokens // BLOCK_SIZE) * BLOCK_SIZE

    need = per_token * (blocks(max_model_len) + blocks(largest_cache_tokens))
    server = WEIGHT_COPIES * weights + SERVER_BYTES
    spare = free - server
    if spare < need:
        raise UserError(
            f"the server needs about {server / GIB:.1f} GiB and its KV space at least {need / GIB:.2f} GiB (a full "
            f"context of {max_model_len} tokens and the largest cache, {largest_cache_tokens} tokens), but "
            f"{free / GIB:.1f} GiB of memory is free: free some memory, or pass --max-model-len N (a shorter "
            "context) or --kv-space N (GiB) to try anyway"
        )
    size = max(need, min(KV_CAP, int(KV_FRACTION * spare)))
    return KvSpace(bytes=size, need=need, free=free, server=server)
