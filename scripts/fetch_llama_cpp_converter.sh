#!/usr/bin/env bash
# llama.cpp's own GGUF converter (convert_hf_to_gguf.py, its conversion/ package and gguf-py), pure Python, from
# the llama-cpp-python sdist that vendors it, into .cache/llama.cpp (git-ignored): the model-family tests convert
# their tiny checkpoints with it (tests/helpers/families.py, which runs this script when the converter is
# missing). Only those three parts are extracted. Usage: scripts/fetch_llama_cpp_converter.sh [python]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${1:-python}"
SDIST=llama_cpp_python-0.3.36
if [ ! -f .cache/llama.cpp/convert_hf_to_gguf.py ]; then
  mkdir -p .cache/sdist .cache/llama.cpp
  [ -f ".cache/sdist/$SDIST.tar.gz" ] || "$PYTHON" -m pip download --quiet --no-binary :all: --no-deps \
      --dest .cache/sdist "llama-cpp-python==0.3.36"
  tar -xzf ".cache/sdist/$SDIST.tar.gz" -C .cache/llama.cpp --strip-components=3 \
      "$SDIST/vendor/llama.cpp/convert_hf_to_gguf.py" "$SDIST/vendor/llama.cpp/conversion" \
      "$SDIST/vendor/llama.cpp/gguf-py"
fi
