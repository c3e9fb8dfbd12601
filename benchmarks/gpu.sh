#!/usr/bin/env bash
# One run on a GPU machine: the CUDA tests, then kvfold bench at Llama-3.1-8B's shape with
# random weights (bfloat16, batch 1) beside stock transformers, then profiles of a compressed decode and
# of kvzip+am_fit's compression. Sized for about 9.5 minutes on one H200 (every phase under its own timeout; a phase cut short keeps
# the records it finished, and running the script again on the same OUT measures only what is missing).
#
#   benchmarks/gpu.sh                                   # on the GPU machine, from the repository root
#   DEVICE=cpu TINY=1 LONG=512 SHORT=256 BUDGET=0 benchmarks/gpu.sh   # the same, end to end, on a CPU (tiny shape)
#
# Settings (environment): PYTHON (python3), DEVICE (cuda), SHAPE (benchmarks/shapes/llama-3.1-8b.json),
# TINY (0; 1 shrinks the shape's widths and depth), TOKENIZER (a directory whose tokenizer to copy;
# default: a word-level tokenizer of the bench's prose, offline), LONG (32768) and SHORT (8192) tokens,
# NEW_TOKENS (8, decode steps measured after 4 warm-up steps), OUT (docs/results/data/gpu-DATE),
# BUDGET (560: seconds for the whole run, each phase cut to what is left and later ones skipped; 0: no limit),
# PHASES ("env tests compiled batch long memory profile report"; "short", "groups", "scores", "fits" and "suite" are there too;
# they run in the order named, so a second call names the most wanted first) and each phase's
# seconds: T_TESTS (120), T_COMPILED (150), T_BATCH (110), T_LONG (110), T_SHORT (70), T_MEMORY (30),
# T_PROFILE (20, each decode profile), T_PROFILE_COMPRESS (40), T_GROUPS (90: both groupings of the fits),
# T_SCORES (60: KVzip's scores for one layer and forward, the Triton kernel against float32 products, over a chunk's
# 2,048 entries (scope=chunk, the default from 4K) and over SHORT and LONG (scope=all), with each of SCORES_BLOCKS
# (keys x rows a program: 128x64,64x64,128x128,64x128, every one compiled without spills by tools/triton_targets.py's
# launch for sm_90)),
# T_FITS (60: one layer's Attention Matching fits of a chunk and of 32K tokens' 16 chunks, 16-bit queries and keys with
# float32 sums against float32 products),
# T_SUITE (300: the main suite, SUITE_TESTS ("tests --ignore=tests/integrations/vllm"), in SUITE_WORKERS (8) processes
# where pytest-xdist is there (the cores shared among them: OMP_NUM_THREADS), installed or its wheels in WHEELS (.wheels, `make gpu-wheels`; the device tool's run
# carries the folder) unpacked onto PYTHONPATH, since the GPU machine has no network).
# Records: OUT/env.txt, OUT/test_cuda.txt, OUT/bench-compiled|batch|long|short|memory/{records.jsonl,bench.json,bench.md},
# OUT/profile-kvzip.txt, OUT/profile-compress.txt, OUT/groups.txt, OUT/scores.txt and scores.jsonl, OUT/fits.txt and
# fits.jsonl, OUT/suite.txt, OUT/README.md (every bench's table); docs/benchmarks.md, "One run on a GPU".
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
SHAPE=${SHAPE:-benchmarks/shapes/llama-3.1-8b.json}
TINY=${TINY:-0}
TOKENIZER=${TOKENIZER:-}
LONG=${LONG:-32768}
SHORT=${SHORT:-8192}
NEW_TOKENS=${NEW_TOKENS:-8}
OUT=${OUT:-docs/results/data/gpu-$(date +%F)}
PHASES=${PHASES:-env tests compiled batch long memory profile report}
BUDGET=${BUDGET:-560}  # seconds for the whole script (0: none): the device's 600 s a call, less the shape's build
RESERVE=20             # seconds BUDGET keeps for the report and a phase's kill
KNOWN="env tests compiled batch long short memory profile suite groups scores fits report"
for name in $PHASES; do
  case " $KNOWN " in *" $name "*) ;; *) echo "gpu.sh: no phase '$name' in PHASES; the phases are: $KNOWN" >&2; exit 2 ;; esac
done
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

mkdir -p "$OUT"
MODEL_DIR="$OUT/shape"
started=$(date +%s)
say() { echo "[gpu.sh $(( $(date +%s) - started ))s] $*" | tee -a "$OUT/log.txt"; }
phase() {  # phase NAME SECONDS COMMAND...: run COMMAND under a timeout (its process group killed after), cut to
  # what BUDGET leaves (the report's RESERVE kept)
  local name=$1 seconds=$2
  shift 2
  if [ "$BUDGET" -gt 0 ]; then
    local left=$(( started + BUDGET - RESERVE - $(date +%s) ))
    [ "$left" -le 5 ] && { say "$name: skipped, BUDGET=${BUDGET}s is spent"; return 0; }
    [ "$left" -lt "$seconds" ] && { say "$name: ${seconds}s cut to the ${left}s BUDGET leaves"; seconds=$left; }
  fi
  say "$name: up to ${seconds}s: $*"
  timeout --kill-after=10 "$seconds" "$@"
  local rc=$?
  [ "$rc" = 124 ] && say "$name: cut at ${seconds}s (what finished is kept)" || say "$name: exit $rc"
  return 0
}
bench=("$PYTHON" -m kvfold.cli.main bench --model "random:$MODEL_DIR" --device "$DEVICE" --batch 1
  --new-tokens "$NEW_TOKENS" --quiet)

shape_args=("$SHAPE" "$MODEL_DIR")
[ "$TINY" = 1 ] && shape_args+=(--tiny)
[ -n "$TOKENIZER" ] && shape_args+=(--tokenizer "$TOKENIZER")
"$PYTHON" benchmarks/shape_dir.py "${shape_args[@]}" | tee -a "$OUT/log.txt"

run_env() {
  {
    date -u +%FT%TZ
    git rev-parse HEAD 2>/dev/null || echo "no git"
    "$PYTHON" -c "import sys, torch, transformers; print('python', sys.version.split()[0]); \
print('torch', torch.__version__, 'transformers', transformers.__version__); \
print('device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
    "$PYTHON" -c "import triton; print('triton', triton.__version__)" 2>/dev/null || echo "triton: not installed"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  } > "$OUT/env.txt" 2>&1
  cat "$OUT/env.txt"
}

run_tests() {
  phase tests "${T_TESTS:-120}" bash -c "'$PYTHON' -m pytest -q -rf -p no:cacheprovider tests/runtime/test_cuda.py \
    > '$OUT/test_cuda.txt' 2>&1"
  tail -n 15 "$OUT/test_cuda.txt"
}

sweep() {  # sweep NAME SECONDS OUT_DIR METHODS BENCH_ARGS...: one bench a method into OUT_DIR, under one
  # deadline (full is measured once and reused; a method that fails or is cut costs only itself)
  local name=$1 seconds=$2 dir=$3 methods=$4 deadline=$(( $(date +%s) + $2 ))
  shift 4
  for method in ${methods//,/ }; do
    local left=$(( deadline - $(date +%s) ))
    [ "$left" -le 5 ] && { say "$name: no time left for $method"; continue; }
    phase "$name $method" "$left" "${bench[@]}" --out "$dir" --methods "$method" "$@"
  done
}

# The compiled decode at the long context first (kvfold's steps through torch.compile and CUDA graphs over
# fixed tails, full beside each method, also compiled): the decode targets are its numbers. kvzip+am_fit first
# (with full beside it), then stock's compiled static cache (the bar for full), kvzip last: on a CPU each
# compilation took a minute or more, and the last method was cut.
run_compiled() { sweep compiled "${T_COMPILED:-150}" "$OUT/bench-compiled" kvzip+am_fit,stock-static,kvzip \
  --length "$LONG" --budgets 0.1 --compiled; }
# Batch 8 at the long context, compiled: the compressed cache's gain grows with the batch (the cache's bytes
# outgrow the weights').
run_batch() { sweep batch "${T_BATCH:-110}" "$OUT/bench-batch" kvzip+am_fit --length "$LONG" --budgets 0.1 \
  --batch 8 --compiled; }
# Then the eager decode at the long context: the targets are at 32K (stock's compiled static cache is the bar for full;
# kvzip+am_fit last, its compression the slowest).
run_long() { sweep long "${T_LONG:-110}" "$OUT/bench-long" stock,kvzip,kvzip+am_fit --length "$LONG" --budgets 0.1; }
run_short() { sweep short "${T_SHORT:-70}" "$OUT/bench-short" stock,kvzip,kvzip+am_fit --length "$SHORT" --budgets 0.1; }
run_memory() { sweep memory "${T_MEMORY:-30}" "$OUT/bench-memory" kvzip+am_fit --length "$SHORT" --memory 0.0625; }

run_profile() {  # a few decode steps of kvzip's cache, by host and by device time (PROFILE_DECODE="full kvzip" for both)
  for method in ${PROFILE_DECODE:-kvzip}; do
    phase "profile $method" "${T_PROFILE:-20}" bash -c "'$PYTHON' benchmarks/profile_decode.py \
      --model 'random:$MODEL_DIR' --device '$DEVICE' --length '$SHORT' --method $method --budget 0.1 --steps 3 \
      --top 30 > '$OUT/profile-$method.txt' 2>&1"
    grep -E "host synchronisations|ms a step" "$OUT/profile-$method.txt"
  done
  # kvzip+am_fit's compression at the short context: the functions (cProfile) and operators by host and device time
  phase "profile compression" "${T_PROFILE_COMPRESS:-40}" bash -c "'$PYTHON' benchmarks/profile_compress.py \
    --model 'random:$MODEL_DIR' --device '$DEVICE' --length '$SHORT' --method kvzip+am_fit --budget 0.1 --ops \
    --top 30 > '$OUT/profile-compress.txt' 2>&1"
  grep -E "prefills" "$OUT/profile-compress.txt"
}

run_suite() {  # the whole main suite with the GPU present (its Triton tests compile the kernel for real)
  local wheels=${WHEELS:-.wheels} workers=()
  if ! "$PYTHON" -c "import xdist" 2>/dev/null && compgen -G "$wheels/*.whl" >/dev/null; then
    local site
    site=$(mktemp -d)  # pure-Python wheels are zip files: unpacked, they are installed (outside OUT, which comes back)
    for wheel in "$wheels"/*.whl; do "$PYTHON" -m zipfile -e "$wheel" "$site"; done
    export PYTHONPATH="$site:$PYTHONPATH"
    say "suite: pytest-xdist from the wheels in $wheels"
  fi
  local threads=${OMP_NUM_THREADS:-}  # with processes, the cores shared among them (as make test gives each one)
  if "$PYTHON" -c "import xdist" 2>/dev/null; then
    workers=(-n "${SUITE_WORKERS:-8}" --dist loadfile)
    threads=$(( $(nproc) / ${SUITE_WORKERS:-8} > 1 ? $(nproc) / ${SUITE_WORKERS:-8} : 1 ))
  fi
  phase suite "${T_SUITE:-300}" env ${threads:+OMP_NUM_THREADS=$threads} OMP_WAIT_POLICY=PASSIVE bash -c "'$PYTHON' \
    -m pytest -q -rfE -p no:cacheprovider ${workers[*]} ${SUITE_TESTS:-tests --ignore=tests/integrations/vllm} \
    > '$OUT/suite.txt' 2>&1"
  tail -n 15 "$OUT/suite.txt"
}

run_groups() {  # kvzip+am_fit's compression at the short context with the CPU's groups of fits and the
  # accelerator's padded ones, timed without a profiler: does the padding's work cost less than the launches it saves?
  for products in 0 default; do
    padding=(); [ "$products" = default ] || padding=(--pad-products "$products")
    phase "groups $products" "$(( ${T_GROUPS:-90} / 2 ))" bash -c "'$PYTHON' benchmarks/profile_compress.py \
      --model 'random:$MODEL_DIR' --device '$DEVICE' --length '$SHORT' --method kvzip+am_fit --budget 0.1 --plain \
      ${padding[*]} 2>&1 | grep -E 'prefills|Error' >> '$OUT/groups.txt'"
  done
  cat "$OUT/groups.txt" 2>/dev/null
}

run_scores() {  # KVzip's scores for one repeat forward of the shape, both paths in one process: over
  # a chunk's span (scope=chunk, the default from 4K tokens) and over the whole cache (scope=all)
  read -r kv_heads heads head_dim < <("$PYTHON" -c "import json; c = json.load(open('$MODEL_DIR/config.json')); \
print(c['num_key_value_heads'], c['num_attention_heads'], c.get('head_dim') or c['hidden_size'] // c['num_attention_heads'])")
  phase scores "${T_SCORES:-60}" bash -c "'$PYTHON' benchmarks/key_scores.py --device '$DEVICE' \
    --entries '2048,$SHORT,$LONG' --kv-heads $kv_heads --group $(( heads / kv_heads )) --head-dim $head_dim \
    --blocks '${SCORES_BLOCKS:-128x64,64x64,128x128,64x128}' ${SCORES_ARGS:-} --out '$OUT/scores.jsonl' > '$OUT/scores.txt' 2>&1"
  cat "$OUT/scores.txt" 2>/dev/null
}

run_fits() {  # one layer's fits with the kept keys given (kvzip+am_fit), both products in one process:
  # a chunk's problems (a layer's KV heads) and the 16 chunks' of 32K tokens
  read -r kv_heads heads head_dim < <("$PYTHON" -c "import json; c = json.load(open('$MODEL_DIR/config.json')); \
print(c['num_key_value_heads'], c['num_attention_heads'], c.get('head_dim') or c['hidden_size'] // c['num_attention_heads'])")
  chunk=$(( SHORT < 2048 ? SHORT : 2048 ))
  phase fits "${T_FITS:-60}" bash -c "'$PYTHON' benchmarks/fit_products.py --device '$DEVICE' \
    --problems '$kv_heads,$(( kv_heads * (LONG + chunk - 1) / chunk ))' --entries $chunk \
    --queries $(( heads / kv_heads * chunk )) --kept $(( chunk / 10 )) --head-dim $head_dim ${FITS_ARGS:-} \
    --out '$OUT/fits.jsonl' > '$OUT/fits.txt' 2>&1"
  cat "$OUT/fits.txt" 2>/dev/null
}

run_report() {
  {
    echo "# GPU run $(date -u +%F): $(basename "$SHAPE")$([ "$TINY" = 1 ] && echo ' (tiny)') on $DEVICE"
    echo
    echo '```'
    cat "$OUT/env.txt" 2>/dev/null
    echo '```'
    echo
    echo "CUDA tests: $(tail -n 1 "$OUT/test_cuda.txt" 2>/dev/null)"
    [ -s "$OUT/suite.txt" ] && { echo; echo "The whole main suite: $(tail -n 1 "$OUT/suite.txt")"; }
    echo
    [ -s "$OUT/groups.txt" ] && { echo "Groups of fits (profile_compress.py --plain):"; echo; sed 's/^/    /' "$OUT/groups.txt"; echo; }
    [ -s "$OUT/scores.txt" ] && { echo "KVzip's scores, one layer and forward (key_scores.py):"; echo; sed 's/^/    /' "$OUT/scores.txt"; echo; }
    [ -s "$OUT/fits.txt" ] && { echo "Attention Matching's fits, one layer (fit_products.py):"; echo; sed 's/^/    /' "$OUT/fits.txt"; echo; }
    "$PYTHON" benchmarks/bench_table.py "$OUT"/bench-* | sed 's/^# kvfold bench/## kvfold bench/'
  } > "$OUT/README.md"
  say "wrote $OUT/README.md"
}

for name in $PHASES; do  # in the order PHASES names them (a second call's phases in the order of their worth)
  "run_$name"
done
say "done"
