#!/usr/bin/env bash
# Download, as wheels into .whl/, decodekit's dependencies that the device machine (Python 3.12, x86_64, no network)
# lacks: its image holds torch, transformers, accelerate, numpy, tqdm, psutil, pytest, jinja2, pillow, attrs ...
# but not the grammar stack. Pins are the versions decodekit is tested with here.
# Usage: scripts/gather_wheels.sh [NAME==VERSION ...]   (arguments replace the default list)
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES=(
    outlines==1.3.3 outlines-core==0.2.14 llguidance==1.9.1 genson==1.4.0 diskcache==5.6.3
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
    gguf==0.19.0
)
[ $# -gt 0 ] && PACKAGES=("$@")
mkdir -p .whl
for package in "${PACKAGES[@]}"; do
    # --no-deps: the list above is the closure already. The platforms: the manylinux tags these wheels carry
    # (llguidance's is 2_31), up to 2_34: the device's glibc is taken to be that new at least
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$package"
done
ls -l .whl
du -ch .whl/*.whl | tail -n 1
