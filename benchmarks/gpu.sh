#!/usr/bin/env bash
# The GPU benchmark, in one go, on a machine with one NVIDIA GPU (written for one H200 and
# 16 cores). Figures from its runs are in docs/benchmarks.md.
#
#   benchmarks/gpu.sh                 # sets up .venv-gpu, writes the checkpoints, runs
#   SIZE_GB=16 REPEAT=5 benchmarks/gpu.sh
#   PYTHON=python3 benchmarks/gpu.sh  # an interpreter that already has torch with CUDA and
#                                     # rayload's loading dependencies (rayload itself on
#                                     # PYTHONPATH=src, or installed)
#   DEADLINE=420 benchmarks/gpu.sh    # end by 420 s: later stages are cut short or skipped
#   STAGES="verify warm" benchmarks/gpu.sh   # only these stages
#   WARM_METHODS="limit_parallel scratch" benchmarks/gpu.sh  # the warm bench's cases
#
# Stages, in order of importance (each under its own time limit; a failed stage is
# reported and the next one runs; the exit code is the number of failed stages):
#   probe     the GPU, the driver and what rayload's probe sees (cuFile, nvidia-fs: GDS?)
#   h2d       pinned and pageable host-to-device bandwidth (CUDA events)
#   tests     the loading tests and the peer channel's (a GPU root streaming from device
#             memory), GPU-marked ones included, on this GPU
#   verify    every method and peer onto cuda:0 at TP 1 and 2 on a small checkpoint, with
#             the tensors of all cases hashed and compared
#   sweep     scratch onto cuda:0 from the page cache, reader threads x chunk size
#   first     scratch's first and later loads in fresh processes (8, 12, 16 threads)
#   register  experiment: DMA straight out of the page cache (cudaHostRegister on mmap)
#   warm      rayload bench, TP=1, SIZE_GB from the page cache: scratch, fastsafetensors,
#             fastsafetensors_gdr (what ran, and why), and the peers; GB/s per GPU
#   summary   GB/s per GPU of the warm run against the 35 GB/s target
#   hybrid    experiment: that DMA and scratch's staged reader at once, on parts of the
#             files (is the page-cache copy or memory bandwidth the bound?)
#   cold      the warm bench from the disk (evicted per file), COLD_SIZE_GB
#   cpu       the CPU benchmark (TP=4, 1 GB, warm and cold) on this machine's cores
#   vllm      inside vLLM on this GPU (benchmarks/vllm_load.py, TP 1, warm page cache):
#             rayload's load format (each tensor straight into vLLM's CUDA parameters
#             through a pinned bounce window) against vLLM's auto; needs VLLM_PYTHON, an
#             interpreter with a CUDA build of vLLM (this script installs none: the device
#             machine reaches no package registry), else skipped saying so
# Results (every bench's .json/.md/.png) go to $RESULTS ($OUT or benchmarks/results/gpu).
set -uo pipefail

cd "$(dirname "$0")/.."
REPO=$(pwd)
SIZE_GB=${SIZE_GB:-8}
COLD_SIZE_GB=${COLD_SIZE_GB:-2}
REPEAT=${REPEAT:-3}
CPU_SIZE_GB=${CPU_SIZE_GB:-1}
DEADLINE=${DEADLINE:-100000}
WORKDIR=${WORKDIR:-/tmp/rayload-bench-gpu}
RESULTS=${RESULTS:-${OUT:-$REPO/benchmarks/results/gpu}}
VENV=${VENV:-$REPO/.venv-gpu}
STAGES=${STAGES:-}      # empty: every stage
DEVICE=${DEVICE:-cuda}   # cpu: rehearse the script's flow on a machine without a GPU
FAILED=()

die() { echo "gpu.sh: FAIL: $*" >&2; exit 100; }

# stage NAME LIMIT_S COMMAND...: run COMMAND for at most LIMIT_S, or until DEADLINE; skip
# it when under 30 s are left; record a failure and go on.
stage() {
  local name=$1 limit=$2 rc
  shift 2
  (( limit > DEADLINE - SECONDS )) && limit=$(( DEADLINE - SECONDS ))
  echo
  if [ -n "$STAGES" ] && [[ " $STAGES " != *" $name "* ]]; then
    echo "== $name: not in STAGES"
    return 0
  fi
  if (( limit < 30 )); then
    echo "== $name: SKIPPED (at ${SECONDS} s, DEADLINE=${DEADLINE} s)"
    return 0
  fi
  echo "== $name (at ${SECONDS} s, limit ${limit} s)"
  timeout --kill-after=10 "$limit" bash -c '"$@"' _ "$@"  # bash -c: runs functions too
  rc=$?
  if (( rc != 0 )); then
    echo "== $name: FAILED (exit $rc$( ((rc == 124)) && echo ', time limit'))"
    FAILED+=("$name")
  fi
}

bench() {  # bench NAME DEVICE ARGS...: rayload bench into $RESULTS/NAME
  local name=$1 device=$2
  shift 2
  mkdir -p "$RESULTS/$name"
  "$PY" -m rayload.cli bench --device "$device" --workdir "$WORKDIR" --out "$RESULTS/$name" \
    --no-startup "$@"
}
export -f bench
export RESULTS WORKDIR

echo "== machine"
if [ "$DEVICE" = cuda ]; then
  command -v nvidia-smi >/dev/null || die "nvidia-smi not found: no NVIDIA driver on this machine"
  nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id,pcie.link.gen.max,pcie.link.width.max \
    --format=csv,noheader || die "nvidia-smi cannot talk to the driver"
fi
echo "cpus: $(nproc)"; uname -r; free -g | head -2
lsmod 2>/dev/null | grep -E '^nvidia_fs' || echo "nvidia_fs kernel module: not loaded"
ls /dev/nvidia-fs* 2>/dev/null || echo "/dev/nvidia-fs*: absent"
[ -f /etc/cufile.json ] && echo "/etc/cufile.json: present" || echo "/etc/cufile.json: absent"
mkdir -p "$WORKDIR" "$RESULTS"
df -hT "$WORKDIR"
avail_gb=$(df -BG --output=avail "$WORKDIR" | tail -1 | tr -dc 0-9)
need_gb=$(( ${SIZE_GB%.*} + ${COLD_SIZE_GB%.*} + 4 ))
(( avail_gb > need_gb )) || die "$WORKDIR has ${avail_gb} GB free, needs ${need_gb} GB"

echo; echo "== python environment"
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
  "$PY" -c "import rayload" 2>/dev/null || "$PY" -m pip install --quiet --no-deps -e "$REPO" \
    || die "rayload is not importable by $PY and cannot be installed into it"
else
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV" || die "python3 -m venv failed (install python3-venv)"
  fi
  PY=$VENV/bin/python
  # PyPI's Linux torch wheel is the CUDA build; pin the version the project is tested with.
  "$PY" -m pip install --quiet --upgrade pip \
    && "$PY" -m pip install --quiet "torch==2.13.0" \
    && "$PY" -m pip install --quiet -e "$REPO[bench,test]" \
    || die "pip install failed (no package registry reachable?): set PYTHON to an interpreter that has torch with CUDA"
fi
export PY
"$PY" - "$DEVICE" <<'EOF' || die "torch cannot use the device in this environment"
import sys, torch, fastsafetensors, safetensors, rayload
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"fastsafetensors {fastsafetensors.__version__}, safetensors {safetensors.__version__}, "
      f"rayload from {rayload.__file__}")
if sys.argv[1] == "cuda":
    assert torch.cuda.is_available(), f"torch {torch.__version__} sees no GPU"
    print(f"GPU: {torch.cuda.get_device_name(0)}")
EOF

stage probe 60 "$PY" benchmarks/gpu_figures.py probe
[ "$DEVICE" = cuda ] && stage h2d 60 "$PY" benchmarks/gpu_figures.py h2d 4
stage tests 150 "$PY" -m pytest -q -p no:cacheprovider tests/loading \
  tests/ray_cluster/test_peer_channel.py
stage verify 120 bench verify "$DEVICE" --quick --tp 1 2 --cache warm --no-split-probe \
  --methods scratch converted fastsafetensors fastsafetensors_gdr safe_open_slice \
  fastsafetensors_whole load_file_slice
CKPT=$WORKDIR/llama-1b-${SIZE_GB}gb
[ -d "$CKPT" ] || stage checkpoint 120 "$PY" -m rayload.cli make-checkpoint --preset llama-1b \
  --size-gb "$SIZE_GB" "$CKPT"
[ "$DEVICE" = cuda ] && stage sweep 120 "$PY" benchmarks/gpu_figures.py sweep "$CKPT"
[ "$DEVICE" = cuda ] && stage first 90 "$PY" benchmarks/gpu_figures.py first "$CKPT"
[ "$DEVICE" = cuda ] && stage register 90 "$PY" benchmarks/gpu_figures.py register "$CKPT"
WARM_METHODS=${WARM_METHODS:-limit_parallel scratch fastsafetensors fastsafetensors_gdr \
fastsafetensors_whole safe_open_slice}
# shellcheck disable=SC2086  # one case per word
stage warm 240 bench warm "$DEVICE" --checkpoint "$CKPT" --tp 1 --cache warm --repeat "$REPEAT" \
  --no-verify --no-split-probe --methods $WARM_METHODS
latest=$(ls -t "$RESULTS"/warm/bench-*.json 2>/dev/null | head -1)
[ -n "$latest" ] && stage summary 30 "$PY" benchmarks/gpu_figures.py summary "$latest"
[ "$DEVICE" = cuda ] && stage hybrid 90 "$PY" benchmarks/gpu_figures.py hybrid "$CKPT"
stage cold 240 bench cold "$DEVICE" --size-gb "$COLD_SIZE_GB" --tp 1 --cache cold --repeat 1 \
  --no-verify --no-split-probe \
  --methods scratch fastsafetensors fastsafetensors_gdr fastsafetensors_whole safe_open_slice
stage cpu 300 bench cpu cpu --size-gb "$CPU_SIZE_GB" --tp 4 --cache warm cold --repeat 3 --no-split-probe \
  --methods scratch converted safe_open_slice fastsafetensors_whole limit_alloc limit_parallel
if [ -n "${VLLM_PYTHON:-}" ]; then
  stage vllm 300 env PYTHONPATH="$REPO/src" "$VLLM_PYTHON" benchmarks/vllm_load.py --tp 1 \
    --rounds "$REPEAT" --size-mb "${VLLM_SIZE_MB:-2000}" --formats rayload,rayload[staged],auto \
    --workdir "$WORKDIR" --json "$RESULTS/vllm-load.json"
else
  echo; echo "== vllm: SKIPPED (VLLM_PYTHON unset: an interpreter with vLLM's CUDA build)"
fi

echo
echo "== done in ${SECONDS} s; failed stages: ${FAILED[*]:-none}; results in $RESULTS"
exit "${#FAILED[@]}"
