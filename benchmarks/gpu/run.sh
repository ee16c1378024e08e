#!/usr/bin/env bash
# One command for a lent GPU (H100/H200): installs jserve onto the machine's own JAX, then measures what the
# GPU work needs, stage by stage, within a time budget. Logs and JSON go under $OUT (default ./gpu-out); a
# summary (summary.md there) is printed last.
#
#   bash benchmarks/gpu/prepare.sh        # first, on a machine with the package index: what the call carries
#   bash benchmarks/gpu/run.sh            # on the GPU machine (carry .whl and .gpu-cache), ~8 minutes
#   bash benchmarks/gpu/run.sh --dry-run  # on a CPU: every stage at toy sizes (a random SmolLM2 shape)
#
# Stages, in this order, what is learnt only on a GPU first (one that cannot finish within the budget is
# skipped, and says so):
#   env       the machine: GPUs, driver, jax and its devices, pip check
#   profile   benchmarks/step_profile.py: where a decode step's device time goes, at batch 1 and 64
#   roofline  benchmarks/roofline.py: decode at batch 1/16/64/256 and prefill, against the memory roofline; decode 1
#             again on the step whose device decides its sampling stages (the conditionals' cost)
#   kernels   benchmarks/attention_kernels.py: decode 64 x 2048 and 512-token prefill chunks, GB/s, TFLOP/s
#   moe       benchmarks/grouped_matmul.py: a mixture of experts' projection (Qwen3-30B-A3B's: 128 experts,
#             top 8) at 1, 256 and 2048 tokens, the Pallas grouped matmul against XLA's ragged_dot; int8 too;
#             then a search of the kernel's launch settings (--tune)
#   tune      the same, searching the Triton kernel's launch settings (--tune); the best for this GPU go to
#             $OUT/tuned.json, an entry for pallas_kernels/gpu/tuned.json
#   serve     jserve serve and benchmarks/serve.py: token-id prompts, 1024 in / 128 out, concurrency 1, 64, 256
#   tests     tests/test_gpu_hardware.py: both Pallas GPU kernels compiled for the GPU against the reference
#             (decode, prefill, mixed batches; page sizes, head dims, GQA, windows, soft-capping, dtypes), and
#             the engine on the GPU against transformers
#   notebook  notebooks/colab_gpu_demo.ipynb top to bottom (its model: the default one, whose GGUF the call
#             must carry in two parts, see prepare.sh; without it the stage says so)
#   weights   benchmarks/weight_update.py on random weights of Llama-3.2-1B's shape (float32): new weights from
#             the engine's own arrays, host arrays and a folder, against a new LLM; sleep and wake
#   lora      benchmarks/lora.py on the 8B shape: output tok/s at concurrency 64 with 0, 1 and 4 rank-16
#             adapters (XLA's masked matmuls) against an engine without --enable-lora
# The model is random weights of Llama-3-8B's shape in bfloat16. profile, roofline and serve build the same
# engine (sequences, token budget, context, KV cache size), so they share compiled executables through jserve's
# compilation cache.
#
# Options: --dry-run; --budget SECONDS (default 480: the whole run, install included); --stages a,b,...
set -uo pipefail
cd "$(dirname "$0")/../.."

DRY_RUN=0
BUDGET=480
STAGES="env,profile,roofline,kernels,tune,serve,tests,moe,notebook,weights,lora"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --budget) BUDGET="$2"; shift ;;
    --stages) STAGES="$2"; shift ;;
    --stage-body) STAGE_BODY="$2"; shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
export OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
PYTHON="${PYTHON:-python3}"

if [ "$DRY_RUN" = 1 ]; then  # toy sizes on the CPU: every code path, in a few minutes
  MODEL="random:smollm2-135m" CONTEXT=64 MAX_LEN=256 SEQS=4 TOKENS=64 KV=$((256 << 20))
  DECODE_BATCHES="1 4" PROFILE_BATCHES="1 4" PREFILL_SEQS=4 CONCURRENCY="1 4" OUTPUT_LEN=16
  WEIGHTS_MODEL="random:smollm2-135m" LORA_CONCURRENCY=4 LORA_KV_BYTES=$((64 << 20))
  KERNEL_ARGS="--shape smollm2-135m --dtype float32 --seqs 4 --context 128 --chunk 32 --backends cpu reference"
  TUNE_ARGS="--shape smollm2-135m --dtype float32 --seqs 2 --context 64 --chunk 16 --backends reference --repeats 1"
  MOE_ARGS="--shape smollm2-135m-moe --dtype float32 --tokens 1 16 --repeats 2" MOE_BACKENDS="tiled ragged pallas gated"
else
  MODEL="random:llama3-8b" CONTEXT=1024 MAX_LEN=1280 SEQS=256 TOKENS=2048 KV=$((48 << 30))
  DECODE_BATCHES="1 16 64 256" PROFILE_BATCHES="1 64" PREFILL_SEQS=16 CONCURRENCY="1 64 256" OUTPUT_LEN=128
  WEIGHTS_MODEL="random:llama3.2-1b" LORA_CONCURRENCY=64 LORA_KV_BYTES=$((8 << 30))
  KERNEL_ARGS="--shape llama3-8b --seqs 64 --context 2048 --chunk 512 --backends pallas pallas-mosaic-gpu reference"
  TUNE_ARGS="--shape llama3-8b --seqs 64 --context 2048 --chunk 512 --backends pallas --repeats 10"
  MOE_ARGS="--shape qwen3-30b-a3b --tokens 1 256 2048 --repeats 20" MOE_BACKENDS="pallas gated ragged"
fi
ENGINE_ARGS="--max-model-len $MAX_LEN --kv-cache-memory $KV --max-num-batched-tokens $TOKENS"

# --- the stages' bodies (each runs in its own process, under `timeout`) ---------------------------------

stage_env() {
  date -u
  nvidia-smi -L 2>&1 || echo "no nvidia-smi"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1 || true
  "$PYTHON" -c "import sys, jax, jaxlib; print(sys.version); print('jax', jax.__version__, 'jaxlib', jaxlib.__version__); print(jax.devices())"
  "$PYTHON" -c "import jserve, flax, starlette, llguidance; print('jserve imports from', jserve.__file__)"
  "$PYTHON" -m pip check 2>&1 | tail -5 || true
}

stage_tests() {
  if [ "$DRY_RUN" = 1 ]; then  # no GPU here: the module must skip, saying why
    "$PYTHON" -m pytest tests/test_gpu_hardware.py -q -p no:cacheprovider
  else
    JAX_PLATFORMS=cuda,cpu "$PYTHON" -m pytest tests/test_gpu_hardware.py -q -p no:cacheprovider
  fi
}

stage_profile() {
  "$PYTHON" benchmarks/step_profile.py --model "$MODEL" --batch $PROFILE_BATCHES --context "$CONTEXT" --steps 8 \
    $ENGINE_ARGS --json "$OUT/profile.json"
}

stage_roofline() {
  "$PYTHON" benchmarks/roofline.py --model "$MODEL" --decode-batch $DECODE_BATCHES --context "$CONTEXT" \
    --prefill-seqs "$PREFILL_SEQS" --repeats 2 --conditionals-batch 1 $ENGINE_ARGS
}

stage_kernels() {
  "$PYTHON" benchmarks/attention_kernels.py $KERNEL_ARGS
}

stage_tune() {  # (the search stops itself 20 s before the stage's limit, keeping what it found)
  local seconds=$((DRY_RUN == 1 ? 15 : STAGE_LIMIT - 20))
  "$PYTHON" benchmarks/attention_kernels.py $TUNE_ARGS --tune "$seconds" --tuned-json "$OUT/tuned.json"
}

stage_moe() {
  "$PYTHON" -u benchmarks/grouped_matmul.py $MOE_ARGS --backends $MOE_BACKENDS --json "$OUT/moe.json" || return 1
  "$PYTHON" -u benchmarks/grouped_matmul.py $MOE_ARGS --backends ${MOE_BACKENDS/ragged/} --int8 --json "$OUT/moe-int8.json"
  local seconds=$((DRY_RUN == 1 ? 10 : STAGE_LIMIT - 45))  # (the search: what the two runs above leave)
  "$PYTHON" -u benchmarks/grouped_matmul.py $MOE_ARGS --backends pallas --tune "$seconds"
}

stage_serve() {
  local port=8123
  "$PYTHON" -m jserve serve "$MODEL" --port "$port" --max-num-seqs "$SEQS" $ENGINE_ARGS \
    > "$OUT/serve-server.log" 2>&1 &
  SERVER=$!
  trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
  for _ in $(seq 600); do
    "$PYTHON" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2)" \
      > /dev/null 2>&1 && break
    kill -0 "$SERVER" 2>/dev/null || { echo "jserve serve exited:"; tail -20 "$OUT/serve-server.log"; return 1; }
    sleep 0.5
  done
  for concurrency in $CONCURRENCY; do
    local prompts=$((concurrency == 1 ? 8 : concurrency))
    echo "== concurrency $concurrency, $prompts prompts of $CONTEXT tokens, $OUTPUT_LEN out"
    "$PYTHON" benchmarks/serve.py --base-url "http://127.0.0.1:$port" --num-prompts "$prompts" \
      --input-len "$CONTEXT" "$CONTEXT" --output-len "$OUTPUT_LEN" "$OUTPUT_LEN" --max-concurrency "$concurrency" \
      --json "$OUT/serve-c$concurrency.json" || return 1
  done
  grep -E "Engine ready|Attention|KV cache|stats" "$OUT/serve-server.log" | tail -8
}

stage_notebook() {
  if ! "$PYTHON" -c "import sys; from jserve.loader.default_model import DEFAULT_MODEL_NAME; from jserve.paths import cache_dir; sys.exit(not any(cache_dir().glob(DEFAULT_MODEL_NAME + '*.gguf')))"; then
    echo "skipped: the default model's GGUF is not in \$JSERVE_CACHE and the hub is out of reach (carry it: prepare.sh)"
    return 3
  fi
  "$PYTHON" benchmarks/gpu/run_notebook.py notebooks/colab_gpu_demo.ipynb
}

stage_weights() {
  "$PYTHON" benchmarks/weight_update.py --model "$WEIGHTS_MODEL" --repeats 1
}

stage_lora() {
  "$PYTHON" benchmarks/lora.py --model "$MODEL" --concurrency "$LORA_CONCURRENCY" --max-tokens 64 --repeats 1 \
    --kv-cache-memory "$LORA_KV_BYTES" --max-model-len "$MAX_LEN"
}

if [ -n "${STAGE_BODY:-}" ]; then
  "stage_$STAGE_BODY"
  exit $?
fi

# --- set-up ----------------------------------------------------------------------------------------------

START=$(date +%s)
DEADLINE=$((START + BUDGET))
rm -f "$OUT"/*.log "$OUT"/*.json "$OUT"/*.md  # (a local OUT may hold an earlier run's)
echo "stage	status	seconds" > "$OUT/stages.tsv"
if [ -d .whl ]; then  # jserve's dependencies the image lacks (prepare.sh)
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/install.log" 2>&1 || { echo "wheel install failed:"; cat "$OUT/install.log"; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ "$DRY_RUN" = 0 ]; then  # onto the JAX that is there, as docs/installing.md says
  "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e . >> "$OUT/install.log" 2>&1 \
    || { echo "jserve install failed:"; tail -20 "$OUT/install.log"; }
fi
if [ -d .gpu-cache ] && [ "$DRY_RUN" = 0 ]; then  # the default tokenizer, which random models borrow (prepare.sh)
  export JSERVE_CACHE="${JSERVE_CACHE:-/tmp/jserve-cache}"  # (a copy: the run writes kernels and executables there)
  mkdir -p "$JSERVE_CACHE" && cp -r .gpu-cache/. "$JSERVE_CACHE/"
fi
if [ -f .gpu-model-1/part ] && [ -f .gpu-model-2/part ] && [ "$DRY_RUN" = 0 ]; then  # the default model, in two calls
  gguf="${JSERVE_CACHE:-$HOME/.cache/jserve}/SmolLM2-135M-Instruct.Q4_1.gguf"
  mkdir -p "$(dirname "$gguf")"
  cat .gpu-model-1/part .gpu-model-2/part > "$gguf.tmp"
  if [ "$(sha256sum "$gguf.tmp" | cut -d' ' -f1)" = "$(cat .gpu-model-2/sha256)" ]; then
    mv "$gguf.tmp" "$gguf"
  else
    echo "the default model's two parts do not make its GGUF (sha256 differs): the notebook stage will skip"
    rm -f "$gguf.tmp"
  fi
fi
export JAX_COMPILATION_CACHE_INCLUDE_METADATA_IN_KEY=true  # (see step_profile.py)
export TQDM_DISABLE=1  # progress bars would fill the logs
echo "set-up $(( $(date +%s) - START )) s; budget ${BUDGET} s; stages $STAGES; out $OUT"

# --- the stages --------------------------------------------------------------------------------------------

# The longest each stage may take, seconds (at toy sizes they take far less). The first stage to build the 8B
# engine (profile) compiles its step buckets, for a GPU with autotuning, and fills the compilation cache the
# later ones read: its share is the largest. Once the budget is spent, the last stages are skipped.
declare -A LIMIT=([env]=30 [tests]=150 [profile]=240 [roofline]=130 [kernels]=45 [tune]=120 [serve]=150 [moe]=90
                  [notebook]=60 [weights]=90 [lora]=150)
declare -A MIN_SLOT=([env]=10 [tests]=60 [profile]=60 [roofline]=60 [kernels]=20 [tune]=50 [serve]=80 [moe]=50
                     [notebook]=30 [weights]=45 [lora]=90)
IFS=, read -ra ORDER <<< "$STAGES"
for name in "${ORDER[@]}"; do
  left=$((DEADLINE - $(date +%s)))
  limit=${LIMIT[$name]:-60}
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt "${MIN_SLOT[$name]:-10}" ]; then
    echo "== $name: skipped, ${left} s left of the budget"
    printf '%s\tskipped (budget)\t0\n' "$name" >> "$OUT/stages.tsv"
    continue
  fi
  echo "== $name (at most ${limit} s)"
  begun=$(date +%s)
  STAGE_LIMIT=$limit timeout --kill-after=10 "$limit" bash "$0" --stage-body "$name" \
    $([ "$DRY_RUN" = 1 ] && echo --dry-run) > "$OUT/$name.log" 2>&1
  status=$?
  took=$(( $(date +%s) - begun ))
  case $status in
    0) result=ok ;;
    3) result="skipped ($(tail -1 "$OUT/$name.log"))" ;;
    124|137) result="timed out" ;;
    *) result="failed ($status)" ;;
  esac
  printf '%s\t%s\t%s\n' "$name" "$result" "$took" >> "$OUT/stages.tsv"
  echo "   $result in ${took} s"
done

# --- the summary -------------------------------------------------------------------------------------------

"$PYTHON" benchmarks/gpu/summary.py "$OUT" > "$OUT/summary.md"
cat "$OUT/summary.md"
echo "total $(( $(date +%s) - START )) s"
