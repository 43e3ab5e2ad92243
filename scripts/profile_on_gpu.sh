#!/usr/bin/env bash
# Measure the gpt2-xl and llama2-7b layer profiles on this machine's GPU (tensor degree 1, micro-batch sizes
# 1, 2, 4, 8) with `fasop profile layers`, and print them beside `fasop profile synth`'s estimate for the
# same GPU type. Needs Python with numpy, click and torch (with CUDA); fasop is run from this checkout.
#
#   scripts/profile_on_gpu.sh [GPU] [OUT_DIR]
#
# GPU: the GPU type of clusters/catalogue/gpus.toml the profile is for (default H100). OUT_DIR: where to write
# <model>-<GPU>-measured.csv (default: profiles/<model>/<GPU>-measured.csv, beside the bundled profiles).
# Environment: PYTHON (default python3), REPEAT (timed passes, default 20), WARMUP (default 5).
set -euo pipefail
[[ "${1:-}" != -h && "${1:-}" != --help ]] || { sed -n '2,/^set /s/^# \{0,1\}//p' "$0"; exit 0; }  # usage: the comment above

cd "$(dirname "$0")/.."
GPU="${1:-H100}"
OUT_DIR="${2:-}"
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
synth_dir="$(mktemp -d)"
trap 'rm -rf "$synth_dir"' EXIT

for model in gpt2-xl llama2-7b; do
    if [[ -n "$OUT_DIR" ]]; then
        measured="$OUT_DIR/$model-$GPU-measured.csv"
    else
        measured="profiles/$model/$GPU-measured.csv"
    fi
    echo "== $model on $GPU: measuring into $measured"
    # the measured profile is its own GPU type, <GPU>-measured, beside the bundled <GPU>.csv
    "$PYTHON" -m fasop profile layers --model "$model" --gpu "$GPU-measured" --tp 1 --mbs 1,2,4,8 --device cuda \
        --repeat "${REPEAT:-20}" --warmup "${WARMUP:-5}" --out "$measured" --force
    cat "$measured"
    synth="$synth_dir/$model.csv"
    if ! "$PYTHON" -m fasop profile synth --model "$model" --gpu "$GPU" --tp 1 --mbs 1,2,4,8 --out "$synth" --force; then
        echo "(no synthetic profile for $GPU: not in clusters/catalogue/gpus.toml)"
        continue
    fi
    echo "== $model on $GPU: measured against fasop profile synth (milliseconds)"
    "$PYTHON" - "$model" "$GPU" "$measured" "$synth" <<'EOF'
import sys

from fasop.inputs.model import load_model
from fasop.inputs.profiles import read_profile, required_kinds

model_name, gpu, measured_path, synth_path = sys.argv[1:]
model = load_model(model_name)
measured, synth = read_profile(measured_path, model, f"{gpu}-measured"), read_profile(synth_path, model, gpu)
print(f"{'kind':>10} {'mbs':>4} {'fwd meas':>10} {'fwd synth':>10} {'bwd meas':>10} {'bwd synth':>10} {'meas/synth':>10}")
for tp in measured.tensor_degrees:
    for kind in required_kinds(model):
        for mbs in measured.curves[tp, kind].mbs.astype(int):
            fwd, bwd = measured.time(tp, kind, mbs)
            sfwd, sbwd = synth.time(tp, kind, mbs)
            print(f"{kind:>10} {mbs:>4} {fwd * 1e3:>10.3f} {sfwd * 1e3:>10.3f} {bwd * 1e3:>10.3f} {sbwd * 1e3:>10.3f} "
                  f"{(fwd + bwd) / (sfwd + sbwd):>10.2f}")
EOF
done
