"""fdserve: a multi-process LLM inference runtime on PaddlePaddle.

CPU hosts get ``paddlepaddle`` from the requirements below. On a CUDA host,
install ``paddlepaddle-gpu`` (the build matching your CUDA) first and then this
package with ``pip install --no-deps -e .`` plus the other requirements, so pip
does not pull the CPU wheel over it (see README).
"""
from setuptools import setup

setup(
    name="fdserve",
    version="0.1.0",
    description="Multi-process LLM inference runtime on PaddlePaddle with an OpenAI-compatible API",
    python_requires=">=3.10",
    packages=[
        "config",
        "engine",
        "engine.entrypoints",
        "worker",
        "worker.models",
        "worker.kernels",
        "cache_manager",
        "cache_manager.transfer_factory",
        "inter_communicator",
        "router",
    ],
    py_modules=["envs", "launch"],
    # The native kernels are compiled from these sources on first use (worker/kernels/build.py).
    package_data={"worker.kernels": ["*.cc", "*.h"]},
    install_requires=[
        "paddlepaddle>=3.0",
        "numpy",
        "pyzmq",
        "posix_ipc",
        "gguf",
        "tokenizers",
        "safetensors",
        "jinja2",
        "fastapi",
        "uvicorn",
        "pydantic>=2",
        "tqdm",
        "prometheus-client",
        "httpx",  # the router's backend calls (python -m router)
        "llguidance>=1.0",  # structured output: token masks from JSON schemas, regexes and grammars
    ],
    extras_require={
        # lm-eval + transformers (tokenizer only; no torch): tests/test_eval_harness.py runs EleutherAI's
        # harness against a real server. Measured: ~21 s to install over the other test deps, ~40 s and
        # ~930 MB in an empty venv.
        "test": ["pytest", "pytest-timeout", "openai", "httpx", "aiohttp", "hypothesis", "pyyaml",
                 "lm-eval[api]==0.4.13", "transformers", "jsonschema"],
        "bench": ["aiohttp"],
    },
    entry_points={"console_scripts": ["fdserve=launch:main"]},
)
