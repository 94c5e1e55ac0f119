#!/usr/bin/env bash
# Download the peers the side-by-side suite compares against (torchtune's
# OffloadActivations, DeepSpeed's activation-offload engine) and what they need
# beyond the GPU image, as wheels, into DEST (default .whl/ in the repo root).
#
#   benchmarks/peer_wheels.sh [DEST]
#
# For a GPU machine without network: carry DEST there (device tool:
# carry [".whl"]); benchmarks/gpu_suite.sh installs every wheel in .whl/ with
# pip --target and puts it on PYTHONPATH. Versions are the ones that imported
# and ran here with torch 2.13 (torchtune 0.6.1 needs torchao <= 0.14: newer
# ones dropped names it imports; 0.12 fails to import on torch >= 2.13).
# The GPU image (see .library/device/KINDS.md) already has sentencepiece,
# tiktoken, huggingface-hub, pyarrow, pandas, xxhash, fsspec, einops, msgpack,
# py-cpuinfo, ninja, psutil, tqdm; torchtune's blobfile/kagglehub are not
# needed to import it. Target: CPython ${PYV:-3.12}, manylinux x86-64.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEST=${1:-$ROOT/.whl}
PYV=${PYV:-3.12}
PY=${PYTHON:-python3}
mkdir -p "$DEST"
if [ "$DEST" = "$ROOT/.whl" ] && [ -d "$ROOT/.git" ] \
        && ! grep -qx '/.whl/' "$ROOT/.git/info/exclude" 2>/dev/null; then
    echo '/.whl/' >>"$ROOT/.git/info/exclude"   # never committed
fi

plats=()
for n in 17 24 27 28 31 34; do plats+=(--platform "manylinux_2_${n}_x86_64"); done
plats+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)

"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" \
    --implementation cp "${plats[@]}" -d "$DEST" \
    torchtune==0.6.1 torchao==0.13.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
    omegaconf==2.4.0 \
    hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5

# DeepSpeed publishes only a source archive; its ops are compiled at use, so the
# wheel built from it is pure Python (needs torch importable in $PY).
if ! ls "$DEST"/deepspeed-*.whl >/dev/null 2>&1; then
    DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" \
        deepspeed==0.19.8
fi
ls -la "$DEST"
du -sh "$DEST"
