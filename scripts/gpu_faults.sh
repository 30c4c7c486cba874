#!/usr/bin/env bash
# #19 on a GPU: leak cycles, the CUDA fault tests, the fault suite three ways, the cost of isolation.
#   export OUT; bash scripts/gpu_faults.sh
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
P="-p pytest_cudagraph.plugin -p no:cacheprovider"
quiet() { grep -v "Assertion \`\|^\s*$" ; }  # a device assert prints a line per thread
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } > "$OUT/env.txt"
t() { local s=$SECONDS; "$@"; echo "[$((SECONDS - s)) s] $*" >> "$OUT/times.txt"; }
t timeout 150 python benchmarks/fault_probe.py leaks --cycles 30 2>&1 | quiet > "$OUT/leaks.txt"
t timeout 150 python -m pytest tests/test_gpu_faults.py $P -q -rA 2>&1 | quiet | tail -40 > "$OUT/gpu_faults.txt"
t timeout 100 python -m pytest scripts/fault_suite $P -rA 2>&1 | quiet | tail -50 > "$OUT/suite_serial.txt"
t timeout 100 python -m pytest scripts/fault_suite $P -n 2 -rA 2>&1 | quiet | tail -50 > "$OUT/suite_n2.txt"
t timeout 150 python -m pytest scripts/fault_suite $P --cudagraph-isolate -rA 2>&1 | quiet | tail -50 > "$OUT/suite_isolate.txt"
# The cost of isolation: the three correct tests, without and with it, in one session.
t python -m pytest scripts/fault_suite $P -q -k correct > /dev/null 2>&1
t python -m pytest scripts/fault_suite $P -q -k correct --cudagraph-isolate > /dev/null 2>&1
t timeout 200 python -m pytest tests -m cuda -n 8 $P -q -rfE 2>&1 | quiet | tail -15 > "$OUT/cuda_tests.txt"
cat "$OUT/times.txt"
