"""Mutation run: replace each merging method's merge step by plain eviction, run its tests, restore.

Usage: .venv/bin/python tools/mutate_merging.py [keepkv grkv grkv_solve cam d2o kvmerger zsmerge]
Prints, per mutation, the pytest summary and the tests that fail (each must fail at least one). Each
mutation runs in a scratch copy of ``src`` and ``tests``: the working tree is never edited.
:func:`stale_mutations` lists mutations a refactor left pointing at code that is gone
(``tests/tools/test_mutate_merging.py`` checks there are none).
"""

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
M = {
    "keepkv": (
        [
            (
                "src/kvfold/methods/merging/keepkv/method.py",
                "merge = evicted & (sim > self.threshold) & torch.isfinite(log_score)",
                "merge = torch.zeros_like(evicted)",
            ),
            (
                "src/kvfold/methods/merging/keepkv/online.py",
                "goes = goes & (torch.gather(weight, 2, victims) > 0)",
                "goes = goes & False",
            ),
            (
                "src/kvfold/methods/merging/keepkv/online.py",
                "goes = leaving & (sim > self.folder.threshold)",
                "goes = leaving & False",
            ),
            (
                "src/kvfold/methods/merging/keepkv/decode.py",
                "goes = leaving & (similarity > self.folder.folder.threshold)",
                "goes = leaving & False",
            ),
        ],
        ["tests/methods/merging/keepkv/test_keepkv.py", "tests/methods/merging/keepkv/test_decode.py"],
    ),
    "grkv": (
        [
            (
                "src/kvfold/methods/compaction/grkv.py",
                "changed = free & (result.choice != _BASE)[..., None]",
                "changed = free & False",
            ),
        ],
        ["tests/methods/compaction/test_grkv.py"],
    ),
    "grkv_solve": (
        [
            (
                "src/kvfold/methods/compaction/grkv.py",
                "    for _ in range(steps):\n        cur_k, cur_v = best_k, best_v",
                "    for _ in range(0):\n        cur_k, cur_v = best_k, best_v",
            ),
        ],
        ["tests/methods/compaction/test_grkv.py"],
    ),
    "cam": (
        [
            (
                "src/kvfold/methods/merging/cam.py",
                "layer.replace(keys0, new_values.to(values0.dtype), beta0, lengths=lengths)",
                "layer.replace(keys0, values0, beta0, lengths=lengths)",
            ),
        ],
        ["tests/methods/merging/test_merging_baselines.py", "tests/methods/merging/test_merge_beats_eviction.py"],
    ),
    "d2o": (
        [
            (
                "src/kvfold/methods/merging/d2o.py",
                "take = in_stream & (stream >= threshold)",
                "take = in_stream & False",
            ),
        ],
        ["tests/methods/merging/test_merging_baselines.py", "tests/methods/merging/test_merge_beats_eviction.py"],
    ),
    "kvmerger": (
        [
            (
                "src/kvfold/methods/merging/kvmerger.py",
                "merged = valid & ~kept & (carrier_of >= 0)",
                "merged = valid & ~kept & (carrier_of >= 0) & False",
            ),
        ],
        [
            "tests/methods/merging/test_kvmerger.py",
            "tests/methods/merging/test_merging_baselines.py",
            "tests/methods/merging/test_merge_beats_eviction.py",
        ],
    ),
    "zsmerge": (
        [
            (
                "src/kvfold/methods/merging/zsmerge/merge.py",
                "    a = act[..., None]\n",
                "    a = (act & (fill < b_r))[..., None]\n",
            ),
            (  # the steady step of both decode paths (online.py, decode.py): the victim joins no slot
                "src/kvfold/methods/merging/zsmerge/merge.py",
                "    w_new = w + 1.0  # w_r̂ ← w_r̂ + 1\n"
                "    k_new = ((w * k_old + k_t) / w_new).unsqueeze(-2)  # eq. 7\n"
                "    v_new = ((w * v_old + v_t) / w_new).unsqueeze(-2)",
                "    w_new = w\n    k_new = k_old.unsqueeze(-2)\n    v_new = v_old.unsqueeze(-2)",
            ),
            (
                "src/kvfold/methods/merging/zsmerge/online.py",
                "        added = merging.to(acc)\n",
                "        added = opens.to(acc)\n        k_t, v_t = k_t * opens[..., None], v_t * opens[..., None]\n",
            ),
        ],
        [
            "tests/methods/merging/zsmerge/test_zsmerge.py",
            "tests/methods/merging/zsmerge/test_decode.py",
            "tests/methods/merging/test_merge_beats_eviction.py",
        ],
    ),
}


def stale_mutations(root: pathlib.Path = ROOT) -> list[str]:
    """Mutations whose code no longer occurs exactly once, and test files that no longer exist: what a
    refactor left behind (a mutation that edits nothing would pass for one its tests catch)."""
    stale = []
    for name, (edits, tests) in M.items():
        for path, old, _ in edits:
            count = (root / path).read_text().count(old)
            if count != 1:
                stale.append(f"{name}: {path} holds {old[:60]!r} {count} times")
        stale.extend(f"{name}: no test file {test}" for test in tests if not (root / test).exists())
    return stale


def main(which: list[str]) -> None:
    """Run each named mutation in a scratch copy of the tree (``src``, ``tests``, ``pyproject.toml``):
    the working tree is never edited, so nothing a mutation writes can be committed by accident."""
    env = dict(os.environ, PYTHONPATH="src", OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    for name in which:
        edits, tests = M[name]
        with tempfile.TemporaryDirectory(prefix=f"mutate-{name}-") as scratch:
            tree = pathlib.Path(scratch)
            for part in ("src", "tests"):
                shutil.copytree(ROOT / part, tree / part, ignore=shutil.ignore_patterns("__pycache__"))
            shutil.copy2(ROOT / "pyproject.toml", tree / "pyproject.toml")
            for path, old, new in edits:
                p = tree / path
                text = p.read_text()
                assert text.count(old) == 1, (name, path, old[:60], text.count(old))
                p.write_text(text.replace(old, new))
            out = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=no", "-rf", *tests],
                cwd=tree,
                env=env,
                capture_output=True,
                text=True,
            ).stdout
        failed = [line.split(" ", 1)[1].split(" - ")[0] for line in out.splitlines() if line.startswith("FAILED")]
        summary = out.strip().splitlines()[-1]
        print(f"## {name}: {summary}")
        for test in failed:
            print("   FAILED", test)
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:] or list(M))
