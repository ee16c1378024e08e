#!/usr/bin/env bash
# Before a GPU call: on a machine with the package index, put what benchmarks/gpu/run.sh needs on a GPU machine
# that cannot reach one into folders the call carries (each in .gitignore: a call carries ignored folders only
# when told to):
#   .whl/          wheels of jserve's dependencies a JAX + PyTorch GPU image lacks (gguf, starlette, uvicorn,
#                  llguidance), for Python 3.12 on x86-64 Linux (PYTHON_VERSION to change it)
#   .gpu-cache/    a JSERVE_CACHE holding the default model's tokenizer, which random-weight models borrow
#   .gpu-model-1/, .gpu-model-2/
#                  the default model's GGUF (94 MB, for the notebook stage) in two halves: a call carries at
#                  most 64 MiB, so the first call carries .gpu-model-1 alone and the next (the machine still
#                  warm) carries the rest with .gpu-model-2; run.sh joins them and checks their sha256
#
#   bash benchmarks/gpu/prepare.sh
#   then, with the device tool: run "true" carrying .gpu-model-1, and at once
#   run "bash benchmarks/gpu/run.sh" carrying .whl .gpu-cache .gpu-model-2
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3}"
PYTHON_VERSION="${PYTHON_VERSION:-3.12}"

rm -rf .whl && mkdir .whl
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_31_x86_64 -d .whl gguf starlette uvicorn "llguidance>=1.9,<2"

# The default model's tokenizer as a folder, written into the local cache by its first use.
"$PYTHON" -c "from jserve.loader.default_model import default_tokenizer; default_tokenizer()"
cache=$("$PYTHON" -c "from jserve.paths import cache_dir; print(cache_dir())")
rm -rf .gpu-cache && mkdir .gpu-cache
cp -r "$cache/SmolLM2-135M-Instruct-tokenizer" .gpu-cache/

gguf=$("$PYTHON" -c "from jserve.loader.default_model import default_model_path; print(default_model_path())")
rm -rf .gpu-model-1 .gpu-model-2 && mkdir .gpu-model-1 .gpu-model-2
half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
head -c "$half" "$gguf" > .gpu-model-1/part
tail -c +$((half + 1)) "$gguf" > .gpu-model-2/part
sha256sum "$gguf" | cut -d' ' -f1 > .gpu-model-2/sha256
du -sh .whl .gpu-cache .gpu-model-1 .gpu-model-2
