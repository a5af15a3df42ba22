"""Imports run one way (ARCHITECTURE.md, "Layers"): each package imports only its own floor and the ones below.

From the floor up: ``envs`` -> ``config`` (typed config, sampling parameters, logging set-up) ->
``inter_communicator`` (shared memory, signals, the lock, messages; no process role) -> ``cache_manager`` ->
``worker`` -> ``engine`` (engine process, scheduler) -> ``engine.entrypoints`` (the API server) -> ``launch``.
Every import counts, also those inside functions: a lazy import that runs the wrong way still ties a lower
layer to a higher one. Benchmarks and scripts may use the product but never the tests.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# Most specific prefix first: engine.entrypoints sits above the rest of engine.
LAYERS: list[tuple[str, int]] = [
    ("envs", 0),
    ("config", 1),
    ("inter_communicator", 2),
    ("cache_manager", 3),
    ("worker", 4),
    ("engine.entrypoints", 6),
    ("engine", 5),
    ("launch", 7),
    ("router", 7),
]
PRODUCT_DIRS = ("config", "inter_communicator", "cache_manager", "worker", "engine", "router")
TOOL_DIRS = ("benchmarks", "scripts")


def layer_of(module: str) -> int | None:
    """The floor of a dotted module name, or None for a module outside the product (numpy, stdlib...)."""
    for prefix, level in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return level
    return None


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source``, relative imports resolved."""
    found: list[tuple[int, str]] = []
    package = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            # `from engine import entrypoints` imports the submodule: judge the deepest name.
            found.extend((node.lineno, f"{target}.{alias.name}") for alias in node.names
                         if layer_of(f"{target}.{alias.name}") != layer_of(target))
    return found


def wrong_way_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    own = layer_of(module)
    if own is None:
        return []
    return [f"{module}:{line} imports {target}" for line, target in imported_modules(source, module, is_package)
            if (level := layer_of(target)) is not None and level > own]


def product_files() -> list[Path]:
    files = [REPO_ROOT / "envs.py", REPO_ROOT / "launch.py"]
    for name in PRODUCT_DIRS:
        files.extend(sorted((REPO_ROOT / name).rglob("*.py")))
    return [f for f in files if f.exists()]


def test_every_product_import_runs_down_the_layers():
    problems = []
    for path in product_files():
        problems += wrong_way_imports(path.read_text(), module_name(path), path.name == "__init__.py")
    assert problems == [], "imports running up the layers:\n" + "\n".join(problems)


def test_benchmarks_and_scripts_do_not_import_tests():
    problems = []
    for name in TOOL_DIRS:
        for path in sorted((REPO_ROOT / name).rglob("*.py")):
            for line, target in imported_modules(path.read_text(), module_name(path)):
                if target == "tests" or target.startswith("tests."):
                    problems.append(f"{path.relative_to(REPO_ROOT)}:{line} imports {target}")
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("module,source", [
    ("inter_communicator.messages", "from engine.request import RequestOutput\n"),
    ("worker.sampler", "def f():\n    import engine.scheduler\n"),
    ("cache_manager.prefix_cache_manager", "from engine.sequence import Sequence\n"),
    ("engine.scheduler", "from engine.entrypoints import api_server\n"),
    ("engine.scheduler", "from .entrypoints.protocol import ChatCompletionRequest\n"),
    ("config.engine_config", "from worker.model_config import ModelConfig\n"),
])
def test_the_checker_catches_a_wrong_way_import(module, source):
    assert wrong_way_imports(source, module), f"{module}: {source!r} was not flagged"


@pytest.mark.parametrize("module,source", [
    ("engine.entrypoints.api_server", "from engine.request import RequestOutput\nimport numpy\n"),
    ("worker.model_runner", "from cache_manager.kv_layout import kv_block_shape\n"),
    ("inter_communicator.messages", "from config.sampling_params import SamplingParams\n"),
    ("launch", "from engine.entrypoints.api_server import build_app\n"),
])
def test_the_checker_accepts_a_downward_import(module, source):
    assert wrong_way_imports(source, module) == []
