#!/usr/bin/env bash
# The trainer's GPU checks of issue #52 in one lease: about 8 minutes on one H100/H200.
#
#   bash bench/gpu_trainer.sh            # on the GPU machine, from the repository root
#
# 1. numerics (tests/unit/test_trainer_{devices,unpadded,fused}.py): the GPU tests run there
#    (200 tiny steps against the CPU's curve, unpadded FlashAttention against the padded
#    path, bf16 and fp16 train, GPU -> CPU -> GPU resume) beside the CPU ones;
# 2. bench_trainer.py, what the targets are read from: imgpipe and Hugging Face compiled,
#    phases 1 and 2, generated and real lengths, accumulation 1 and shipped (32 / 128),
#    and a kernel-share profile of each;
# 3. with the time left: Hugging Face eager and imgpipe's padded configuration (the
#    "before" of the elementwise change), phase 1.
#
# Everything lands in $OUT (bench/results/gpu-run without it) as it comes: env.txt,
# numerics.log, bench.log, trainer-gpu.json (rows), trainer-gpu-profile.json.  The machine
# needs torch, transformers, numpy, h5py, tokenizers, safetensors and pytest, nothing else:
# the trainer is read from images/bert/trainer through PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=${OUT:-bench/results/gpu-run}
mkdir -p "$out"
export PYTHONPATH="$PWD/images/bert/trainer:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
budget=${BUDGET_S:-470}  # seconds for the whole script
started=$(date +%s)
left() { echo $(( budget - ($(date +%s) - started) )); }

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
  "$py" -c 'import torch, transformers; print("torch", torch.__version__, "cuda",
torch.version.cuda, "transformers", transformers.__version__)'; } 2>&1 | tee "$out/env.txt"

# --noconftest: tests/conftest.py wants the imgpipe package, which these tests do not use
timeout 200 "$py" -m pytest --noconftest -p no:cacheprovider -q -rs \
  tests/unit/test_trainer_devices.py tests/unit/test_trainer_unpadded.py \
  tests/unit/test_trainer_fused.py 2>&1 | tee "$out/numerics.log"

bench() { grep --line-buffered -v '^USDT' | tee -a "$out/bench.log"; }
main=$(( $(left) - 40 ))
timeout "$main" "$py" bench/bench_trainer.py --impls hf-compiled,imgpipe --phases 1,2 \
  --steps 10 --shipped-steps 1 --warmup 3 --deadline $(( main - 150 )) \
  --out "$out/trainer-gpu.json" --profile "$out/trainer-gpu-profile.json" 2>&1 | bench

extra=$(left)
if [ "$extra" -gt 90 ]; then
  timeout "$extra" "$py" bench/bench_trainer.py --impls imgpipe-before,hf-eager --phases 1 \
    --accumulation 1 --steps 10 --warmup 3 --deadline $(( extra - 80 )) --append \
    --out "$out/trainer-gpu.json" --profile "$out/trainer-gpu-profile.json" 2>&1 | bench
fi
echo "gpu_trainer: $(( $(date +%s) - started )) s; results in $out"
