#!/usr/bin/env bash
# Every check that needs a CUDA GPU, in one command, sized for one loan (the first run on an H200, 4 December 2026:
# the install seconds, the figures 157 s in two processes, the tests 53 s; the served check, added after it, up to
# 300 s). Each step is bounded by its own time and by the script's deadline (--deadline-s, default 560 s from its
# start, inside the loan's 570): a step gets what is left when that is less than its own time, and one with under
# 10 s left is skipped and named, so the files come back whatever each step takes (the steps' own bounds add up to
# about 15 minutes).
#   bash bench/gpu_check.sh [--wheels DIR] OUT     on a machine with one NVIDIA GPU and a CUDA build of torch >= 2.11
#   bash bench/gpu_check.sh --smoke OUT            the same script on the CPU with the tiny preset (CI, < 2 minutes)
#   bash bench/gpu_check.sh --install-only [--wheels DIR] OUT   the install and import check alone (seconds)
#   --steps bench,tests,serve (the default: all three) runs only the steps named, e.g. --steps tests,serve to check
#   a fix in a second loan without measuring the figures again.
# 1. `python -m bench gpu OUT` (bench/gpu.py): the released refiner from its config with random weights in bf16 on
#    the GPU; start-up, steady block latency at 480p/720p for 1/2/4 sessions batched and one at a time (CUDA events),
#    sessions in the memory budget, real-time sessions at 16 fps, bf16 vs fp32 parity, streaming VAE decode frames/s,
#    park/page-in ms, the attention kernel; last, the engine's step eager vs compiled vs graphed (CUDA graphs) at
#    480p for 1 and 4 sessions, with compile times and the recommended compile_step/compile_mode (it starts no mode
#    it cannot end by --end-s), in a second process with its own time (--only step_modes): a compiler crash or a
#    long compile there costs none of the first process's figures, nor they its time. Writes OUT/summary.json (each
#    figure named with its unit; the second process adds to it) and OUT/summary.md; a broken section is recorded
#    there and the rest runs.
# 2. the -m gpu tests (tests/gpu: bf16 parity with diffusers' reference, batched vs solo rows, no host sync inside a
#    block, KV memory allocated once, a crash checkpoint's copies queued without a host wait, the compiled step with
#    CUDA graphs, a late NaN/Inf verdict undone by the engine), output in OUT/gpu-tests.txt (dynamo's DEBUG records
#    left out: the first run's file was 194 KB of them).
# 3. `python -m bench gpu-serve OUT` (bench/gpu_serve.py): the service as an operator starts it, from a released-size
#    checkpoint written to disk (26 GB): spawn to /ready, examples/quickstart.py, a 720p stream over HTTP, /metrics,
#    the drain; then a second server with compile_step on (batch size 1 only: batching: false), its start-up to
#    /ready and, ready, the same 720p stream. OUT/serve.json, OUT/serve-log.txt.
# No network on the GPU machine: --wheels DIR installs what it lacks from a folder filled here by
# `bash bench/gpu_wheels.sh DIR` (pip --no-index; the project's pins where the machine's own copy misses them, the
# machine's packages where they satisfy them). Should pip's resolver refuse that mix, the wheels of the projects the
# machine lacks go to a folder of their own on PYTHONPATH (--no-deps; the machine's copies of the others are kept,
# whatever their version), and the import check below decides.
# The project itself is not pip-installed: it runs from this checkout (PYTHONPATH), so a borrowed machine is left
# with no editable install pointing at a folder that goes away (`pip install -e .` would also keep its CUDA torch).
# $PYTHON (default python3, the interpreter that holds the CUDA torch on the workplace's image) runs everything.
# In this workplace, with a device lent: `bash bench/gpu_wheels.sh .whl` here, then the device tool's run with
# carry [".whl"] and the command `bash bench/gpu_check.sh --wheels .whl "$OUT"` (timeout_s 570): OUT's 8 files
# come back (summary.json, summary.md, machine.txt, install.txt, bench.txt, gpu-tests.txt, serve.json, serve-log.txt).
set -uo pipefail
cd "$(dirname "$0")/.."
smoke=0 wheels="" install_only=0 deadline_s=560 steps="bench,tests,serve" started=$(date +%s)
while (($#)); do
  case "$1" in
    --smoke) smoke=1; shift ;;
    --install-only) install_only=1; shift ;;
    --wheels) wheels="$2"; shift 2 ;;
    --deadline-s) deadline_s="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    -*) echo "unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
[[ "$deadline_s" =~ ^[0-9]+$ ]] || { echo "--deadline-s takes whole seconds, not '$deadline_s'" >&2; exit 2; }
[[ ",$steps," =~ ^,((bench|tests|serve),)+$ ]] \
  || { echo "--steps takes a comma-separated list of bench, tests, serve; not '$steps'" >&2; exit 2; }
# wanted STEP: whether --steps names STEP.
wanted() { [[ ",$steps," == *",$1,"* ]]; }
out="${1:-${OUT:-gpu-check}}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0

left() { echo $(( started + deadline_s - $(date +%s) )); }
# bounded NAME SECONDS COMMAND...: COMMAND under `timeout`, for SECONDS or what is left before the deadline if less;
# skipped (status 1, named on stdout) with under 10 s left. `timeout 0` would mean no limit, hence the floor.
bounded() {
  local name="$1" want="$2" remaining
  shift 2
  remaining=$(left)
  if ((remaining < 10)); then
    echo "== $name: skipped, ${remaining} s left before the script's deadline (--deadline-s $deadline_s)"
    return 1
  fi
  timeout $((want < remaining ? want : remaining)) "$@"
}
# end_at SECONDS: the epoch second a bench process must end by (its --end-at), SECONDS from now or 10 s before the
# script's deadline if sooner.
end_at() {
  local want=$(( $(date +%s) + $1 )) last=$(( started + deadline_s - 10 ))
  echo $((want < last ? want : last))
}

if [ -n "$wheels" ]; then
  [ -f "$wheels/requirements.txt" ] || { echo "== $wheels has no requirements.txt (fill it with bench/gpu_wheels.sh)"; exit 1; }
  if ! bounded "install" 60 "$py" -m pip install -q --no-index --find-links "$wheels" -r "$wheels/requirements.txt" > "$out/install.txt" 2>&1; then
    tail -n 5 "$out/install.txt"
    echo "== pip could not satisfy every pin from $wheels and this machine; what the machine lacks goes on PYTHONPATH"
    site="$(mktemp -d)"
    # Only the wheels of projects this machine lacks: PYTHONPATH comes before site-packages, so a wheel of a project
    # it has would shadow its copy (seen in a rehearsal: the folder's huggingface-hub 2.x over the image's 1.x, which
    # the image's transformers refuses, so diffusers failed to import). Each kept copy is named in install.txt.
    mapfile -t lacking < <("$py" - "$wheels" 2>> "$out/install.txt" <<'PY'
import importlib.metadata as metadata, pathlib, sys
for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name = wheel.name.split("-")[0]
    try:
        print(f"kept this machine's {name} {metadata.version(name)} (not {wheel.name})", file=sys.stderr)
    except metadata.PackageNotFoundError:
        print(wheel)
PY
)
    if ((${#lacking[@]})); then
      bounded "install (PYTHONPATH)" 30 "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "${lacking[@]}" >> "$out/install.txt" 2>&1 \
        || { echo "== installing from $wheels failed (see $out/install.txt)"; exit 1; }
    fi
    printf 'on PYTHONPATH from %s: %s\n' "$wheels" "${lacking[*]##*/}" | tee -a "$out/install.txt"
    export PYTHONPATH="$PYTHONPATH:$site"
  fi
fi
# Every module the check imports, before anything long starts: a missing wheel costs seconds here, not a loan.
"$py" - <<'PY' 2>&1 | tee -a "$out/install.txt"
import importlib, sys
missing = []
for module in ("torch", "diffusers", "safetensors", "numpy", "yaml", "httpx", "fastapi", "uvicorn", "pydantic_settings",
               "websockets", "prometheus_client", "pytest", "transformers", "models", "app.runtime.services", "bench.gpu"):
    try:
        importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 -- any failure to import is what this check reports
        missing.append(f"{module}: {type(error).__name__}: {error}")
if "diffusers" in sys.modules and not hasattr(sys.modules["diffusers"], "SanaWMLTX2RefinerTransformer3DModel"):
    missing.insert(0, f"diffusers {getattr(sys.modules['diffusers'], '__version__', '?')}: no "
                      "SanaWMLTX2RefinerTransformer3DModel (diffusers==0.42.1 has it)")
print("imports:", "missing " + "; ".join(missing) if missing else "all present", "| python", sys.version.split()[0])
sys.exit(1 if missing else 0)
PY
[ "${PIPESTATUS[0]}" = 0 ] || { echo "== a module the check needs does not import (see $out/install.txt)"; exit 1; }
((install_only)) && exit 0

rm -f "$out/summary.json" "$out/summary.md"  # the second process adds to the first's summary, not an older run's
if ((smoke)); then  # the same two processes as the loan's run
  bounded "bench gpu" 300 "$py" -m bench gpu --smoke --skip step_modes "$out" > "$out/bench.txt" 2>&1 || status=1
  bounded "bench gpu step_modes" 300 "$py" -m bench gpu --smoke --only step_modes "$out" >> "$out/bench.txt" 2>&1 \
    || status=1
  tail -n 5 "$out/bench.txt"
  # The served check without its second, compiled server (a minute of compiling on a CPU).
  bounded "gpu serve" 120 "$py" -m bench gpu-serve --smoke --no-compiled-startup "$out" > "$out/serve.txt" 2>&1 \
    || { status=1; tail -n 20 "$out/serve.txt"; }
  exit $status
fi

bounded "machine check" 60 "$py" - <<'PY' 2>&1 | tee "$out/machine.txt"
import torch, diffusers
print("torch", torch.__version__, "diffusers", diffusers.__version__, "cuda", torch.version.cuda)
assert torch.cuda.is_available(), "no CUDA device (use --smoke for the CPU check)"
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
assert (major, minor) >= (2, 11), f"torch {torch.__version__}: the GPU check needs >= 2.11"
print(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory // 2**30, "GiB")
try:  # told, not asserted: only the compiled modes need it (step_modes skips them without it, naming why)
    import triton
    print("triton", triton.__version__)
except Exception as error:
    print(f"triton does not import ({type(error).__name__}: {error}): the compiled step modes are skipped and the "
          "compiled-step test fails")
PY
[ "${PIPESTATUS[0]}" = 0 ] || exit 1

if wanted bench; then
  echo "== bench gpu"
  # Bounded so that the tests still run within the loan: summary.json is written after every section (and the step
  # modes' after each mode), so a process stopped here keeps what it measured. The first process: the block
  # latencies left after --budget-s are skipped (null), the sections after them take ~40 s. The second: start-up
  # again (random weights, ~20 s), then the step modes (about 100 s: two compiles), which start no mode with under
  # 45 s left before its --end-at, counted from here (the process's imports included), 10 s before its timeout.
  bounded "bench gpu" 200 "$py" -m bench gpu --skip step_modes --budget-s 115 --end-at "$(end_at 190)" "$out" 2>&1 \
    | tee "$out/bench.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || { status=1; echo "== bench gpu: some sections failed (errors in $out/summary.json)"; }
  bounded "bench gpu step_modes" 150 "$py" -m bench gpu --only step_modes --end-at "$(end_at 140)" "$out" 2>&1 \
    | tee -a "$out/bench.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || { status=1; echo "== bench gpu step_modes: failed or cut short (see $out/summary.json)"; }
fi
if wanted tests; then
  echo "== gpu tests"
  # Two runs: the compiled (CUDA graphs) test compiles, the slowest by far, so it runs last and alone; should it
  # overrun, the other tests' results are already in the file.
  bounded "gpu tests" 75 "$py" -m pytest -q -rA -m gpu -s -p no:cacheprovider -o log_level=INFO tests/gpu -k "not compiled_step" 2>&1 \
    | tee "$out/gpu-tests.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || { status=1; echo "== gpu tests FAILED"; }
  bounded "gpu tests (compiled step)" 105 "$py" -m pytest -q -rA -m gpu -s -p no:cacheprovider -o log_level=INFO \
    tests/gpu -k "compiled_step" 2>&1 | tee -a "$out/gpu-tests.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || { status=1; echo "== gpu tests (compiled step) FAILED or timed out"; }
fi
if wanted serve; then
  echo "== gpu serve"
  # The service from a released-size checkpoint on disk (bench/gpu_serve.py): ready, quickstart, a 720p stream,
  # /metrics, the drain, then a compiled server (batch size 1) to /ready and its 720p stream, until --end-at.
  bounded "gpu serve" 300 "$py" -m bench gpu-serve --end-at "$(end_at 290)" "$out" 2>&1 | tail -n 60
  [ "${PIPESTATUS[0]}" = 0 ] || { status=1; echo "== gpu serve: some steps failed (errors in $out/serve.json)"; }
fi
exit $status
