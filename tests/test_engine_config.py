"""The typed config is built once from the command line and envs.py, and nothing below it reads the CLI.

``build_engine_config`` must fill every sub-config (model, cache with its storage tier, scheduler,
parallel, server) from the flags and the environment; ``for_dp_rank`` makes the per-rank copies
launch.py hands to each engine. The ast check keeps raw ``EngineArgs`` reads (``x.args.y``) inside
``config/`` and launch.py.
"""
from __future__ import annotations

import argparse
import ast
import pickle
from pathlib import Path

import pytest

from config.engine_config import GIB, EngineArgs, EngineConfig, build_engine_config, kv_bytes_per_block
from scripts.make_tiny_moe import make_tiny_moe

REPO_ROOT = Path(__file__).resolve().parents[1]
# Only these may read what the user typed; everything else reads the typed sub-configs.
CLI_READERS = ("config", "launch.py")
PRODUCT = ("envs.py", "launch.py", "config", "inter_communicator", "cache_manager", "worker", "engine")


def from_cli(*argv: str) -> EngineConfig:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    return build_engine_config(EngineArgs.from_cli_args(parser.parse_args(list(argv))))


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("FD_INSTANCE_ID", "FD_API_KEY", "FD_NUM_THREADS", "FILE_BACKEND_STORAGE_DIR",
                 "FD_KVCACHE_STORAGE_NAMESPACE", "FD_KVCACHE_TRANSFER_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)


def test_cli_flags_land_in_the_typed_sub_configs(tmp_path: Path) -> None:
    config = from_cli("--port", "8123", "--host", "127.0.0.1", "--served-model-name", "tiny", "--api-key", "k1",
                      "--block-size", "32", "--num-gpu-blocks-override", "40", "--swap-space", "0.01",
                      "--no-enable-prefix-caching", "--write-policy", "write_back",
                      "--kvcache-storage-backend", "file", "--file-backend-storage-dir", str(tmp_path),
                      "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--max-model-len", "1024",
                      "--num-threads", "1")
    assert not hasattr(config, "args")
    assert config.server.host == "127.0.0.1" and config.server.port == 8123
    assert config.server.served_model_name == "tiny" and config.server.api_key == "k1"
    assert config.model.path.endswith(".gguf") and config.model.num_hidden_layers > 0

    cache = config.cache
    assert (cache.num_gpu_blocks, cache.block_size) == (40, 32)
    assert cache.num_cpu_blocks == int(0.01 * GIB // kv_bytes_per_block(config.model, 32)) > 0
    assert cache.enable_prefix_caching is False and cache.write_policy == "write_back"
    assert cache.model_fingerprint == config.model.model_fingerprint != ""
    assert cache.storage_enabled and cache.storage is not None
    assert cache.storage.backend == "file" and cache.storage.file_dir == str(tmp_path)

    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens,
            config.scheduler.max_model_len) == (8, 256, 1024)
    assert config.num_threads == 1 and config.instance_id == "p8123"
    # Every process receives the config through a spawn pickle.
    assert pickle.loads(pickle.dumps(config)) == config


def test_environment_fills_what_the_flags_leave_open(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FD_API_KEY", "from-env")
    monkeypatch.setenv("FD_INSTANCE_ID", "cfg-test")
    monkeypatch.setenv("FILE_BACKEND_STORAGE_DIR", str(tmp_path))
    monkeypatch.setenv("FD_KVCACHE_STORAGE_NAMESPACE", "ns1")
    monkeypatch.setenv("FD_KVCACHE_TRANSFER_TIMEOUT", "7.5")
    config = from_cli("--num-gpu-blocks-override", "16", "--kvcache-storage-backend", "file")
    assert config.server.api_key == "from-env" and config.instance_id == "cfg-test"
    assert config.cache.storage.file_dir == str(tmp_path) and config.cache.storage.namespace == "ns1"
    assert config.cache.transfer_timeout_s == 7.5


def test_no_storage_flag_means_no_storage_tier() -> None:
    config = from_cli("--num-gpu-blocks-override", "16")
    assert config.cache.storage is None and not config.cache.storage_enabled and config.cache.num_cpu_blocks == 0
    assert config.cache.enable_prefix_caching and config.cache.write_policy == "write_through"


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_moe(str(tmp_path_factory.mktemp("tiny_moe")), seed=0)


def test_parallel_layout_and_per_rank_copies(tiny_moe: str) -> None:
    config = from_cli("--model", tiny_moe, "--num-gpu-blocks-override", "16", "--data-parallel-size", "4",
                      "--nnodes", "2", "--node-rank", "1", "--enable-expert-parallel", "--master-addr", "127.0.0.1",
                      "--master-port", "29611", "--num-threads", "1")
    parallel = config.parallel
    assert (parallel.data_parallel_size, parallel.nnodes, parallel.node_rank) == (4, 2, 1)
    assert parallel.enable_expert_parallel and parallel.tensor_parallel_size == 1
    assert (parallel.master_addr, parallel.master_port) == ("127.0.0.1", 29611)
    assert list(parallel.local_dp_ranks) == [2, 3]

    rank3 = config.for_dp_rank(3)
    assert rank3.parallel.dp_rank == 3 and config.parallel.dp_rank == 0
    assert rank3.parallel.data_parallel_size == 4 and rank3.cache == config.cache and rank3.model is config.model


def test_one_node_picks_an_ep_port_once() -> None:
    config = from_cli("--num-gpu-blocks-override", "16")
    assert 0 < config.parallel.master_port < 65536
    assert config.for_dp_rank(1).parallel.master_port == config.parallel.master_port


def cli_reads(source: str) -> list[int]:
    """Lines of ``<expr>.args.<name>`` reads: raw command-line arguments reached through an object."""
    return sorted(node.lineno for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                  and node.value.attr == "args")


def test_nothing_below_the_config_reads_raw_cli_args() -> None:
    problems = []
    for name in PRODUCT:
        path = REPO_ROOT / name
        for file in ([path] if path.is_file() else sorted(path.rglob("*.py"))):
            relative = file.relative_to(REPO_ROOT)
            if relative.parts[0] in CLI_READERS:
                continue
            problems += [f"{relative}:{line}" for line in cli_reads(file.read_text())]
    assert problems == [], "reads of config.args.* outside config/ and launch.py:\n" + "\n".join(problems)


def test_the_cli_read_check_flags_args_and_spares_exception_args() -> None:
    assert cli_reads("def f(config):\n    return config.args.max_num_seqs\n") == [2]
    assert cli_reads("x = self.config.args.kvcache_storage_backend\n") == [1]
    assert cli_reads("try:\n    pass\nexcept OSError as exc:\n    code = exc.args[0]\n") == []
