"""Compare two runs of tools/same_records.sh: every record equal, timings left out.

usage: python tools/same_records.py RUN_A RUN_B     (exit 1 when a record differs)
"""

import json
import sys
from pathlib import Path


def _strip(value):
    """The record without timings (keys ending in ``seconds``, ``_s``, or naming a time or a ratio of times)."""
    if isinstance(value, dict):
        timing = ("seconds", "_s", "_over_prefill", "_over_repeat")
        return {k: _strip(v) for k, v in value.items() if not (k.endswith(timing) or "time" in k)}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def _records(path: Path):
    if path.suffix == ".jsonl":
        return [_strip(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    return _strip(json.loads(path.read_text()))


def main(a: Path, b: Path) -> int:
    differ = compared = 0
    for file in sorted(a.rglob("*.json*")):
        other = b / file.relative_to(a)
        if not other.exists():
            print(f"missing: {other}")
            differ += 1
            continue
        left, right = _records(file), _records(other)
        compared += len(left) if isinstance(left, list) else 1
        if left != right:
            differ += 1
            print(f"differ: {file.relative_to(a)}")
    print(f"{compared} records compared, {differ} files differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
