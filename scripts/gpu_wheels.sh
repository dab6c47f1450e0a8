#!/usr/bin/env bash
# Download the wheels of grain (the training data pipeline), tyro (train.py's and decode.py's
# command lines) and of everything they need into
# wheels/ (git-ignored), for a Linux x86_64 machine that cannot reach a package index:
#
#   bash scripts/gpu_wheels.sh [PYTHON_VERSION...]      # default 3.12 (the GPU image's python3)
#
# There, `python3 -m pip install --no-index --find-links wheels grain tyro` installs what is
# missing (the GPU scripts do it: scripts/_gpu_deps.sh). The versions are those of constraints.txt. The
# project needs Python >= 3.12; each further version adds its own binary wheels (numpy,
# grain, array_record: about 20 MB a version).
set -euo pipefail
cd "$(dirname "$0")/.."
pip=${PIP:-"python3 -m pip"}
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(3.12)
mkdir -p wheels
for version in "${versions[@]}"; do
    $pip download --dest wheels --only-binary=:all: --implementation cp --python-version "$version" \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux2010_x86_64 \
        --platform manylinux1_x86_64 --constraint constraints.txt grain tyro
done
du -sh wheels
