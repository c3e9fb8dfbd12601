"""Compare the logged samples of two lm-eval runs (``--output_path DIR --log_samples``), request by request.

    python benchmarks/lm_eval_task/compare.py runs/hf runs/kvfold-full

prints, per task, how many responses are compared, the largest log-likelihood difference and how many
``is_greedy`` flags differ (loglikelihood tasks) or how many generated texts differ, and both runs' metrics.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(directory: Path) -> tuple[dict[str, list[dict]], dict]:
    """The samples per task and the results of the newest run under ``directory``."""
    samples: dict[str, list[dict]] = {}
    for path in sorted(directory.rglob("samples_*.jsonl")):
        task = path.name[len("samples_") :].rsplit("_", 1)[0]
        samples[task] = sorted((json.loads(line) for line in path.open()), key=lambda s: s["doc_id"])
    results = json.loads(sorted(directory.rglob("results_*.json"))[-1].read_text())
    return samples, results["results"]


def compare(a: Path, b: Path) -> None:
    samples_a, results_a = load(a)
    samples_b, results_b = load(b)
    for task in sorted(samples_a):
        n, texts, deltas, greedy = 0, 0, [], 0
        for sa, sb in zip(samples_a[task], samples_b[task], strict=True):
            for ra, rb in zip(sa["resps"], sb["resps"], strict=True):
                n += 1
                if isinstance(ra[0], str):
                    texts += ra[0] != rb[0]
                else:
                    deltas.append(abs(float(ra[0][0]) - float(rb[0][0])))
                    greedy += ra[0][1] != rb[0][1]
        found = (
            f"max |Δ loglikelihood| {max(deltas):.2e}, is_greedy differs {greedy}"
            if deltas
            else f"texts differ {texts}"
        )
        metrics = ", ".join(
            f"{k.split(',')[0]} {results_a[task][k]:.3f} vs {results_b[task][k]:.3f}"
            for k in results_a[task]
            if k.endswith(",none") and "stderr" not in k
        )
        print(f"{task}: {n} responses, {found}; {metrics}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    args = parser.parse_args()
    compare(args.a, args.b)
