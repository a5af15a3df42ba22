"""Tensor parallelism below the processes: the flag's checks, the per-rank KV layout, the storage keys of
shards, and the clean-up of a dead group's all-reduce objects (no server started)."""
from __future__ import annotations

import argparse
import os
import uuid
from types import SimpleNamespace

import pytest

import envs
from cache_manager.kv_layout import block_shape, device_cache_shape, host_cache_shape, shard_storage_keys, storage_key
from config.engine_config import ConfigError, EngineArgs, EngineConfig, build_engine_config
from inter_communicator.allreduce import ShmAllReduceGroup, unlink_group_objects
from scripts.make_tiny_dense import make_tiny_dense
from scripts.make_tiny_moe import make_tiny_moe


def from_cli(*argv: str) -> EngineConfig:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    return build_engine_config(EngineArgs.from_cli_args(parser.parse_args(list(argv))))


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("FD_INSTANCE_ID", "FD_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)


def test_tp_size_is_accepted_where_the_heads_divide_and_splits_the_cores(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(envs, "available_cores", lambda: 8)
    config = from_cli("--tensor-parallel-size", "3", "--num-gpu-blocks-override", "16")
    assert config.parallel.tensor_parallel_size == 3 and config.cache.tp_size == 3
    assert config.num_threads == 2  # 8 cores over 3 workers
    tiny = make_tiny_dense(str(tmp_path / "dense"), with_tokenizer=True)
    config = from_cli("--model", tiny, "--tensor-parallel-size", "2", "--data-parallel-size", "2",
                      "--num-gpu-blocks-override", "16")
    assert config.num_threads == 2  # 8 cores over 2 DP x 2 TP workers


def test_tp_size_is_refused_with_the_counts_for_heads_moe_and_ep(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 2: .*9 query heads and 3 KV heads"):
        from_cli("--tensor-parallel-size", "2", "--num-gpu-blocks-override", "16")
    moe = make_tiny_moe(str(tmp_path / "moe"))
    with pytest.raises(ConfigError, match="MoE models"):
        from_cli("--model", moe, "--tensor-parallel-size", "2", "--num-gpu-blocks-override", "16")
    with pytest.raises(ConfigError, match="--enable-expert-parallel is not supported"):
        from_cli("--model", moe, "--tensor-parallel-size", "2", "--enable-expert-parallel",
                 "--data-parallel-size", "2", "--num-gpu-blocks-override", "16")


def test_each_rank_holds_its_kv_heads_and_its_own_storage_object() -> None:
    model = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=4, head_dim=8)
    assert device_cache_shape(model, 10, 16, tp_size=2) == (2, 2, 10, 2, 16, 8)
    assert host_cache_shape(model, 5, 16, tp_size=4) == (5, 2, 2, 1, 16, 8)
    assert block_shape(model, 16) == (2, 2, 4, 16, 8)
    with pytest.raises(ValueError, match="do not split over 3"):
        device_cache_shape(model, 10, 16, tp_size=3)
    # TP=1 keeps the historical key; a shard's key names its rank and the split, so another TP size never
    # reads it as its own.
    assert storage_key("fp", "h", 0) == "fphm_h_tp0"
    key0 = storage_key("fp", "h", 0, tp_size=2)
    assert shard_storage_keys(key0, 2) == [key0, storage_key("fp", "h", 1, tp_size=2)] == ["fphm_h_tp0of2",
                                                                                          "fphm_h_tp1of2"]
    assert shard_storage_keys(storage_key("fp", "h", 0), 1) == ["fphm_h_tp0"]
    with pytest.raises(ValueError, match="not a rank-0 key"):
        shard_storage_keys("fphm_h_tp0", 2)


def test_a_dead_groups_objects_are_removed_so_a_new_group_can_be_created() -> None:
    instance = "ttpc" + uuid.uuid4().hex[:8]
    group = ShmAllReduceGroup(instance, 3, capacity=16)
    try:
        # As if the creator was SIGKILLed: the objects stay; a new creator must clear them first.
        with pytest.raises(Exception):
            ShmAllReduceGroup(instance, 3, capacity=16)
        removed = unlink_group_objects(instance, 3)
        assert len(removed) == 3 + 6  # data, head, pids; one semaphore per ordered pair
        ShmAllReduceGroup(instance, 3, capacity=16).close()
    finally:
        group.close()
    assert not [name for name in os.listdir("/dev/shm") if f"fd.{instance}." in name]
