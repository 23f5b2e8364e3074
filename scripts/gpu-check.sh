#!/usr/bin/env bash
# The GPU checks in one call: make bench-gpu's speed part (train.py against a plain torch loop; train.py on real
# JPEGs decoded on the GPU and by the workers beside synthetic images; the decode path alone and its agreement with
# the CPU decode; the loader's rate), then make test-gpu's NCCL kill cases beside the GPU tests (the defaults,
# sync=relaxed amp=apex O1 and O2, a GPU straggler evicted, JPEGs decoded on the GPU), each recovery_s printed; then
# the same speed part compiled (COMPILE=0: left out). Made for a lent GPU machine whose Python has torch but not the
# project's pure-Python dependencies and no package index:
#   bash scripts/gpu-check.sh prepare [APEX_SRC]     # here, with .venv: fills .gpu/site (carry .gpu)
#   OUT=<dir> bash scripts/gpu-check.sh run [SECONDS] # there, from the repository root; results in $OUT
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-run}" in
prepare)
    site=.gpu/site
    rm -rf "$site" && mkdir -p "$site"
    src=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    for pkg in timm hydra omegaconf antlr4; do cp -r "$src/$pkg" "$site/"; done
    if [ -n "${2:-}" ]; then  # NVIDIA apex 25.04, Python-only (as make apex installs it), into the same folder
        apex=$2
        if [ -f "$apex" ]; then
            tmp=$(mktemp -d) && tar -xzf "$apex" -C "$tmp" && apex=$(dirname "$(find "$tmp" -maxdepth 3 -name setup.py | head -1)")
        fi
        .venv/bin/python -m pip install -q --no-build-isolation --no-deps --target "$site" "$apex"
    fi
    find "$site" -name __pycache__ -prune -exec rm -rf {} +
    du -sh "$site"
    ;;
run)
    budget=${2:-560}
    export PYTHONPATH=$PWD/.gpu/site PYTHONUNBUFFERED=1 WANDB_MODE=disabled OUT=${OUT:-$(mktemp -d)}
    nvidia-smi -L
    python3 -c 'import torch, timm; print("torch", torch.__version__, "NCCL", torch.cuda.nccl.version(), "timm", timm.__version__)'
    python3 -c 'import apex.amp; print("apex", apex.__file__)' || echo "apex: not importable (amp=apex tests skip)"
    # the eager speed part takes about 180 s (60 without the real images, IMAGES=0), the compiled one about 200 s;
    # the tests get the rest, less 20 s
    images=${IMAGES:-2048}
    compile=${COMPILE:-1}
    python3 -m bench.gpu --out "$OUT" --steps 40 --images "$images" \
        --faults-timeout $((budget - (images ? 200 : 80) - (compile ? 200 : 0))) 2>&1 | tee "$OUT/bench.txt"
    if [ "$compile" = 1 ]; then
        mkdir -p "$OUT/compile"
        python3 -m bench.gpu --out "$OUT/compile" --steps 40 --images "$images" --compile --no-faults \
            --real-decodes gpu --agree-batches 0 2>&1 | tee "$OUT/compile/bench.txt"
    fi
    ;;
*)
    echo "usage: $0 prepare [APEX_SRC] | run [SECONDS]" >&2
    exit 2
    ;;
esac
