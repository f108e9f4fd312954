#!/usr/bin/env bash
# The CUDA/NCCL checks CI cannot run (it has no GPU), for a GPU host with geosched's dependencies installed:
# the tests that skip without CUDA (tests/test_cuda.py: stages, links, cross-DC sync, tp and ZeRO over NCCL
# against one process; tests/test_wan_compress.py: the codec on the GPU), then the demo rehearsed on this
# host's GPUs and on its CPUs, side by side, and the same for a larger model (8 blocks of 512, sequences of
# 128; uncalibrated) where the GPU's compute shows. Writes OUT_DIR/pytest.log and OUT_DIR/launch-*.json.
# Usage: bash scripts/gpu-check.sh [OUT_DIR]   (PYTHON=... to pick the interpreter; default python3)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/gpu-check}"
py="${PYTHON:-python3}"
mkdir -p "$out"
nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not found"
"$py" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "GPUs", torch.cuda.device_count(),
  "NCCL", torch.cuda.nccl.version() if torch.cuda.is_available() else None)'
"$py" -m pytest -q -p no:cacheprovider --timeout 300 tests/test_cuda.py tests/test_wan_compress.py 2>&1 | tee "$out/pytest.log"
tests=${PIPESTATUS[0]}
"$py" - "$out/larger.yaml" <<'PY'
import sys, yaml
data = yaml.safe_load(open("configs/demo-3dc.yaml"))
for dc in data["cluster"]["datacenters"]:
    dc["gpu"] = {"name": "gpu", "tflops": 50, "memory_gib": 1}
for link in data["cluster"]["links"]:
    link.update(bandwidth_gbps=10, per_connection_gbps=2.5)
data["cluster"]["name"] = "larger-3dc"
data["job"]["model"] = {"layers": 8, "hidden": 512, "heads": 8, "seq_len": 128, "vocab": 256}
data["job"]["learning_rate"] = 3e-4
yaml.safe_dump(data, open(sys.argv[1], "w"))
PY
launch() {  # NAME CONFIG DEVICE STEPS [FLAGS]: one rehearsal, its summary line
  local name=$1 config=$2 device=$3 steps=$4
  shift 4
  "$py" -m geosched.cli plan "$config" --tp 1 --dp 1 -o "$out/plan-$name.yaml" >/dev/null || return 1
  "$py" -m geosched.cli launch "$config" --plan "$out/plan-$name.yaml" --steps "$steps" --device "$device" "$@" \
    --run-dir "$out/run-$name-$device" --json > "$out/launch-$name-$device.json" 2> "$out/launch-$name-$device.log"
  "$py" - "$out/launch-$name-$device.json" "$name --device $device" <<'PY'
import json, sys
r = json.loads(open(sys.argv[1]).read().splitlines()[-1])
predicted = r["predicted_iteration_s"]
print(f"launch {sys.argv[2]}: losses {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}, iteration measured "
      f"{r['measured_iteration_s'] * 1e3:.1f} ms" + (f", predicted {predicted * 1e3:.1f} ms" if predicted else ""))
PY
}
for device in cuda cpu; do launch demo configs/demo-3dc.yaml "$device" 10; done
for device in cuda cpu; do launch larger "$out/larger.yaml" "$device" 4 --no-calibrate; done
exit "$tests"
