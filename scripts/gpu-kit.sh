#!/usr/bin/env bash
# The local engine's GPU validation kit (local-engine/README.md, "On a GPU").
#
#   scripts/gpu-kit.sh build [--cpu] [--kit DIR]
#       Here, on a machine with a Rust toolchain and no GPU. Builds the kit binary
#       (canarygate-gpu-kit) and writes into DIR (default: gpu-kit/, ignored by git) everything
#       a run needs: bin/canarygate-gpu-kit, a small random Llama model in a Hugging Face
#       directory (model/), its CPU f32 reference (reference.json) and kit.json. Prints the
#       kit's size.
#         default: a release binary with the `cuda` feature, stripped, kernels compiled to
#                  PTX for sm_90a (compute capability 9.0, Hopper) by nvcc 13.0 (PyPI wheels
#                  pinned below, installed into target/cuda-13.0), for driver 580 / CUDA 13.0.
#         --cpu:   the same binary without CUDA, dev profile; GPU_KIT_BINARY=PATH takes one
#                  already built instead (scripts/test.sh passes the one `cargo test` built).
#
#   scripts/gpu-kit.sh run [--cpu] [--kit DIR] [--out DIR]
#       There, from the carried kit: no network, no Rust toolchain. Finds the CUDA libraries of
#       the machine's Python `nvidia-*` packages, then runs the correctness checks, the speed
#       measurements (engine, then the PyTorch anchor where torch is importable) and writes
#       gpu-report.json, gpu-report.md and gpu-kit.log to DIR (default: $OUT, else DIR/out).
#       Exits non-zero if a correctness check failed or a phase did not finish.
#         --cpu:   the dry run: the same steps on the CPU, with a tiny speed model, skipping
#                  only what needs a GPU (the report lists what was skipped and why).
#
# Each phase of `run` has its own time limit (GPU_KIT_CORRECTNESS_TIMEOUT 90, _SPEED_ 120,
# _ANCHOR_ 100 s; the report 20 s), so that a hang cannot eat the device window: even with
# every phase at its limit the run ends within 5.5 minutes.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
bin_name=canarygate-gpu-kit

# nvcc must be no newer than the GPU machine's driver (580, CUDA 13.0): PTX from a newer nvcc
# does not load on an older driver. PTX comes from nvvm's cicc, so it is pinned too.
toolkit_wheels=(
    nvidia-cuda-nvcc==13.0.88
    nvidia-nvvm==13.0.88
    nvidia-cuda-crt==13.0.88
    nvidia-cuda-cccl==13.0.85
    nvidia-cuda-runtime==13.0.96
    # Only for linking (candle's cudarc links these libraries); at run time the GPU machine's
    # own copies are used.
    nvidia-cuda-nvrtc==13.0.88
    nvidia-curand==10.4.0.35
    nvidia-cublas==13.0.2.14
)
toolkit="$root/target/cuda-13.0"

die() {
    echo "gpu-kit: $*" >&2
    exit 1
}

usage() {
    sed -n '2,/^set -e/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'
    exit 2
}

# A CUDA_HOME-shaped tree of the pinned wheels: bin/nvcc, include/, lib64/ (with unversioned
# names for the linker) and lib64/stubs/libcuda.so (no wheel ships the driver library).
install_toolkit() {
    local stamp="$toolkit/.wheels"
    if [ -x "$toolkit/bin/nvcc" ] && [ -e "$toolkit/lib64/stubs/libcuda.so.1" ] \
        && [ "$(cat "$stamp" 2>/dev/null)" = "${toolkit_wheels[*]}" ]; then
        return
    fi
    echo "gpu-kit: installing the CUDA 13.0 toolkit wheels into $toolkit" >&2
    rm -rf "$toolkit"
    mkdir -p "$toolkit"
    python3 -m pip install --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
        --target "$toolkit/py" "${toolkit_wheels[@]}"
    local cu="$toolkit/py/nvidia/cu13"
    [ -x "$cu/bin/nvcc" ] || die "nvcc not found in the wheels under $cu"
    ln -s "$cu/bin" "$toolkit/bin"
    ln -s "$cu/include" "$toolkit/include"
    ln -s "$cu/nvvm" "$toolkit/nvvm"
    mkdir -p "$toolkit/lib64/stubs"
    local lib name
    for lib in "$cu"/lib/*.so* "$cu"/lib/*.a; do
        ln -s "$lib" "$toolkit/lib64/"
        # libfoo.so.13 -> libfoo.so, what `-lfoo` looks for.
        name="$(basename "$lib")"
        case "$name" in
            *.so.*) ln -sfn "$name" "$toolkit/lib64/${name%%.so.*}.so" ;;
        esac
    done
    make_libcuda_stub "$toolkit/lib64/stubs"
    echo "${toolkit_wheels[*]}" >"$stamp"
}

# The driver API (libcuda.so.1) comes with the GPU driver, so no wheel carries it. Linking only
# needs its symbol names: a stub exporting every function of cudarc's driver bindings, each
# returning CUDA_ERROR_UNKNOWN. It has libcuda.so.1 as its soname, so the binary asks for the
# real driver library at run time. It is never put into the kit.
make_libcuda_stub() {
    local dir="$1"
    local version
    version="$(sed -n '/^name = "cudarc"$/{n;s/^version = "\(.*\)"$/\1/p}' "$root/Cargo.lock")"
    [ -n "$version" ] || die "cudarc is not in Cargo.lock"
    (cd "$root" && cargo fetch --quiet)
    local found=("${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/"cudarc-$version/src/driver/sys/mod.rs")
    local bindings="${found[0]}"
    [ -f "$bindings" ] || die "cudarc $version's driver bindings not found"
    sed -n 's/^pub unsafe fn \(cu[A-Za-z0-9_]*\)(.*/int \1(void) { return 999; }/p' "$bindings" \
        | sort -u >"$dir/libcuda_stub.c"
    [ -s "$dir/libcuda_stub.c" ] || die "no driver functions found in $bindings"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$dir/libcuda.so" "$dir/libcuda_stub.c"
    # The name the loader asks for, so that the CUDA binary also starts here (on the CPU).
    ln -sfn libcuda.so "$dir/libcuda.so.1"
}

# Exports what candle's and cudarc's build scripts need to find the toolkit.
use_toolkit() {
    export CUDA_HOME="$toolkit" CUDA_PATH="$toolkit" CUDA_ROOT="$toolkit"
    export PATH="$toolkit/bin:$PATH"
    # cudarc's bindings for CUDA 13.0, the GPU machine's driver version.
    export CUDARC_CUDA_VERSION=13000
    # Hopper; candle-kernels cannot ask a driver without a GPU.
    export CUDA_COMPUTE_CAP=90
}

# Libraries to load the CUDA binary here, on the CPU: the wheels' real libraries and the stub.
local_cuda_library_path() {
    echo "$toolkit/lib64:$toolkit/lib64/stubs"
}

# The PTX ISA version and target of candle's kernels, as the PTX files state them.
ptx_targets() {
    local ptx
    ptx="$(ls -t "$1"/build/candle-kernels-*/out/*.ptx 2>/dev/null)" || true
    [ -n "$ptx" ] || die "no candle-kernels PTX under $1"
    # shellcheck disable=SC2086 # one file name per line, no spaces
    printf 'PTX %s for %s\n' \
        "$(sed -n 's/^\.version //p' $ptx | sort -u | paste -s -d/ -)" \
        "$(sed -n 's/^\.target //p' $ptx | sort -u | paste -s -d/ -)"
}

cmd_build() {
    local mode=cuda kit="$root/gpu-kit"
    while [ $# -gt 0 ]; do
        case "$1" in
            --cpu) mode=cpu ;;
            --kit) kit="$2"; shift ;;
            *) usage ;;
        esac
        shift
    done
    local started=$SECONDS binary library_path=""
    cd "$root"
    if [ "$mode" = cuda ]; then
        install_toolkit
        use_toolkit
        nvcc --version | tail -n 2 >&2
        # Its own target dir: the `cuda` feature changes candle, so nothing is shared anyway.
        # Without the release profile's whole-program optimisation: it is for the proxy's
        # hot path, and would cost the GPU machine minutes of build.
        CARGO_PROFILE_RELEASE_DEBUG=false CARGO_PROFILE_RELEASE_STRIP=symbols \
            CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 \
            cargo build --release --target-dir target/gpu-kit-cuda \
            -p canarygate-gpu-kit --features cuda --bin "$bin_name"
        binary="target/gpu-kit-cuda/release/$bin_name"
        library_path="$(local_cuda_library_path)"
    elif [ -n "${GPU_KIT_BINARY:-}" ]; then
        # A CPU binary already built, e.g. by `cargo test --workspace` (scripts/test.sh):
        # building it again with the non-test feature set would rebuild candle.
        binary="$GPU_KIT_BINARY"
        [ -x "$binary" ] || die "GPU_KIT_BINARY=$binary is not an executable"
    else
        cargo build -p canarygate-gpu-kit --bin "$bin_name"
        binary="target/debug/$bin_name"
    fi
    rm -rf "$kit"
    mkdir -p "$kit/bin"
    cp "$binary" "$kit/bin/$bin_name"
    # The dev profile keeps symbols; the kit does not need them.
    strip "$kit/bin/$bin_name"
    local nvcc_version=none kernels="none (CPU build)"
    if [ "$mode" = cuda ]; then
        nvcc_version="$(nvcc --version | sed -n 's/.*release [0-9.]*, V\([0-9.]*\).*/\1/p')"
        kernels="$(ptx_targets target/gpu-kit-cuda/release)"
    fi
    LD_LIBRARY_PATH="$library_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        "$kit/bin/$bin_name" prepare --kit "$kit" --mode "$mode" \
        --git "$(git -C "$root" describe --always --dirty 2>/dev/null || echo unknown)" \
        --nvcc "$nvcc_version" --kernels "$kernels" --built "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    local bytes mib
    bytes="$(du -sb "$kit" | cut -f1)"
    mib="$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')"
    echo "gpu-kit: built $mode kit in $kit: $mib MiB in all ($((SECONDS - started)) s)"
    du -ab "$kit" | sort -n -r | head -n 6 | awk '{ printf "  %8.1f MiB  %s\n", $1 / 1048576, $2 }'
    [ "$bytes" -lt $((60 * 1048576)) ] || die "the kit is over 60 MiB: it must travel with the working tree"
}

# Directories holding the CUDA libraries of the machine's Python `nvidia-*` packages
# (CUDA 13 wheels: nvidia/cu13/lib; older layouts: nvidia/<part>/lib), then the usual system
# places. Printed as a library path.
find_cuda_libraries() {
    local python dirs=()
    for python in "${GPU_KIT_PYTHON:-}" python3 /opt/torch/.venv/bin/python3 python; do
        if [ -z "$python" ] || ! command -v "$python" >/dev/null 2>&1; then
            continue
        fi
        while IFS= read -r d; do
            [ -n "$d" ] && dirs+=("$d")
        done < <("$python" - <<'EOF' 2>/dev/null
import glob, os, sys
for entry in sys.path:
    for lib in sorted(glob.glob(os.path.join(entry, "nvidia", "*", "lib"))):
        if glob.glob(os.path.join(lib, "lib*.so*")):
            print(os.path.realpath(lib))
EOF
        )
    done
    for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/local/cuda/lib64; do
        [ -d "$d" ] && dirs+=("$d")
    done
    printf '%s\n' "${dirs[@]}" | awk '!seen[$0]++' | paste -s -d: -
}

# Runs one phase under its time limit; its output goes to the log. Fails if the phase does.
phase() {
    local name="$1" limit="$2"
    shift 2
    local started=$SECONDS status=0
    echo "== $name (limit ${limit} s)" | tee -a "$log" >&2
    timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1 || status=$?
    echo "== $name: exit $status after $((SECONDS - started)) s" | tee -a "$log" >&2
    if [ "$status" = 124 ] || [ "$status" = 137 ]; then
        echo "gpu-kit: $name ran past its ${limit} s limit" | tee -a "$log" >&2
    fi
    return "$status"
}

cmd_run() {
    local mode=cuda kit="$root/gpu-kit" out="${OUT:-}"
    while [ $# -gt 0 ]; do
        case "$1" in
            --cpu) mode=cpu ;;
            --kit) kit="$2"; shift ;;
            --out) out="$2"; shift ;;
            *) usage ;;
        esac
        shift
    done
    [ -f "$kit/kit.json" ] || die "no kit in $kit: run \`scripts/gpu-kit.sh build\` first"
    out="${out:-$kit/out}"
    mkdir -p "$out"
    kit="$(cd "$kit" && pwd)"
    out="$(cd "$out" && pwd)"
    log="$out/gpu-kit.log"
    : >"$log"
    local started=$SECONDS work binary="$kit/bin/$bin_name" built
    built="$(sed -n 's/.*"mode": *"\([a-z]*\)".*/\1/p' "$kit/kit.json")"
    work="$(mktemp -d "${TMPDIR:-/tmp}/gpu-kit.XXXXXX")"
    # shellcheck disable=SC2064 # expand now: $work is local
    trap "rm -rf '$work'" EXIT

    local library_path
    if [ "$mode" = cuda ]; then
        [ "$built" = cuda ] || die "this kit was built with --cpu; build it without --cpu for a GPU"
        library_path="$(find_cuda_libraries)"
    elif [ "$built" = cuda ]; then
        # The CUDA binary on a machine without a GPU: load it against the build's toolkit.
        [ -d "$toolkit/lib64/stubs" ] || die "the CUDA kit needs a GPU machine, or run \`build --cpu\`"
        library_path="$(local_cuda_library_path)"
    else
        library_path=""
    fi
    export LD_LIBRARY_PATH="$library_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    {
        echo "gpu-kit run: mode $mode, kit $kit (built: $built), out $out"
        echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
        nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv 2>&1 || true
        echo "ldd $binary:"
        ldd "$binary" 2>&1 || true
    } >>"$log"
    if ldd "$binary" 2>/dev/null | grep -q "not found"; then
        ldd "$binary" | grep "not found" >&2
        die "libraries of $binary not found (searched $LD_LIBRARY_PATH); see $log"
    fi

    local gpu="" gpu_name=""
    if [ "$mode" = cuda ]; then
        gpu="$(nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap \
            --format=csv,noheader 2>/dev/null | head -n 1 || true)"
        gpu_name="${gpu%%,*}"
    fi
    local date failed=0
    date="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    phase correctness "${GPU_KIT_CORRECTNESS_TIMEOUT:-90}" \
        "$binary" correctness --kit "$kit" --device "$mode" --out "$work/correctness.json" \
        || failed=1
    phase "engine speed" "${GPU_KIT_SPEED_TIMEOUT:-120}" \
        "$binary" speed --kit "$kit" --work "$work" --device "$mode" --gpu-name "$gpu_name" \
        --out "$work/speed.json" \
        || failed=1
    if [ -f "$work/speed-workload.json" ]; then
        # The anchor reports its own failure; it never fails the run.
        phase "PyTorch anchor" "${GPU_KIT_ANCHOR_TIMEOUT:-100}" \
            "${GPU_KIT_PYTHON:-python3}" "$root/local-engine/gpu-kit/torch_anchor.py" \
            --workload "$work/speed-workload.json" --out "$work/anchor.json" || true
    fi
    phase report 20 \
        "$binary" report --kit "$kit" --work "$work" --mode "$mode" --out "$out" \
        --date "$date" --elapsed "$((SECONDS - started))" --gpu "$gpu" \
        --library-path "$library_path" \
        || failed=1
    [ -f "$out/gpu-report.md" ] && cat "$out/gpu-report.md"
    echo "gpu-kit: $( [ "$failed" = 0 ] && echo passed || echo FAILED ) in $((SECONDS - started)) s; report in $out" >&2
    return "$failed"
}

case "${1:-}" in
    build) shift; cmd_build "$@" ;;
    run) shift; cmd_run "$@" ;;
    *) usage ;;
esac
