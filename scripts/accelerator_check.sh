#!/usr/bin/env bash
# The device checks of the fused-attention and planner issues for a lent accelerator machine,
# in two parts that each fit one device call (at most 600 s; device time is scarce: output
# goes under $OUT as it goes). From the project root:
#
#   bash scripts/accelerator_check.sh bench      # the benchmark table and issue 29's targets
#   bash scripts/accelerator_check.sh rest       # the accelerator smoke tests, plan --measure
#   ACCELERATOR_CHECK_QUICK=1 bash scripts/accelerator_check.sh all   # a dry run on CPU
#
# 'bench' first: it is what the issues are judged on. Wheels the machine lacks (dm-haiku,
# grain, ...) are taken from .whl/ when present (see the device README: they are downloaded
# beforehand; the machine reaches no registry).
set -uo pipefail
OUT=${OUT:-/tmp/accelerator_check}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
quick=${ACCELERATOR_CHECK_QUICK:-0}

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date +%T), limit ${limit}s): $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "   exit $? ; tail:"; tail -n 15 "$OUT/$name.log" | sed 's/^/   /'
}

part=${1:-all}
case "$part" in bench|rest|all) ;; *) echo "usage: $0 bench|rest|all" >&2; exit 2;; esac
if [ "$quick" = 1 ]; then accel_env=(env ACCELERATOR_STANDIN=cpu); else accel_env=(env); fi
pytest_accel=(python3 -m pytest -q -n 0 -m accelerator -p no:cacheprovider)

step devices 60 python3 -c "import jax; print(jax.__version__, jax.devices())"
if [ "$part" != rest ]; then
  # The accelerator table (ours vs an independent fused-attention reference, k=4 overhead,
  # 8k/32k tokens), sized to the device: under 5 minutes on a GPU. Then issue 29's targets,
  # judged on that same JSON (not a second run).
  step benchmark 420 python3 -m benchmarks.accelerator --out "$OUT/results_accelerator.json"
  step targets 60 "${accel_env[@]}" ACCELERATOR_RESULTS="$OUT/results_accelerator.json" \
    "${pytest_accel[@]}" tests/accelerator/test_accelerator_targets.py
fi
if [ "$part" != bench ]; then
  # The suite's other accelerator tests (self-check, the default job, a preset against the CPU).
  step accelerator_tests 280 "${accel_env[@]}" "${pytest_accel[@]}" tests/accelerator \
    --deselect tests/accelerator/test_accelerator_targets.py
  # The planner's prediction next to a measured step for the model of the issues (1.07 B).
  model=(seq_len=2048 model.vocab_size=32768 model.embed_dim=2048 model.mlp_dim=8192
         model.num_heads=16 model.num_kv_heads=8 model.head_dim=128 model.num_layers=16
         model.max_len=2048 model.dtype=bfloat16 model.scan_layers=true)
  if [ "$quick" = 1 ]; then model=(); fi
  step plan_measure 240 python3 -m recipes.plan --devices 1 --chip h200 --preset data_parallel \
    --remat none --compile 0 --measure 2 --measure-steps 5 --no-plot --out "$OUT/plan" "${model[@]}"
fi
echo "== done: $OUT"
