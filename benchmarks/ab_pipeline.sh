#!/usr/bin/env bash
# Two commits' pipelined fan-out, alternating (A B A B ...), each run a fresh process
# from a clone of its commit: what a change to the peers costs or saves, on this disk and
# CPU whose speed drifts within minutes.
#
#   benchmarks/ab_pipeline.sh OLD NEW [ROUNDS] [-- pipeline.py's arguments]
#   benchmarks/ab_pipeline.sh 8770573 b113f11 3 -- --counts 1 8 --cases pipelined
#
# Each run is `benchmarks/pipeline.py --rounds 1 --warmup 1 ARGS` (default ARGS:
# --counts 1 8 --cases pipelined); results go to $RESULTS (default
# benchmarks/results/ab-OLD-NEW) as {old,new}-ROUND.{json,md,png}, and one line per run
# to stdout: the weights' time of each count, the latest receiver's first piece.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
OLD=$1 NEW=$2 ROUNDS=${3:-3}
shift $(( $# < 3 ? $# : 3 ))
[[ ${1:-} == "--" ]] && shift
ARGS=("$@")
(( ${#ARGS[@]} )) || ARGS=(--counts 1 8 --cases pipelined)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
RESULTS=${RESULTS:-$REPO/benchmarks/results/ab-$OLD-$NEW}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$RESULTS"
for side in old new; do
  rev=$OLD; [[ $side == new ]] && rev=$NEW
  git clone -q "$REPO" "$WORK/$side"
  git -C "$WORK/$side" checkout -q "$rev"
done
for round in $(seq 1 "$ROUNDS"); do
  for side in old new; do
    out=$RESULTS/$side-$round
    (cd "$WORK/$side" && PYTHONPATH=src:tests "$PYTHON" benchmarks/pipeline.py \
      --rounds 1 --warmup 1 "${ARGS[@]}" --out "$out" > "$out.log" 2>&1)
    weights=$(grep -E '^\| [0-9]+ \| [0-9.]+ s \(wall' "$out.md" | cut -d'|' -f2,3 | tr -s ' ' | tr '\n' ';')
    first=$(grep -o 'n=[0-9]* [0-9.]* / [0-9.]* / [0-9.]*' "$out.md" | tr '\n' ';' || true)
    echo "round $round $side $(git -C "$WORK/$side" rev-parse --short HEAD): $weights first piece: $first"
  done
done
