#!/usr/bin/env bash
# Wheels for a GPU machine that has torch, CUDA, CuPy and transformers but no package index: the
# packages neuron and its `gpu` tests import that such an image usually lacks, at the versions this
# checkout's .venv tested, for CPython 3.12 on x86-64 Linux (override with PYVER). Run it where pip
# reaches an index, carry DIR over, and there:
#
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl && export PYTHONPATH=/tmp/site
#   bash scripts/gpu_checklist.sh
set -eu
DIR=${1:-.whl}
PYVER=${PYVER:-3.12}
VENV_PY=${VENV_PY:-.venv/bin/python}
PACKAGES="msgspec starlette uvicorn gguf llguidance pytest-asyncio openai httpx2 httpcore2 truststore jiter distro
  pydantic pydantic-core annotated-types typing-inspection sniffio jsonschema jsonschema-specifications referencing
  rpds-py compressed-tensors loguru anthropic docstring-parser opentelemetry-api importlib-metadata ollama
  openai-agents griffelib mcp mcp-types sse-starlette pyjwt python-multipart websockets cryptography cffi pycparser"
mkdir -p "$DIR"
pins=()
for name in $PACKAGES; do
    version=$("$VENV_PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name" 2>/dev/null) \
        || { echo "not installed in $VENV_PY, taking the newest: $name"; pins+=("$name"); continue; }
    pins+=("$name==$version")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_31_x86_64 -d "$DIR" "${pins[@]}"
ls "$DIR"
