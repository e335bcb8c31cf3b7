#!/bin/sh
# Real-size figures on a GPU host (issue 34): the pattern fixture, cpu and gpu, daemon vs
# direct vs the runtime's own benchmark, and the first gpu load with its probe.
#
# The GPU host cannot install torch, so it cannot build the fixture: build it on the dev box
# (`tests/models/build.py --real-size --only gemma3-1b-real-pattern`, which also writes
# `gemma3-1b-real-pattern.litertlm.xz`, a few MB) and ship the .xz in the working tree, e.g.
# as the ignored `.realsize/gemma3-1b-real-pattern.litertlm.xz` (the device tool's `carry`).
#
#   sh bench/realsize_gpu.sh .realsize/gemma3-1b-real-pattern.litertlm.xz
#
# Prints each figure beside its goal; docs/benchmarks.md#real-size-models says where they go.
set -eu
XZ=${1:?usage: sh bench/realsize_gpu.sh PATH/gemma3-1b-real-pattern.litertlm.xz}
PY=${PYTHON:-.venv/bin/python}
CACHE=${MODELD_TEST_MODEL_CACHE:-$HOME/.cache/modeld-test-models}
MODEL=$CACHE/gemma3-1b-real-pattern.litertlm
mkdir -p "$CACHE"
[ -f "$MODEL" ] || xz -dc "$XZ" > "$MODEL.tmp" && mv "$MODEL.tmp" "$MODEL"
nproc; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
date -u

echo "== first gpu load (probe included) and first reply, daemon vs direct Engine()"
"$PY" bench/bench_gpu.py --model "$MODEL" --runs 3 --tokens 16

echo "== gpu: memory, load, generation, daemon vs direct vs litert_lm.Benchmark"
"$PY" bench/bench_realsize.py --model "$MODEL" --backend gpu --only memory,load,generate

echo "== cpu on this host: threads by count, and the same sections"
"$PY" bench/bench_realsize.py --model "$MODEL" --only threads,memory,load,generate

echo "== the realsize tests (the pattern file stands in for both models)"
MODELD_TEST_MODEL_CACHE=$CACHE "$PY" -m pytest -m realsize tests/engine/test_realsize.py -ra
