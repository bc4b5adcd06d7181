#!/usr/bin/env bash
# The trainer's GPU checks (issues #52, #62) for one short lease: 6 minutes on one H100/H200
# with no internet, 2 to spare of an 8-minute lease.
#
#   bash bench/gpu_trainer.sh                                  # on the GPU machine, repo root
#   TINY=1 DEVICE=cpu COMPILE=1 BUDGET_S=3000 bash bench/gpu_trainer.sh   # a tiny BERT, CPU
#
# Stages in order of worth, each under its own `timeout` (min(its cap, the time left)); a
# stage skipped or cut short costs its own rows only, since bench_trainer.py writes each
# row the moment it is measured and, stopped by the timeout, a `stopped` row saying what
# was under way (a compile, usually):
# 0. env.txt; torchao from build/wheels (pip install --no-index into build/pyextra) when
#    the wheel is there and torchao is not;
# 1. numerics (NUMERICS_S): the GPU tests of tests/unit/test_trainer_{devices,unpadded,fp8}.py
#    (200 tiny steps against the CPU's curve, unpadded FlashAttention against the padded
#    path, bf16 and fp16 train, GPU -> CPU -> GPU resume, float8 trains like bf16);
# 2. phase 1 (PHASE1_S): imgpipe, then Hugging Face compiled, generated lengths, each
#    warmed up (compiled) once: accumulation 1 and a profile of each, then the shipped
#    accumulation (32) of each with the compiled steps kept (no second compile);
# 3. phase 2 (PHASE2_S): the same with real lengths (shipped: 128);
# 4. imgpipe-fp8 (FP8_S): --fp8, phase 1, generated lengths, accumulation 1.
# Compiling is most of each stage (BERT-Large's forward and backward, the fused LAMB step
# over its 302 tensors); inductor's cache (/tmp/torchinductor_$USER) carries what it can
# from one stage to the next, and the unpadded token count is compiled as a dynamic size,
# so the batches' different counts do not recompile (rows: graphs_compiled,
# recompiles_timed, warmup_s).
#
# Everything lands in $OUT (bench/results/gpu-run without it) as it comes: env.txt,
# numerics.log, bench.log, trainer-gpu.json (rows), trainer-gpu-profile.json, stages.tsv
# (stage, exit status, seconds, limit) and summary.txt (one line per row).  The machine
# needs torch, transformers, numpy, h5py, tokenizers, safetensors and pytest; the trainer
# is read from images/bert/trainer through PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=${OUT:-bench/results/gpu-run}
mkdir -p "$out"
export PYTHONPATH="$PWD/images/bert/trainer:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
budget=${BUDGET_S:-360}  # seconds for the whole script, every stage's kill grace included
grace=10                 # seconds between a stage's SIGTERM and its SIGKILL
started=$(date +%s)
left() { echo $(( budget - ($(date +%s) - started) )); }

# The bench's arguments for this machine: TINY=1 a tiny BERT, DEVICE=cpu|cuda, COMPILE=1|0.
common=(--append --out "$out/trainer-gpu.json")
[ "${TINY:-0}" = 1 ] && common+=(--tiny --steps 2 --shipped-steps 1 --warmup 1)
[ -n "${DEVICE:-}" ] && common+=(--device "$DEVICE")
case "${COMPILE:-}" in 1) common+=(--compile) ;; 0) common+=(--no-compile) ;; esac

# stage NAME CAP LEAST LOG COMMAND...: COMMAND under `timeout` for min(CAP, time left),
# skipped when that is under LEAST seconds; its output to the terminal and LOG.
stage() {
  local name=$1 cap=$2 least=$3 log=$4 limit t0 rc
  shift 4
  limit=$(( $(left) - grace ))
  [ "$cap" -lt "$limit" ] && limit=$cap
  if [ "$limit" -lt "$least" ]; then
    echo "gpu_trainer: $name skipped: $(left) s left" | tee -a "$log"
    printf '%s\tskipped\t0\t%s\n' "$name" "$limit" >>"$out/stages.tsv"
    return
  fi
  echo "gpu_trainer: $name, at most $limit s" | tee -a "$log"
  t0=$(date +%s)
  timeout -k "$grace" "$limit" "$@" 2>&1 | grep --line-buffered -v '^USDT' | tee -a "$log"
  rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$limit" >>"$out/stages.tsv"
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && echo "gpu_trainer: $name stopped at its limit" \
    | tee -a "$log"
}

# bench NAME CAP LEAST ARGS...: one bench_trainer.py run, its rows added to the JSON;
# --deadline keeps it from starting a measurement in its last 20 s.
bench() {
  local name=$1 cap=$2 least=$3 limit
  shift 3
  limit=$(( $(left) - grace ))
  [ "$cap" -lt "$limit" ] && limit=$cap
  stage "$name" "$cap" "$least" "$out/bench.log" "$py" bench/bench_trainer.py "${common[@]}" \
    --deadline $(( limit > 40 ? limit - 20 : limit / 2 )) "$@"
}

printf 'stage\texit\tseconds\tlimit\n' >"$out/stages.tsv"
for old in trainer-gpu trainer-gpu-profile; do  # the stages append: begin without a last run's
  [ -f "$out/$old.json" ] && mv "$out/$old.json" "$out/$old.prev.json"
done
rm -f "$out/bench.log" "$out/numerics.log"
wheels=("${WHEELS:-build/wheels}"/torchao-*.whl)
if [ -f "${wheels[-1]}" ] && ! "$py" -c 'import torchao' 2>/dev/null; then
  # into a folder of the checkout, not the machine's site-packages (which may be read-only
  # or externally managed); no index: the machine has no internet
  timeout 120 "$py" -m pip install --no-index --no-deps --quiet --target build/pyextra \
    "${wheels[-1]}" 2>&1 | tee "$out/env.txt"
fi
[ -d build/pyextra ] && export PYTHONPATH="$PYTHONPATH:$PWD/build/pyextra"
{ timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,compute_cap \
    --format=csv 2>&1 || echo "no nvidia-smi"
  "$py" - <<'EOF'
import importlib.util, torch
names = ("transformers", "torchao")
found = {n: getattr(importlib.util.find_spec(n) and importlib.import_module(n),
                    "__version__", None) for n in names}
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", gpu, "capability", cap,
      *(f"{n} {v}" for n, v in found.items()))
EOF
} 2>&1 | grep -v '^W[0-9]* .*register_constant' | tee -a "$out/env.txt"

# --noconftest: tests/conftest.py wants the imgpipe package, which these tests do not use;
# -k gpu: the GPU tests alone (the CPU ones run in CI); -v: a line per test as it ends
stage numerics "${NUMERICS_S:-90}" 30 "$out/numerics.log" \
  "$py" -m pytest --noconftest -p no:cacheprovider -v -rs -k gpu \
  tests/unit/test_trainer_devices.py tests/unit/test_trainer_unpadded.py \
  tests/unit/test_trainer_fp8.py

profile=(--profile "$out/trainer-gpu-profile.json")
bench phase1 "${PHASE1_S:-130}" 60 --impls imgpipe,hf-compiled --phases 1 \
  --lengths generated --accumulation 1,shipped "${profile[@]}"
bench phase2 "${PHASE2_S:-110}" 60 --impls imgpipe,hf-compiled --phases 2 \
  --lengths real --accumulation 1,shipped "${profile[@]}"
bench fp8 "${FP8_S:-120}" 45 --impls imgpipe-fp8 --phases 1 --lengths generated \
  --accumulation 1

"$py" - "$out/trainer-gpu.json" <<'EOF' | tee "$out/summary.txt"
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
except (OSError, ValueError) as exc:
    sys.exit(f"no rows: {exc}")
for r in rows:
    where = f"phase {r['phase']} {r.get('name', r['impl']):<14} {r.get('lengths', '-'):<9} " \
            f"acc {r.get('accumulation', '-')!s:<4}"
    if "error" in r:
        print(f"{where} ERROR {r['error'][:150]}")
    else:
        print(f"{where} {r['sequences_per_s']:>9.1f} seq/s  ratio {r['ratio_to_hf_compiled']}"
              f"  warm-up {r.get('warmup_s')} s  graphs {r.get('graphs_compiled')}"
              f"  recompiles while timed {r.get('recompiles_timed')}")
print(f"{len(rows)} rows, {sum('error' in r for r in rows)} with an error")
EOF
echo "gpu_trainer: $(( $(date +%s) - started )) s of $budget; results in $out"
