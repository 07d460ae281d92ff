#!/usr/bin/env bash
# The GPU benchmark, in one go, on a machine with one NVIDIA GPU (written for one H200 and
# 16 cores). NOT RUN YET: no GPU was available where it was written; see docs/benchmarks.md.
#
#   benchmarks/gpu.sh                 # sets up .venv-gpu, writes an 8 GB checkpoint, runs
#   SIZE_GB=16 REPEAT=5 VERIFY=0 benchmarks/gpu.sh
#   PYTHON=/opt/env/bin/python benchmarks/gpu.sh   # an interpreter that already has torch
#                                                   # with CUDA and rayload's dependencies
#
# Prints: the GPU, driver and what rayload's probe sees (cuFile, nvidia-fs: GDS or not);
# pinned and pageable host-to-device bandwidth; scratch / fastsafetensors /
# fastsafetensors_gdr loading onto cuda:0 from the page cache (and cold), each with the
# method that really ran and any fallback; GB/s per GPU against the 35 GB/s target.
# Results go to $OUT (if set) or benchmarks/results/gpu/.
set -euo pipefail

die() { echo "gpu.sh: FAIL: $*" >&2; exit 1; }
step() { echo; echo "== $*"; }

cd "$(dirname "$0")/.."
REPO=$(pwd)
SIZE_GB=${SIZE_GB:-8}
REPEAT=${REPEAT:-3}
WORKDIR=${WORKDIR:-/tmp/rayload-bench-gpu}
RESULTS=${OUT:-$REPO/benchmarks/results/gpu}
VENV=${VENV:-$REPO/.venv-gpu}
VERIFY=${VERIFY:-1}   # 0: skip hashing every rank's tensors to check the methods agree

step "machine"
command -v nvidia-smi >/dev/null || die "nvidia-smi not found: no NVIDIA driver on this machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv,noheader \
  || die "nvidia-smi cannot talk to the driver"
[ "$(nvidia-smi -L | wc -l)" -ge 1 ] || die "nvidia-smi lists no GPU"
nproc; uname -r; free -g | head -2
lsmod 2>/dev/null | grep -E '^nvidia_fs' || echo "nvidia_fs kernel module: not loaded (no GDS)"
ls /dev/nvidia-fs* 2>/dev/null || echo "/dev/nvidia-fs*: absent"
[ -f /etc/cufile.json ] && echo "/etc/cufile.json: present" || echo "/etc/cufile.json: absent"
mkdir -p "$WORKDIR" "$RESULTS"
df -hT "$WORKDIR"
avail_gb=$(df -BG --output=avail "$WORKDIR" | tail -1 | tr -dc 0-9)
[ "$avail_gb" -gt $(( ${SIZE_GB%.*} + 4 )) ] || die "$WORKDIR has ${avail_gb} GB free, need ${SIZE_GB} GB + 4"

step "python environment"
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
  "$PY" -m pip install --quiet --no-deps -e "$REPO" || die "cannot install rayload into $PY"
else
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV" || die "python3 -m venv failed (install python3-venv)"
  fi
  PY=$VENV/bin/python
  # PyPI's Linux torch wheel is the CUDA build; pin the version the project is tested with.
  "$PY" -m pip install --quiet --upgrade pip \
    && "$PY" -m pip install --quiet "torch==2.13.0" \
    && "$PY" -m pip install --quiet -e "$REPO[bench]" \
    || die "pip install failed (no package registry reachable?): set PYTHON to an interpreter that has torch with CUDA"
fi
"$PY" - <<'EOF' || die "torch cannot use CUDA in this environment"
import torch
assert torch.cuda.is_available(), f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
EOF
"$PY" -c "import fastsafetensors, safetensors, rayload.benchmark" || die "rayload's bench dependencies are missing"

step "probe (GDS / cuFile as rayload sees them)"
"$PY" benchmarks/gpu_figures.py probe

step "host-to-device bandwidth (4 GiB, CUDA events)"
"$PY" benchmarks/gpu_figures.py h2d 4

step "load onto cuda:0, TP=1 (one GPU), ${SIZE_GB} GB, warm then cold page cache"
# The limit cases still run (CPU reads): every ratio refers to them. --no-startup: one GPU
# and no Ray cluster to speak of; the CPU benchmark times rayload.load.
"$PY" -m rayload.cli bench --device cuda --tp 1 --cache warm cold --repeat "$REPEAT" \
  --size-gb "$SIZE_GB" --workdir "$WORKDIR" --out "$RESULTS" --no-startup --no-split-probe \
  --methods scratch fastsafetensors fastsafetensors_gdr fastsafetensors_whole \
  $([ "$VERIFY" = 1 ] || echo --no-verify) \
  || die "rayload bench failed (or the methods returned different tensors)"

step "GB/s per GPU, effective methods, what GDS did"
latest=$(ls -t "$RESULTS"/bench-*.json | head -1)
"$PY" benchmarks/gpu_figures.py summary "$latest"
echo
echo "full report: ${latest%.json}.md"
