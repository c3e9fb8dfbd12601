"""A head-budget schedule: each (layer, KV head)'s share of the total budget, computed once per
model (Attention Matching's nonuniform head budgets, Zweiger et al. 2026, §3.4, Appendix E).

Written below the methods that read it: ``am_*[schedule=path.json]`` and ``kvzip[schedule=path.json]``
take their per-head counts from it; :mod:`kvfold.methods.compaction.attention_matching.schedule`
measures the sensitivity curves and runs Algorithm 4 to make one.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvfold.methods.core.budgets import apportion
from kvfold.methods.core.model import model_name
from kvfold.runtime.errors import UserError
from kvfold.runtime.files import atomic_write_text

Tensor = torch.Tensor

__all__ = ["HeadSchedule", "config_hash"]

_ARCH_FIELDS = (
    "model_type",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_size",
    "vocab_size",
    "layer_types",
)


def config_hash(config) -> str:
    """A short hash of the architecture fields of a (text) config: schedules are per model."""
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    fields = {name: getattr(text_config, name, None) for name in _ARCH_FIELDS}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class HeadSchedule:
    """Per-(layer, KV head) shares of the total budget.

    Attributes:
        model: the model's name (informative).
        config_hash: :func:`config_hash` of the model it was computed for (checked on load).
        layers: the folded (full-attention) layer indices, in order.
        shares: ``[layer][head]`` shares, summing to 1.
        r0: the reference compaction ratio of Algorithm 4.
        eta: the share step of Algorithm 4.
        ratios: ratios of the sensitivity curves (empty for a hand-made schedule).
        curves: ``[layer][head][ratio]`` loss changes, or empty.
    """

    model: str
    config_hash: str
    layers: list[int]
    shares: list[list[float]]
    r0: float = 0.05
    eta: float = 0.0
    ratios: list[float] = field(default_factory=list)
    curves: list[list[list[float]]] = field(default_factory=list)

    def save(self, path: str | Path) -> Path:
        """Write the schedule as JSON, atomically (its folder made); returns the path.

        Raises:
            OutputError: the file cannot be written.
        """
        return atomic_write_text(path, json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path, model=None) -> HeadSchedule:
        """Read a schedule; with ``model``, check it was made for this architecture.

        Raises:
            ValueError: a missing or malformed file, or a schedule for another model.
        """
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            schedule = cls(**data)
        except (OSError, TypeError, ValueError) as err:
            raise UserError(f"cannot read the head schedule {path}: {err}") from None
        if model is not None:
            expected = config_hash(model.config)
            if schedule.config_hash != expected:
                raise UserError(
                    f"the head schedule {path} was computed for {schedule.model!r} "
                    f"(architecture {schedule.config_hash}); "
                    f"this model is {model_name(model)!r} ({expected}). Compute one for this model with "
                    "kvfold.methods.compaction.attention_matching.schedule.build_head_schedule"
                )
        return schedule

    def share_tensor(self) -> Tensor:
        return torch.tensor(self.shares, dtype=torch.float64)

    def counts(self, row_budgets: Tensor, n_valid: dict[int, Tensor]) -> dict[int, Tensor]:
        """Entries per ``(B, H)`` of each layer: ``budget · (layers · heads)`` split by the shares.

        Args:
            row_budgets: ``(B,)`` entries per KV head and layer on average (the budget; fractional
                averages are rounded in the total, ``budget · layers · heads``).
            n_valid: valid entries ``(B, H)`` per layer (each count is capped by them).
        """
        shares = self.share_tensor()
        num_layers, heads = shares.shape
        if sorted(n_valid) != sorted(self.layers):
            raise UserError(f"the head schedule covers layers {self.layers}; the cache folds {sorted(n_valid)}")
        out = {i: torch.zeros_like(n_valid[i]) for i in self.layers}
        for b, budget in enumerate(row_budgets.tolist()):
            longest = max(int(n_valid[i][b].max()) for i in self.layers)
            total = min(round(budget * num_layers * heads), longest * num_layers * heads)
            parts = apportion(shares.flatten(), total, minimum=min(1, total // (num_layers * heads)), maximum=longest)
            table = torch.tensor(parts, dtype=torch.long).view(num_layers, heads)
            for j, i in enumerate(self.layers):
                out[i][b] = torch.minimum(table[j].to(n_valid[i].device), n_valid[i][b])
        return out
