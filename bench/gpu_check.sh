#!/usr/bin/env bash
# One prepared check on one CUDA GPU, in at most 7 minutes, from this checkout (PYTHONPATH; nothing installed:
# the GPU machine is offline). Each step has a time cap and its own log under OUT_DIR; the steps run one after
# the other, and `fit` with validation runs alone and last, since it holds most of the card while it bisects.
#
#   bash bench/gpu_check.sh [OUT_DIR]        (default runs/gpu_check/<UTC time>)
#
# Before it, outside its timed work, install the wheels the GPU image lacks (docs/testing.md says how).
# Exit: 0 every step passed, 1 a step failed or ran out of its time (summary.tsv names it), 2 no GPU here
# or a test tool missing.
# Environment: PYTHON (default python3), GPU_CHECK_WORKERS (the suite's pytest-xdist workers, default 8).
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
out=${1:-runs/gpu_check/$(date -u +%Y%m%dT%H%M%SZ)}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The real card decides here: a profile or CPU flags set for testing would stand in for it.
unset TIER_UTILS_GPU_PROFILE TIER_UTILS_CPU_FLAGS

# Whether tensors can go to a GPU at all (the card's facts come from tier_utils' own reader: info.log).
if ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no GPU here (torch.cuda.is_available() is False): run it on a machine with a CUDA GPU" >&2
    exit 2
fi
missing=$("$py" -c "
import importlib.util
need = ['pytest', 'xdist', 'nbval', 'ipykernel', 'ipywidgets', 'optuna', 'datasets']
print(' '.join(n for n in need if importlib.util.find_spec(n) is None))")
if [ -n "$missing" ]; then
    echo "gpu_check: missing $missing; first: $py -m pip install --no-index --find-links .whl ${missing/xdist/pytest-xdist}" \
        "(wheels from ../shared/gpu/prepare-wheels.sh)" >&2
    exit 2
fi
# pytest-timeout (the GPU image has it) stops one hung test, and from 2.3 a whole run before its step's cap, so
# pytest still ends normally: its summary and junit XML name what failed. limits CAP prints those options.
limits() {
    "$py" -c "
import importlib.metadata as m, sys
try:
    version = tuple(int(p) for p in m.version('pytest-timeout').split('.')[:2])
except m.PackageNotFoundError:
    sys.exit()
print('--timeout=90', f'--session-timeout={$1 - 20}' if version >= (2, 3) else '')"
}
mkdir -p "$out"
printf 'step\texit\tseconds\tcap\n' > "$out/summary.tsv"
echo "gpu_check: logs in $out"

# step NAME CAP COMMAND...: COMMAND under a cap of CAP seconds, stdout and stderr to OUT_DIR/NAME.log: SIGINT at
# the cap, SIGKILL 5 s later. pytest runs with -v, so a run cut short has still logged each test's outcome.
# The caps and the kill grace add up to 400 s (tests/test_gpu_check.py holds them to it): with the first checks
# (torch imported twice), under 7 minutes.
status=0
step() {
    local name=$1 cap=$2 start=$SECONDS code=0
    shift 2
    echo "gpu_check: $name (at most ${cap} s): $*"
    timeout -s INT -k 5 "$cap" "$@" > "$out/$name.log" 2>&1 || code=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "$code" "$((SECONDS - start))" "$cap" >> "$out/summary.tsv"
    if [ "$code" -eq 124 ]; then echo "gpu_check: $name ran out of its ${cap} s"; fi
    if [ "$code" -ne 0 ]; then status=1; echo "gpu_check: $name exited $code (see $out/$name.log)"; fi
}

timeout 10 nvidia-smi > "$out/nvidia-smi.log" 2>&1
step info 10 "$py" -m tier_utils info
gpt2_small=(--model tiny-gpt --model-arg d_model=768 --model-arg n_layer=12 --model-arg n_head=12
            --model-arg max_len=1024 --batch-size 16 --seq-len 1024 --no-progress)
# shellcheck disable=SC2046  # limits prints separate options
step suite 130 "$py" -m pytest -v -p no:cacheprovider -rfE -n "${GPU_CHECK_WORKERS:-8}" --dist loadscope \
    $(limits 130) --junitxml="$out/suite.xml" tests
# shellcheck disable=SC2046
step notebooks 50 "$py" -m pytest -v -p no:cacheprovider -rfE -n 3 --dist loadscope $(limits 50) --nbval-lax \
    --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg --junitxml="$out/notebooks.xml" notebooks
step all 30 "$py" -m tier_utils all --out "$out/all" --json "$out/all.json" --no-progress
step bench 65 "$py" -m tier_utils bench "${gpt2_small[@]}" --precisions fp32,bf16 --compile on --repeats 3 \
    --accuracy-steps 20 --eval-batches 5 --json "$out/bench.json"
# At bench's batch, so its compiled bf16 graphs can come from inductor's cache that bench just filled.
step gpu_mfu 45 "$py" bench/gpu_mfu.py --batch-size 16 --steps 30 --window 10 --repeats 1 --json "$out/gpu_mfu.json"
step fit 35 "$py" -m tier_utils fit "${gpt2_small[@]}" --validate --json "$out/fit.json"
timeout 10 nvidia-smi >> "$out/nvidia-smi.log" 2>&1

column -t -s $'\t' "$out/summary.tsv" 2>/dev/null || cat "$out/summary.tsv"
exit "$status"
