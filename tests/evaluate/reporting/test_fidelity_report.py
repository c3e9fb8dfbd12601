"""The fidelity report: its Markdown tables and plot from fidelity records."""

from __future__ import annotations

from pathlib import Path

from kvfold.evaluate.reporting import fidelity_markdown, write_fidelity_report
from tests.evaluate.reporting.conftest import assert_png


def test_fidelity_report(tmp_path: Path) -> None:
    records = [
        {
            "method": "full",
            "budget": 1.0,
            "rel_error": 0.0,
            "nll_delta": 0.0,
            "kl": 0.0,
            "kv_ratio": 1.0,
            "per_layer": [0.0, 0.0],
            "n": 2,
        },
        *(
            {
                "method": "streamingllm",
                "budget": b,
                "rel_error": 0.1 / b,
                "nll_delta": 0.01 / b,
                "kl": 0.001 / b,
                "kv_ratio": b,
                "per_layer": [0.05 / b, 0.15 / b],
                "n": 2,
            }
            for b in (0.5, 0.2, 0.1)
        ),
    ]
    text = fidelity_markdown(records)
    assert "| method | 0.5 | 0.2 | 0.1 |" in text
    assert "| `streamingllm` | 0.2 | 0.5 | 1 |" in text
    assert "| layer | `streamingllm` @ 0.5 | `streamingllm` @ 0.2 | `streamingllm` @ 0.1 |" in text
    paths = write_fidelity_report(tmp_path, records)
    assert_png(paths[1])
