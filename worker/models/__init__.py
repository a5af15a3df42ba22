"""Model registry: architecture name (``ModelConfig.architecture``) -> model class.

Classes are imported on lookup, so importing this package does not import paddle.
"""
from __future__ import annotations

import importlib
import logging

logger = logging.getLogger(__name__)

# architecture -> (module, class name)
_REGISTRY: dict[str, tuple[str, str]] = {
    "llama": ("worker.models.llama", "LlamaForCausalLM"),
    "qwen2": ("worker.models.llama", "LlamaForCausalLM"),
    "qwen3": ("worker.models.llama", "LlamaForCausalLM"),
    "qwen3_moe": ("worker.models.moe", "MoEForCausalLM"),
    "qwen2_moe": ("worker.models.moe", "MoEForCausalLM"),
}


def supported_architectures() -> list[str]:
    """Architecture names a model class is registered for."""
    return sorted(_REGISTRY)


def get_model_class(architecture: str) -> type:
    """The model class implementing ``architecture``; ValueError naming it if none does."""
    if architecture not in _REGISTRY:
        raise ValueError(
            f"no model implementation for architecture {architecture!r}; "
            f"supported: {', '.join(supported_architectures())}"
        )
    module_name, class_name = _REGISTRY[architecture]
    return getattr(importlib.import_module(module_name), class_name)
