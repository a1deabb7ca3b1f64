#!/usr/bin/env bash
# Brings TF 2.21 (GPU build) up on a lent GPU machine (the `device` tool; see
# ../shared/GPU.md) and runs a command under it:
#
#   source tools/gpu_stage.sh && python3 benchmarks/run.py --device gpu ...
#
# What it needs in the working tree, in the folder .gpu/ (ignored by git:
# `echo /.gpu/ >> .git/info/exclude`), carried by the device calls:
#   .gpu/tf221gpu.tar.xz.part*  the tensorflow-2.21.0 cp312 manylinux wheel,
#                               unpacked without tensorflow/include, as tar.xz,
#                               split under 64 MiB (one part per call; calls
#                               under 30 s apart keep the machine and the
#                               parts already sent)
#   .gpu/wheels/*.whl                nvidia-cuda-runtime-cu12 12.5.x (the real
#                               libcudart.so.12), astunparse, gast,
#                               google_pasta, termcolor, protobuf 6.x,
#                               flatbuffers (pip download --no-deps
#                               --python-version 3.12 ...)
#   .gpu/extra/*.whl            keras 3, namex, optree: installed only when
#                               `import tensorflow` asks for keras
# Made here by (2026-11-26, 572 MB wheel -> ~300 MB):
#   unzip -q tensorflow-2.21.0-*.whl -d tfpkg && rm -rf tfpkg/tensorflow/include
#   tar -cf - -C tfpkg . | xz -T2 -4 | split -b 60m - .gpu/tf221gpu.tar.xz.part
set -e
GPU_DIR="${GPU_DIR:-.gpu}"
# Each call replaces what it carries: move each part out of the tree on
# arrival (mv .gpu/tf221gpu.tar.xz.part* /tmp/parts/), as the parts come.
mkdir -p /tmp/parts /tmp/tf
mv "$GPU_DIR"/tf221gpu.tar.xz.part* /tmp/parts/ 2>/dev/null || true
if [ ! -f /tmp/tf/tensorflow/__init__.py ]; then
    cat /tmp/parts/tf221gpu.tar.xz.part* | xz -d -T0 | tar -xf - -C /tmp/tf
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$GPU_DIR"/wheels/*.whl
export PYTHONPATH=/tmp/tf:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
if ! python3 -c "import tensorflow" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$GPU_DIR"/extra/*.whl
fi
# CUDA: TF 2.21 is built for CUDA 12; the image has CUDA 13. Its libraries go
# under the CUDA 12 sonames TF asks for; cudart is CUDA 12's own.
mkdir -p /tmp/cuda12
LIBDIRS=$(python3 - <<'EOF'
import glob, site, sys
dirs = []
for base in site.getsitepackages() + [site.getusersitepackages()] + sys.path:
    dirs += glob.glob(base + "/nvidia/*/lib")
print(":".join(d for d in dict.fromkeys(dirs) if "/tmp/site/" not in d))
EOF
)
link() {  # link PATTERN SONAME: the first library matching PATTERN as SONAME
    local found
    found=$(for d in ${LIBDIRS//:/ }; do ls "$d"/$1 2>/dev/null; done | head -1)
    if [ -n "$found" ]; then ln -sf "$found" "/tmp/cuda12/$2"; fi
}
link 'libcublas.so.1[23]' libcublas.so.12
link 'libcublasLt.so.1[23]' libcublasLt.so.12
link 'libcufft.so.1[12]' libcufft.so.11
link 'libcusolver.so.1[12]' libcusolver.so.11
link 'libcusparse.so.12' libcusparse.so.12
link 'libcudnn.so.9' libcudnn.so.9
ln -sf /tmp/site/nvidia/cuda_runtime/lib/libcudart.so.12 /tmp/cuda12/libcudart.so.12
export LD_LIBRARY_PATH=/tmp/cuda12:${LIBDIRS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export TF_FORCE_GPU_ALLOW_GROWTH=true
set +e
