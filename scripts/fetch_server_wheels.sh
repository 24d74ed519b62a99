#!/usr/bin/env bash
# Download the server's packages that the GPU image lacks or holds too old (fastapi, uvicorn, starlette,
# pydantic, uvloop and httptools, aiohttp for `moeserve bench --url`, and what they need; humming-kernels
# for `--moe-backend humming`, xgrammar for structured outputs, compressed-tensors for the tests' INT4
# checkpoints)
# as Python 3.12 manylinux wheels into .whl/ (git-ignored), for `scripts/sweeps/gpu_sweep.sh` there.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
# The versions installed in the project's venv (where the tests ran), else in python3's: one
# consistent set (a newer anyio than typing-extensions fails to import).
py=.venv/bin/python; [ -x "$py" ] || py=python3
# fastapi needs opentelemetry-api and a newer typing-extensions than the GPU image holds.
for pkg in fastapi uvicorn starlette pydantic pydantic_core annotated-types typing-inspection annotated-doc \
    opentelemetry-api typing-extensions anyio uvloop httptools aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl \
    humming-kernels xgrammar apache-tvm-ffi compressed-tensors loguru; do
  version=$("$py" -c "import importlib.metadata as m; print(m.version('$pkg'))" 2>/dev/null || true)
  spec=$pkg${version:+==$version}
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$spec"
done
ls .whl
