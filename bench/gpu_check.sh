#!/usr/bin/env bash
# Every check that needs a CUDA GPU, in one command, for a machine that has one:
#   bash bench/gpu_check.sh [OUTPUT_DIR]
# 1. the -m gpu tests (bf16 parity with diffusers' reference, batched vs solo rows, no host sync inside a
#    block, KV memory allocated once, the compiled step with CUDA graphs);
# 2. the benchmarks on the GPU in bf16: the cached step vs recomputing the window at 720p latents (40x22),
#    many sessions at once (batching on vs off, then with compile_step), and the window-attention strategies.
# Reports go to OUTPUT_DIR (default $OUT when set, else gpu-check/); record them in docs/benchmarks.md.
# Expects the project installed (pip install -e '.[test]') with a CUDA build of torch.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-check}}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
status=0
# step NAME COMMAND...: run it, its output shown and kept in $out/NAME.txt; a failure is remembered, the rest runs.
step() {
  local name="$1"; shift
  echo "== $name: $*"
  if ! "$@" 2>&1 | tee "$out/$name.txt"; then status=1; echo "== $name FAILED"; fi
}

python - <<'PY' 2>&1 | tee "$out/machine.txt"
import torch, diffusers
print("torch", torch.__version__, "diffusers", diffusers.__version__, "cuda", torch.version.cuda)
assert torch.cuda.is_available(), "no CUDA device"
print(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory // 2**30, "GiB")
PY
[ "${PIPESTATUS[0]}" = 0 ] || exit 1

step gpu-tests python -m pytest -q -m gpu -s tests/gpu
step cache-720p python -m bench cache --preset medium --device cuda --dtype bfloat16 --height 22 --width 40 \
    --blocks 6 --service
step load-720p python -m bench load --preset medium --device cuda --dtype bfloat16 --height 22 --width 40 --rounds 2
step load-720p-compiled python -m bench load --preset medium --device cuda --dtype bfloat16 --height 22 --width 40 \
    --rounds 2 --no-compare --compile
step attention-720p python -m bench attention --device cuda --tokens-per-frame 880
exit $status
