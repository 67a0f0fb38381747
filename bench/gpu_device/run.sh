#!/usr/bin/env bash
# The GPU paths on a lent GPU machine (the device tool's `run`, carry [".whl", ".gpu"]), from the
# repository root:
#
#   bash bench/gpu_device/run.sh [tests|suite|probe|trial|scale|bench-quick|bench] ...   (default: tests suite bench-quick)
#
# That machine has CUDA 13 PyTorch but none of our other dependencies and no network: their Python
# 3.12 wheels travel in .whl/ and FAISS with CUDA 13 kernels cut to sm_90 as .gpu/faiss90.tar.xz, both
# made here by bench/gpu_device/pack.sh (faiss-gpu-cu12 has no sm_90 kernels and fails on an H100 with
# "no kernel image is available"). Each stage writes its log to $OUT and goes on when another fails;
# the bench stages write their JSON + Markdown report to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/icr-gpu}
mkdir -p "$OUT"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests suite bench-quick)

mkdir -p /tmp/site
xz -d < .gpu/faiss90.tar.xz | tar x -C /tmp/site || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl || exit 1
# icr itself, editable (its stages install as icr.training, ...; the `icr` command for the CLI tests)
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
for lib in libcublas.so.13 libcudart.so.13; do
    LD_LIBRARY_PATH="$(dirname "$(find / -xdev -name $lib 2>/dev/null | head -1)"):${LD_LIBRARY_PATH:-}"
done
export LD_LIBRARY_PATH _FAISS_WHEEL_DISABLE_CUDA_PRELOAD=1
export PYTHONPATH="/tmp/site" PYTHONUNBUFFERED=1 MPLBACKEND=Agg
# faiss-cuda links libstdc++ statically; with another libstdc++ loaded first (torch's), index_factory
# can fail with std::bad_cast. Preload one copy for the whole process when the probe shows that.
probe='import torch, faiss; faiss.index_factory(8, "IVF4,Flat")'
if ! python3 -c "$probe" 2>/dev/null; then
    for pre in /usr/lib/x86_64-linux-gnu/libstdc++.so.6 /tmp/site/faiss_cuda.libs/libfaiss-*.so; do
        if LD_PRELOAD=$pre python3 -c "$probe" 2>/dev/null; then export LD_PRELOAD=$pre; break; fi
    done
fi
{
    echo "LD_PRELOAD=${LD_PRELOAD:-} (index_factory after torch: $(python3 -c "$probe" 2>&1 | tail -1 || true))"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import faiss, torch; print('faiss', faiss.__version__, 'GPUs seen by faiss', faiss.get_num_gpus(),
'| torch', torch.__version__, torch.cuda.get_device_name(0), '| bf16', torch.cuda.is_bf16_supported())"
    python3 -c "import torchvision; print('torchvision', torchvision.__version__)"
    echo "CPU cores: $(nproc)"
} 2>&1 | tee "$OUT/env.txt"

faiss_tests="faiss or index_build or index_vector"
for stage in "${stages[@]}"; do
    echo "=== $stage $(date +%T)"
    case $stage in
        tests)  # the gpu-marked tests: CUDA training steps vs CPU, torchvision ResNet, faiss on the GPU
            # torch and FAISS in separate processes: a FAISS abort must not hide the torch results
            { timeout 200 python3 -m pytest -p no:cacheprovider -m gpu -k "not ($faiss_tests)" -rs -v tests
              timeout 200 python3 -m pytest -p no:cacheprovider -m gpu -k "$faiss_tests" -rs -v tests; } 2>&1 \
                | tee "$OUT/gpu-tests.log" ;;
        suite)  # the whole unit suite with a GPU visible (device=auto paths take CUDA here)
            timeout ${SUITE_TIMEOUT:-300} python3 -m pytest -p no:cacheprovider -q -n 12 -rfEs tests 2>&1 | tee "$OUT/suite.log" | tail -40 ;;
        probe)  # the HNSW trial's recall 0.000 on a GPU-built IVF index (notes of 2026-11-27)
            timeout 120 python3 bench/gpu_device/hnsw_probe.py 2>&1 | tee "$OUT/hnsw-probe.log" ;;
        trial)  # the same, through the build's own choose_by_measurement and efSearch 1,000-4,000
            timeout ${TRIAL_TIMEOUT:-200} python3 bench/gpu_device/hnsw_probe.py trial 2>&1 | tee "$OUT/hnsw-trial.log" ;;
        scale)  # IVF at 10M / 100M built and searched on the GPU (issue 43, item 5)
            timeout ${SCALE_TIMEOUT:-300} python3 bench/gpu_device/scale.py "$OUT/scale.jsonl" \
                --sizes ${SCALE_SIZES:-10000000 100000000} --budget-s ${SCALE_BUDGET:-240} 2>&1 | grep -v "^WARNING clustering" | tee "$OUT/scale.log" ;;
        bench-quick)
            timeout 420 python3 -m icr.cli bench --quick --only gpu --workdir bench-work --out "$OUT/quick" ;;
        bench)  # GPU section at 100k distractors, the quick model (trained by bench-quick) as the checkpoint
            timeout ${BENCH_TIMEOUT:-560} python3 -m icr.cli bench --only gpu --sizes 100000 --workdir bench-work --out "$OUT/full" \
                --checkpoint bench-work/quick-model/best --data bench-work/quick-data ;;
        *) echo "unknown stage $stage" ;;
    esac
done
