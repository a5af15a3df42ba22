#!/usr/bin/env python3
"""Export the checkpoint fdserve serves as a float32 Hugging Face directory, for peer servers.

Owns the translation "what fdserve loads" -> "what transformers / vLLM load": the weights come
from ``worker.loader.load_weights`` (GGUF dequantisation and llama.cpp's Q/K row un-permute
included), so a peer server runs exactly the float32 weights fdserve runs. The directory holds
``model.safetensors`` (float32, Hugging Face names), ``config.json`` (``hf_config_dict``),
``generation_config.json`` and the tokenizer (``tokenizer.json`` + ``tokenizer_config.json``,
rebuilt from the GGUF vocabulary by ``engine.tokenizer``).

    python benchmarks/hf_export.py OUT_DIR [--model PATH]

The export is written next to OUT_DIR and renamed into place, so an interrupted export never
leaves a half-written directory that a later run would take for complete. An existing OUT_DIR
whose ``fdserve_export.json`` names the same source (path, size, mtime) is kept as it is.
Importable: ``export_hf_directory(out_dir, model_path=None) -> str``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    # Run as `python benchmarks/hf_export.py` from a checkout that is not pip-installed.
    sys.path.insert(0, REPO_ROOT)

from config.model_config import ModelConfig, default_model_path, hf_config_dict, load_model_config  # noqa: E402

logger = logging.getLogger(__name__)

MARKER_FILE = "fdserve_export.json"
WEIGHTS_FILE = "model.safetensors"


class ExportError(RuntimeError):
    """The source checkpoint cannot be exported (missing, or not a format the loader reads)."""


def source_identity(model_path: str) -> dict[str, Any]:
    """What identifies the source checkpoint: a changed file means a stale export."""
    stat = os.stat(model_path)
    return {"source": os.path.abspath(model_path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def is_current(out_dir: str, model_path: str) -> bool:
    """True when ``out_dir`` is a complete export of ``model_path`` as it is now."""
    marker = os.path.join(out_dir, MARKER_FILE)
    if not os.path.isfile(marker):
        return False
    with open(marker, encoding="utf-8") as handle:
        return json.load(handle) == source_identity(model_path)


def export_hf_directory(out_dir: str, model_path: str | None = None) -> str:
    """Write the float32 Hugging Face directory of ``model_path`` (default: fdserve's default model)."""
    model_path = model_path or default_model_path()
    if not os.path.exists(model_path):
        raise ExportError(f"model {model_path!r} does not exist")
    if is_current(out_dir, model_path):
        logger.info("%s is already an export of %s", out_dir, model_path)
        return out_dir
    config = load_model_config(model_path)
    staging = f"{out_dir.rstrip(os.sep)}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    _write_weights(config, os.path.join(staging, WEIGHTS_FILE))
    _write_json(os.path.join(staging, "config.json"), hf_config_dict(config))
    _write_json(os.path.join(staging, "generation_config.json"), _generation_config(config))
    _write_tokenizer(model_path, staging)
    _write_json(os.path.join(staging, MARKER_FILE), source_identity(model_path))
    shutil.rmtree(out_dir, ignore_errors=True)
    os.rename(staging, out_dir)
    logger.info("exported %s to %s", model_path, out_dir)
    return out_dir


def _write_weights(config: ModelConfig, path: str) -> None:
    from safetensors.numpy import save_file

    from worker.loader import load_weights

    weights = load_weights(config)
    if config.tie_word_embeddings:
        # Tied heads have no lm_head tensor in Hugging Face checkpoints; the loader never makes one either.
        weights.pop("lm_head.weight", None)
    save_file(weights, path, metadata={"format": "pt"})


def _generation_config(config: ModelConfig) -> dict[str, Any]:
    eos: int | list[int] = config.eos_token_ids[0] if len(config.eos_token_ids) == 1 else list(config.eos_token_ids)
    return {"bos_token_id": config.bos_token_id, "eos_token_id": eos, "do_sample": False}


def _write_tokenizer(model_path: str, out_dir: str) -> None:
    # The tiny-checkpoint script already knows how to save fdserve's tokenizer in HF layout.
    from scripts.make_tiny_moe import _write_tokenizer as write_hf_tokenizer

    from engine.tokenizer import load_tokenizer

    write_hf_tokenizer(out_dir, load_tokenizer(model_path))


def _write_json(path: str, body: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(body, handle, indent=2, sort_keys=True, ensure_ascii=False)
        handle.write("\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--model", default=None, help="a .gguf file or HF directory (default: fdserve's default model)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        print(export_hf_directory(args.out_dir, args.model))
    except (ExportError, FileNotFoundError, ValueError) as exc:
        logger.error("export failed: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
