#!/usr/bin/env bash
# The connector's CUDA path, proven in one command on a machine with an NVIDIA GPU:
#   make gpu-check            (or: bash benchmarks/gpu/check.sh)
#   make gpu-check CPU=1      (or: bash benchmarks/gpu/check.sh --cpu): the dry run on CPU
#
# Runs from a copy of the working tree with no network: installs the wheelhouse made
# beforehand by `make gpu-wheels` (.whl/: what the GPU machine's Python lacks) into a
# target directory, runs the tests marked `cuda` (tests/gpu, tests/connector), runs the
# GPU benchmark (benchmarks/gpu/bench_gpu.py), and writes gpu-report.json (device, torch
# and CUDA versions, tests passed/failed/skipped, every benchmark figure), the pytest log
# and the benchmark's JSON into GPU_CHECK_OUT (default: $OUT when set, else ./gpu-report).
#
# The dry run takes the same steps on CPU tensors, through the same stream handler with
# host stand-ins for streams and events (KVEVENTS_GPU_CHECK=cpu, KVEVENTS_TRANSFER_STREAMS
# =host), and a small benchmark layout; "device": "cpu" in its report.
#
# Environment: GPU_CHECK_PYTHON (default python3; the dry run prefers .venv/bin/python),
# GPU_CHECK_MIB / GPU_CHECK_REPEATS (benchmark size), GPU_CHECK_TIMEOUT (seconds per step).
# Exit status: 0 when every test passed and the benchmark ran; 1 otherwise (the report
# is written either way).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
repo=$PWD

cpu=${CPU:-}
for arg in "$@"; do
  case "$arg" in
    --cpu) cpu=1 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "check.sh: unknown argument $arg (only --cpu)" >&2; exit 2 ;;
  esac
done

out=${GPU_CHECK_OUT:-${OUT:-$repo/gpu-report}}
mkdir -p "$out" || exit 1
step_timeout=${GPU_CHECK_TIMEOUT:-300}
if [ -n "$cpu" ]; then
  py=${GPU_CHECK_PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
  mib=${GPU_CHECK_MIB:-8}; repeats=${GPU_CHECK_REPEATS:-3}
  export KVEVENTS_GPU_CHECK=cpu KVEVENTS_TRANSFER_STREAMS=host
else
  py=${GPU_CHECK_PYTHON:-python3}
  mib=${GPU_CHECK_MIB:-1024}; repeats=${GPU_CHECK_REPEATS:-7}
  unset KVEVENTS_GPU_CHECK KVEVENTS_TRANSFER_STREAMS
fi
export PYTHONUNBUFFERED=1
start=$(date +%s)

# 1. What this Python lacks, from the wheelhouse (no index: the machine has no network).
site=${TMPDIR:-/tmp}/kvevents-gpu-site
if "$py" -c 'import zmq, msgspec' 2>/dev/null; then
  echo "== dependencies: already importable by $py"
elif ls .whl/*.whl >/dev/null 2>&1; then
  echo "== dependencies: installing $(ls .whl/*.whl | wc -l) wheels from .whl/ into $site"
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
    || { echo "check.sh: installing .whl/ failed (made by 'make gpu-wheels' for this Python?)" >&2; exit 1; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "check.sh: $py cannot import zmq and msgspec, and there is no .whl/: run 'make gpu-wheels' first" >&2
  exit 1
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

# 2. The tests marked cuda.
echo "== tests (pytest -m cuda tests/gpu tests/connector)"
timeout "$step_timeout" "$py" -m pytest -q -m cuda -p no:cacheprovider --junitxml="$out/gpu-tests.xml" \
  tests/gpu tests/connector 2>&1 | tee "$out/gpu-pytest.log"
tests_rc=${PIPESTATUS[0]}

# 3. The benchmark.
echo "== benchmark (benchmarks/gpu/bench_gpu.py)"
timeout "$step_timeout" "$py" benchmarks/gpu/bench_gpu.py ${cpu:+--cpu} --mib "$mib" --repeats "$repeats" \
  --json "$out/gpu-bench.json" 2>&1 | tee "$out/gpu-bench.log"
bench_rc=${PIPESTATUS[0]}

# 4. The report.
"$py" benchmarks/gpu/report.py --out "$out/gpu-report.json" --junit "$out/gpu-tests.xml" \
  --bench "$out/gpu-bench.json" --tests-rc "$tests_rc" --bench-rc "$bench_rc" --seconds "$(( $(date +%s) - start ))" \
  || exit 1
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
