#!/usr/bin/env bash
# What one device session runs on a GPU machine; logs and results go to $OUT.
#   bash scripts/gpu_session.sh tests fast examples bench pytest-bench
# The plugin is loaded with -p: on the device machine the package is used from
# the tree (PYTHONPATH), not installed, so its entry point is not registered.
set -u
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
# NVLink multicast stays off (the device notes: it can take a shared host's GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
P="-p pytest_cudagraph.plugin -p no:cacheprovider"
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch; print('torch', torch.__version__, 'devices', torch.cuda.device_count())"
} >"$OUT/env.txt" 2>&1
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | grep -v "Warning\|warner" | tail -n "${TAIL:-80}" >"$OUT/$name.log"
  echo "$name rc=${PIPESTATUS[0]} $((SECONDS - t0))s" >>"$OUT/steps.txt"
}
for s in "$@"; do
  case $s in
    tests) step tests 150 python -m pytest tests -m cuda -n 8 $P -q -rfE ;;
    fast) PYTEST_CUDAGRAPH_CAPTURE=fast step fast 120 python -m pytest tests -m cuda -n 8 $P -q -rfE ;;
    checked) PYTEST_CUDAGRAPH_CAPTURE=checked step checked 120 python -m pytest tests -m cuda -n 8 $P -q -rfE ;;
    examples) step examples 300 python -m pytest --cudagraph-verify examples/ $P --cudagraph-report="$OUT/examples.json" ;;
    examples-n0) step examples-n0 200 python -m pytest --cudagraph-verify examples/ $P -n 0 --cudagraph-report="$OUT/examples_n0.json" ;;
    examples-n2) step examples-n2 200 python -m pytest --cudagraph-verify examples/ $P -n 2 --cudagraph-split=descriptor --cudagraph-report="$OUT/examples_n2.json" ;;
    examples-n2-test) step examples-n2-test 200 python -m pytest --cudagraph-verify examples/ $P -n 2 --cudagraph-report="$OUT/examples_n2_test.json" ;;
    distributed) TAIL=400 step distributed 300 python -m pytest examples/tensor_parallel -m cuda $P -v -rfE --durations=0 ;;
    tp-show) TAIL=200 step tp-show 200 python -m examples.tensor_parallel.show --backend cuda --world-size 2 --timeout 30 ;;
    phases) step phases 120 python benchmarks/capture_phases.py --rounds 7 ;;
    profile) step profile 200 python benchmarks/bench_replay.py --capture-only --profile-capture --out "$OUT/profile.json" ;;
    bench) step bench 200 python benchmarks/bench_replay.py --out "$OUT/bench.json" ;;
    scale) TAIL=200 step scale 400 python benchmarks/scale.py --shapes 1B,8B --resnet --out "$OUT/scale.json" ;;
    pytest-bench) step pytest-bench 90 python -m pytest benchmarks/ $P -q --benchmark-json="$OUT/pytest_bench.json" --cudagraph-bench-report="$OUT/bench.md" ;;
    *) echo "unknown step $s" >>"$OUT/steps.txt" ;;
  esac
done
cat "$OUT/steps.txt"
