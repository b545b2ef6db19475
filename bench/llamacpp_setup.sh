#!/usr/bin/env bash
# llama.cpp for bench/vs_llamacpp.py, built once from llama-cpp-python's source package.
#
#   bash bench/llamacpp_setup.sh            # from the repository root, after bash .ci/setup
#
# What it does (each step is skipped when its result is already there, so a second run takes seconds):
#   1. pip download llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION as a source package (PyPI) into
#      $RADIXKV_LLAMA_DIR/src and unpack it: it carries the llama.cpp sources it binds (vendor/llama.cpp).
#   2. cmake + build those sources with llama.cpp's defaults for this CPU (GGML_NATIVE, OpenMP) into
#      $RADIXKV_LLAMA_DIR/build: the shared libraries (libllama.so, libggml*.so) and llama-server.
#      THIS TAKES 10-20 MINUTES ON 2 CORES (run under nice); it is done once and reused.
#   3. pip install the llama-cpp-python bindings themselves without building the library a second
#      time (CMAKE_ARGS=-DLLAMA_BUILD=OFF); at run time bench/vs_llamacpp.py points them at the
#      libraries of step 2 (LLAMA_CPP_LIB_PATH), so the bindings and llama-server run the same build.
#
# AMX: GGML_NATIVE turns on llama.cpp's AMX kernels where /proc/cpuinfo lists amx_int8, but in this
# project's VMs (Firecracker guests on Sapphire Rapids) they die with SIGILL at the first tile
# instruction (`tilezero`, llama-server at its warm-up decode), so the build leaves AMX out
# (-mno-amx-*; AVX-512 / VNNI stay on). RADIXKV_LLAMA_AMX=1 keeps them where they work.
#
# Environment: RADIXKV_LLAMA_DIR (default ~/.cache/radixkv/llama.cpp), PYTHON (default .venv/bin/python),
# LLAMA_CPP_PYTHON_VERSION (default 0.3.36), JOBS (default: nproc), RADIXKV_LLAMA_AMX (default 0). Not part of .ci/setup: nothing
# but this benchmark needs llama.cpp. (`pip install -e ".[llamacpp]"` also works, but builds the
# library inside pip, without llama-server, and takes as long.)
set -euo pipefail

VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
DIR=${RADIXKV_LLAMA_DIR:-$HOME/.cache/radixkv/llama.cpp}
PY=${PYTHON:-.venv/bin/python}
JOBS=${JOBS:-$(nproc)}
SDIST="$DIR/src/llama_cpp_python-$VERSION.tar.gz"
SRC="$DIR/src/llama_cpp_python-$VERSION"
BUILD="$DIR/build"
NO_AMX=""
if [ "${RADIXKV_LLAMA_AMX:-0}" != "1" ]; then
    NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi

mkdir -p "$DIR/src"
if [ ! -f "$SDIST" ]; then
    echo "[1/3] downloading llama-cpp-python $VERSION (source package)"
    "$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DIR/src"
fi
if [ ! -d "$SRC/vendor/llama.cpp" ]; then
    tar xzf "$SDIST" -C "$DIR/src"
fi

STAMP="$BUILD/radixkv-flags"  # the flags the build was made with: other flags rebuild
if [ -x "$BUILD/bin/llama-server" ] && [ -f "$BUILD/bin/libllama.so" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$NO_AMX" ]; then
    echo "[2/3] reusing the llama.cpp build in $BUILD"
else
    echo "[2/3] building llama.cpp ($SRC/vendor/llama.cpp) into $BUILD: 10-20 minutes on 2 cores"
    cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_TOOLS=ON -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" >"$DIR/cmake-config.log"
    nice -n 19 cmake --build "$BUILD" -j "$JOBS" --target llama llama-server >"$DIR/build.log"
    printf '%s' "$NO_AMX" >"$STAMP"
fi

if LLAMA_CPP_LIB_PATH="$BUILD/bin" "$PY" -c "import llama_cpp" 2>/dev/null; then
    echo "[3/3] llama-cpp-python bindings already installed"
else
    echo "[3/3] installing the llama-cpp-python bindings (without a second library build)"
    CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$PY" -m pip install --no-deps "$SDIST"
    "$PY" -m pip install "diskcache>=5.6.1"
fi
LLAMA_CPP_LIB_PATH="$BUILD/bin" "$PY" -c "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
echo "done: RADIXKV_LLAMA_DIR=$DIR"
