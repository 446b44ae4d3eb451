#!/usr/bin/env bash
# Type-checks canarygate-engine's `cuda` feature without a system CUDA install.
#
# nvcc and the CUDA headers come from PyPI's nvidia-cuda-nvcc CUDA 13 wheels (with their pinned
# dependencies), installed into a local folder; then `cargo check --features cuda` runs with
# that toolkit on PATH. No GPU is needed for the check (nothing is launched).
#
# Usage: scripts/check-cuda.sh [TOOLKIT_DIR]   (default: target/cuda-toolkit)
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
toolkit="${1:-$root/target/cuda-toolkit}"

if [ ! -x "$toolkit/bin/nvcc" ]; then
    py="$toolkit/py"
    if ! ls "$py"/nvidia/*/bin/nvcc >/dev/null 2>&1; then
        python3 -m pip install --quiet --target "$py" \
            "nvidia-cuda-nvcc>=13,<14" "nvidia-cuda-runtime>=13,<14" "nvidia-cuda-cccl>=13,<14"
    fi
    # The wheels put the toolkit under nvidia/cu13 (older layouts: nvidia/cuda_nvcc ...);
    # link whatever they ship into one CUDA_HOME-shaped tree.
    mkdir -p "$toolkit/bin" "$toolkit/include" "$toolkit/lib64"
    for part in "$py"/nvidia/*/; do
        for sub in bin include lib lib64 nvvm; do
            [ -d "$part$sub" ] || continue
            case "$sub" in
                lib|lib64) dest="$toolkit/lib64" ;;
                *) dest="$toolkit/$sub" ;;
            esac
            mkdir -p "$dest"
            cp -rsn "$part$sub/." "$dest/" 2>/dev/null || true
        done
    done
    [ -x "$toolkit/bin/nvcc" ] || { echo "nvcc not found in the installed wheels under $py" >&2; exit 1; }
fi

export CUDA_HOME="$toolkit" CUDA_PATH="$toolkit" CUDA_ROOT="$toolkit"
export PATH="$toolkit/bin:$PATH"
export LD_LIBRARY_PATH="$toolkit/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvcc --version | tail -n 2
# cudarc 0.19 knows CUDA up to 13.4 and loads the driver API dynamically; newer 13.x wheels
# (13.5 at the time of writing) are checked against its 13.4 bindings.
if [ -z "${CUDARC_CUDA_VERSION:-}" ]; then
    release="$(nvcc --version | sed -n 's/.*release \([0-9]*\)\.\([0-9]*\).*/\1 \2/p')"
    read -r major minor <<<"$release"
    if [ "$major" = 13 ] && [ "$minor" -gt 4 ]; then minor=4; fi
    export CUDARC_CUDA_VERSION="${major}0${minor}0"
fi
# Without a GPU, candle-kernels cannot ask the driver for the compute capability.
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
cd "$root"
cargo check -p canarygate-engine --features cuda
