#!/usr/bin/env bash
# Run the bit-identity suite of a refactor: every registered method (and the usual compositions)
# through `kvfold eval` and a `kvfold fidelity` grid, on the source tree SRC, into OUT.
# Compare two runs with tools/same_records.py (timings left out). One thread, so the numbers are
# deterministic; about 7 minutes on one CPU core.
#   usage: tools/same_records.sh SRC OUT      e.g. git worktree add /tmp/base HEAD~1 &&
#          tools/same_records.sh /tmp/base/src /tmp/base-run && tools/same_records.sh src /tmp/new-run &&
#          .venv/bin/python tools/same_records.py /tmp/base-run /tmp/new-run
set -euo pipefail
SRC=$(cd "$1" && pwd); OUT=$2
PY=${PY:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}
export PYTHONPATH=$SRC OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
M="full,random,streamingllm,h2o,h2o_cosine,snapkv,pyramidkv,tova,knorm,kvzip,expected_attention,leverage,compactor"
M="$M,adakv:snapkv,criticalkv:snapkv,global:leverage,snapkv+keepkv,snapkv+grkv,snapkv+cam,snapkv+d2o_merge"
M="$M,snapkv+kvmerger,kvzip+am_fit,kvzip+keepkv,d2o,kvmerger_sets,zsmerge,zeromerge,am_highest_fast,am_highest"
M="$M,am_omp_fast,am_omp[chunks=2]"
"$PY" -m kvfold.cli eval --dataset ruler --length 1024 --samples 1 --tasks niah_single_2,niah_multikey_1,qa_1 \
  --methods "$M" --budgets 0.2 --seed 3 --out "$OUT/eval" --quiet
"$PY" -m kvfold.cli fidelity --dataset ruler --length 1024 --samples 1 --tasks niah_single_2,qa_1 \
  --methods "full,snapkv+keepkv,zsmerge,kvzip+am_fit,snapkv+grkv,h2o" --budgets 0.2 --out "$OUT/fid" --quiet
