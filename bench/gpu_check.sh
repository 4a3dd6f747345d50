#!/usr/bin/env bash
# Every check that needs a CUDA GPU, in one command, sized for one loan (ends within 8 minutes: the figures are
# bounded to 5.5 minutes, the tests to 2.5):
#   bash bench/gpu_check.sh [--wheels DIR] OUT     on a machine with one NVIDIA GPU and a CUDA build of torch >= 2.11
#   bash bench/gpu_check.sh --smoke OUT            the same script on the CPU with the tiny preset (CI, < 2 minutes)
# 1. `python -m bench gpu OUT` (bench/gpu.py): the released refiner from its config with random weights in bf16 on
#    the GPU; start-up, steady block latency at 480p/720p for 1/2/4 sessions batched and one at a time (CUDA events),
#    sessions in the memory budget, real-time sessions at 16 fps, bf16 vs fp32 parity, streaming VAE decode frames/s,
#    park/page-in ms, the attention kernel; last, the engine's step eager vs compiled vs graphed (CUDA graphs) at
#    480p for 1 and 4 sessions, with compile times and the recommended compile_step/compile_mode (it starts no mode
#    it cannot end by --end-s). Writes OUT/summary.json (each figure named with its unit) and OUT/summary.md; a
#    broken section is recorded there and the rest runs.
# 2. the -m gpu tests (tests/gpu: bf16 parity with diffusers' reference, batched vs solo rows, no host sync inside a
#    block, KV memory allocated once, the compiled step with CUDA graphs, a late NaN/Inf verdict undone by the
#    engine), output in OUT/gpu-tests.txt.
# No network on the GPU machine: --wheels DIR installs the other dependencies from a folder filled elsewhere by
# `bash bench/gpu_wheels.sh DIR` (pip --no-index). The project itself is not pip-installed: it runs from this
# checkout (PYTHONPATH), because pyproject pins torch==2.13.0 (the CPU build) and Python 3.11, and installing it
# would try to replace the machine's CUDA torch.
set -uo pipefail
cd "$(dirname "$0")/.."
smoke=0 wheels=""
while (($#)); do
  case "$1" in
    --smoke) smoke=1; shift ;;
    --wheels) wheels="$2"; shift 2 ;;
    -*) echo "unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
out="${1:-${OUT:-gpu-check}}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0

if [ -n "$wheels" ]; then
  python -m pip install -q --no-index --find-links "$wheels" -r "$wheels/requirements.txt" 2>&1 | tee "$out/install.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || { echo "== installing from $wheels failed (see $out/install.txt)"; exit 1; }
fi

if ((smoke)); then
  python -m bench gpu --smoke "$out" > "$out/bench.txt" 2>&1 || status=1
  tail -n 5 "$out/bench.txt"
  exit $status
fi

python - <<'PY' 2>&1 | tee "$out/machine.txt"
import torch, diffusers
print("torch", torch.__version__, "diffusers", diffusers.__version__, "cuda", torch.version.cuda)
assert torch.cuda.is_available(), "no CUDA device (use --smoke for the CPU check)"
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
assert (major, minor) >= (2, 11), f"torch {torch.__version__}: the GPU check needs >= 2.11"
print(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory // 2**30, "GiB")
PY
[ "${PIPESTATUS[0]}" = 0 ] || exit 1

echo "== bench gpu"
# Bounded so that the tests still run within the loan: summary.json is written after every section, so a run
# stopped here keeps what it measured; the block latencies left after --budget-s are skipped (null), and the step
# modes (last, about 100 s: two compiles) start no mode with under 45 s left before --end-s.
timeout 330 python -m bench gpu --budget-s 200 --end-s 320 "$out" 2>&1 | tee "$out/bench.txt"
[ "${PIPESTATUS[0]}" = 0 ] || { status=1; echo "== bench gpu: some sections failed (errors in $out/summary.json)"; }
echo "== gpu tests"
timeout 150 python -m pytest -q -m gpu -s -p no:cacheprovider tests/gpu 2>&1 | tee "$out/gpu-tests.txt"
[ "${PIPESTATUS[0]}" = 0 ] || { status=1; echo "== gpu tests FAILED"; }
exit $status
