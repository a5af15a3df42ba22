"""What the model-only benchmarks (forward.py, profile_step.py) share: their common flags, loading the
model in a process set up like a worker (thread variables before paddle, the worker's malloc tuning),
a KV cache with contiguous block tables, and writing the JSON report.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import dataclass, replace
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import envs  # noqa: E402


def add_model_arguments(parser: argparse.ArgumentParser, steps: int, steps_help: str) -> None:
    """The flags every model-only benchmark takes."""
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M GGUF)")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens prefilled per sequence")
    parser.add_argument("--steps", type=int, default=steps, help=steps_help)
    parser.add_argument("--warmup", type=int, default=2, help="untimed decode steps before timing")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="compute threads (0: FD_NUM_THREADS or all cores)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="linear-layer weights (as the server's --dtype)")
    parser.add_argument("--out", default=None, help="also write the JSON result to this file")


@dataclass
class LoadedModel:
    model: Any  # the registered model class's instance, weights loaded
    config: Any  # config.model_config.ModelConfig
    threads: int


def load_model(args: argparse.Namespace) -> LoadedModel:
    """Set this process up as a worker is set up, then load ``args.model`` (or the default model)."""
    logging.basicConfig(level=envs.FD_LOG_LEVEL, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    threads = args.threads or envs.FD_NUM_THREADS or envs.available_cores()
    envs.apply_compute_thread_env(threads)  # before paddle is imported, below
    # The worker keeps freed activation buffers in the heap; without that every step page-faults them in.
    from worker.worker_process import tune_malloc

    tune_malloc()
    from worker.loader import load_weights
    from config.model_config import default_model_path, load_model_config
    from worker.models import get_model_class

    config = load_model_config(args.model or default_model_path())
    config = replace(config, dtype=getattr(args, "dtype", "float32"))
    model = get_model_class(config.architecture)(config)
    model.load_weights(load_weights(config))
    return LoadedModel(model, config, threads)


def contiguous_cache(config: Any, batch_size: int, total_len: int, block_size: int) -> tuple[list, list[list[int]]]:
    """(per-layer KV cache views, block tables) for ``batch_size`` sequences of up to ``total_len`` tokens."""
    import numpy as np

    from cache_manager.kv_layout import device_cache_shape
    from worker.attention import kv_cache_views

    blocks_per_seq = -(-total_len // block_size)
    cache = np.zeros(device_cache_shape(config, batch_size * blocks_per_seq, block_size), dtype=np.float32)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch_size)]
    return kv_cache_views(cache), tables


def write_report(report: dict[str, Any], out: str | None) -> None:
    """The report as JSON on stdout and, if ``out`` is set, in that file."""
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        with open(out, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
