"""Expert parallelism across two DP ranks' worker processes (gloo on CPU), on a tiny random MoE.

The test plays launch.py + two engines: it creates each rank's instance signals, binds each
rank's batch/result sockets, spawns ``run_worker`` once per rank (``dp_size`` 2, expert
parallelism on, a free rendezvous port) and drives them with StepBatches: prefill, then
greedy decode steps, including rounds in which only one rank has work. The greedy tokens must
equal those of one non-EP worker serving the same prompts. It also checks the lockstep
loop's lifetime rules: idle ranks do not spin, a shutdown sent to one rank stops both, and a
killed rank makes the other exit with an error instead of hanging in a collective.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest
import zmq

import envs

envs.apply_compute_thread_env(2)

from config.engine_config import EngineArgs, EngineConfig, build_engine_config  # noqa: E402
from config.sampling_params import SamplingParams  # noqa: E402
from engine.engine_process import EngineAddresses  # noqa: E402
from harness.server import free_port  # noqa: E402
from inter_communicator.instance_signals import InstanceSignals  # noqa: E402
from inter_communicator.messages import ScheduledSeq, StepBatch, StepResult, WorkerShutdown  # noqa: E402
from inter_communicator.shm import sweep_stale, unlink_created  # noqa: E402
from tests.test_moe_model import TINY, make_tiny_moe  # noqa: E402
from worker.expert_parallel import expert_owners, shard_experts  # noqa: E402
from worker.model_runner import kv_cache_segment_name  # noqa: E402
from worker.worker_process import EP_FAILURE_EXIT_CODE, run_worker  # noqa: E402

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
SHM_DIR = Path("/dev/shm")
START_TIMEOUT_S = 120.0  # spawn + paddle import + model load of two ranks on a loaded 2-core machine
REPLY_TIMEOUT_S = 60.0
EXIT_TIMEOUT_S = 30.0
BLOCK_SIZE = 16
NUM_BLOCKS = 24  # per rank: 3 sequences x 4 blocks, plus room
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
# Rank 0 starts first and stops first, so rounds at both ends have work on one rank only.
RANK_START_ROUND = (0, 2)
RANK_NEW_TOKENS = (5, 8)
PROMPTS_PER_RANK = 3

pytestmark = pytest.mark.integration  # spawns worker processes


# ---- harness ------------------------------------------------------------------------------------


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    # utime and stime are fields 14 and 15; the text after ")" starts at field 3.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class RankWorker:
    """What launch.py and one engine own for a worker: signals, sockets, the process."""

    def __init__(self, config: EngineConfig, ipc_dir: Path) -> None:
        self.config = config
        self.rank = config.parallel.dp_rank
        self.signals = InstanceSignals(config, create=True)
        self.context = zmq.Context()
        self.batch_socket = self.context.socket(zmq.PUSH)
        self.result_socket = self.context.socket(zmq.PULL)
        addresses = EngineAddresses.in_dir(str(ipc_dir), self.rank)  # the engine's own socket names
        self.batch_addr, self.result_addr = addresses.batches, addresses.results
        self.batch_socket.bind(self.batch_addr)
        self.result_socket.bind(self.result_addr)
        self.proc: multiprocessing.process.BaseProcess | None = None
        self.step_seconds: list[float] = []

    def start(self) -> None:
        spawn = multiprocessing.get_context("spawn")
        self.proc = spawn.Process(target=run_worker, name=f"test-ep-worker-{self.rank}",
                                  args=(self.config, 0, self.batch_addr, self.result_addr))
        self.proc.start()

    @property
    def ready(self) -> bool:
        return self.signals.worker_ready.value[0] == 1

    def send(self, message: object) -> None:
        self.batch_socket.send_pyobj(message)

    def recv(self) -> StepResult:
        if not self.result_socket.poll(int(REPLY_TIMEOUT_S * 1000)):
            raise TimeoutError(f"rank {self.rank}: no StepResult within {REPLY_TIMEOUT_S:.0f} s "
                               f"(worker alive: {self.proc.is_alive()})")
        result = self.result_socket.recv_pyobj()
        self.step_seconds.append(result.execute_seconds)
        return result

    def kv_segment_exists(self) -> bool:
        return (SHM_DIR / kv_cache_segment_name(self.config, 0)).exists()

    def close(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            try:
                self.batch_socket.send_pyobj(WorkerShutdown("test teardown"), flags=zmq.NOBLOCK)
            except zmq.Again:
                logger.warning("rank %d: could not queue a shutdown; killing the worker", self.rank)
            self.proc.join(EXIT_TIMEOUT_S)
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
            self.proc.join(EXIT_TIMEOUT_S)
        self.batch_socket.close(linger=0)
        self.result_socket.close(linger=0)
        self.context.term()
        self.signals.close()


class Cluster:
    """The worker processes of one test server, started together and always cleaned up."""

    def __init__(self, configs: list[EngineConfig], ipc_dir: Path) -> None:
        self.instance_id = configs[0].instance_id
        sweep_stale(self.instance_id)
        self.workers: list[RankWorker] = []
        try:
            for config in configs:
                self.workers.append(RankWorker(config, ipc_dir))
        except BaseException:
            self.close()
            raise

    def start(self) -> None:
        for worker in self.workers:
            worker.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(worker.ready for worker in self.workers):
            for worker in self.workers:
                if not worker.proc.is_alive():
                    raise RuntimeError(f"rank {worker.rank} died at start-up (exit code {worker.proc.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers not ready after {START_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
        unlink_created()
        sweep_stale(self.instance_id)  # the KV segment of a killed worker


@dataclasses.dataclass
class Sequence:
    request_id: str
    prompt: list[int]
    block_table: list[int]
    new_tokens: int
    output: list[int] = dataclasses.field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.output) >= self.new_tokens

    def scheduled(self) -> ScheduledSeq:
        if not self.output:
            return ScheduledSeq(self.request_id, list(self.prompt), len(self.prompt), self.block_table, True,
                                GREEDY, 0)
        return ScheduledSeq(self.request_id, [self.output[-1]], len(self.prompt) + len(self.output),
                            self.block_table, True, GREEDY, len(self.output))


def _batch(step_id: int, seqs: list[Sequence]) -> StepBatch | None:
    """Decodes first, then prefills (the engine's order); None when nothing is left."""
    active = [seq for seq in seqs if not seq.done]
    if not active:
        return None
    ordered = [seq for seq in active if seq.output] + [seq for seq in active if not seq.output]
    return StepBatch(step_id, [seq.scheduled() for seq in ordered])


def _sequences(prompts: list[list[int]], names: list[str], new_tokens: int) -> list[Sequence]:
    blocks_each = NUM_BLOCKS // len(prompts)
    seqs = []
    for index, (name, prompt) in enumerate(zip(names, prompts)):
        table = list(range(index * blocks_each, (index + 1) * blocks_each))[::-1]  # scattered, not in order
        if len(table) * BLOCK_SIZE < len(prompt) + new_tokens:
            raise ValueError(f"{name}: {len(table)} blocks cannot hold {len(prompt) + new_tokens} tokens")
        seqs.append(Sequence(name, prompt, table, new_tokens))
    return seqs


def _drive(workers: list[RankWorker], seqs_per_rank: list[list[Sequence]], start_rounds: tuple[int, ...]) -> int:
    """Run rounds until every sequence is done: each rank with work gets a batch, then the results."""
    step_id = 0
    rounds = 0
    while any(not seq.done for seqs in seqs_per_rank for seq in seqs):
        waiting = []
        for worker, seqs, start in zip(workers, seqs_per_rank, start_rounds):
            batch = _batch(step_id, seqs) if rounds >= start else None
            if batch is not None:
                worker.send(batch)
                waiting.append((worker, seqs, step_id))
                step_id += 1
        for worker, seqs, sent_step in waiting:
            result = worker.recv()
            if result.step_id != sent_step or result.errors:
                raise AssertionError(f"rank {worker.rank}: step {sent_step} returned {result}")
            for seq in seqs:
                if seq.request_id in result.sampled_token_ids and not seq.done:
                    seq.output.append(result.sampled_token_ids[seq.request_id])
        rounds += 1
        if rounds > 100:
            raise AssertionError("the schedule did not finish in 100 rounds")
    return rounds


# ---- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts(reference: list[dict]) -> list[list[int]]:
    return [entry["prompt_ids"] for entry in reference][: 2 * PROMPTS_PER_RANK]


@pytest.fixture(scope="module")
def base_config(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    model_dir = make_tiny_moe(str(tmp_path_factory.mktemp("tiny_moe")), seed=0, **TINY)
    return build_engine_config(EngineArgs(model=model_dir, block_size=BLOCK_SIZE, num_gpu_blocks_override=NUM_BLOCKS,
                                          max_model_len=NUM_BLOCKS * BLOCK_SIZE, num_threads=1,
                                          data_parallel_size=2, enable_expert_parallel=True))


def _ep_configs(base: EngineConfig) -> list[EngineConfig]:
    instance_id = f"ep-{uuid.uuid4().hex[:10]}"
    port = free_port()
    config = dataclasses.replace(base, instance_id=instance_id,
                                 parallel=dataclasses.replace(base.parallel, data_parallel_size=2, master_port=port))
    return [config.for_dp_rank(rank) for rank in range(2)]


@pytest.fixture
def ep_pair(base_config: EngineConfig, tmp_path: Path) -> Iterator[Cluster]:
    cluster = Cluster(_ep_configs(base_config), tmp_path)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def single_reference(base_config: EngineConfig, prompts: list[list[int]],
                     tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, list[int]], list[float]]:
    """Greedy outputs of one non-EP worker serving all prompts, and its step times."""
    parallel = dataclasses.replace(base_config.parallel, data_parallel_size=1, dp_rank=0,
                                   enable_expert_parallel=False)
    config = dataclasses.replace(base_config, parallel=parallel, instance_id=f"ep1-{uuid.uuid4().hex[:10]}")
    cluster = Cluster([config], tmp_path_factory.mktemp("ipc-single"))
    try:
        cluster.start()
        seqs = _sequences(prompts, [f"r{rank}-{i}" for rank in range(2) for i in range(PROMPTS_PER_RANK)],
                          max(RANK_NEW_TOKENS))
        for seq in seqs:
            seq.new_tokens = RANK_NEW_TOKENS[int(seq.request_id[1])]
        _drive(cluster.workers, [seqs], (0,))
        return {seq.request_id: seq.output for seq in seqs}, cluster.workers[0].step_seconds
    finally:
        cluster.close()


# ---- tests --------------------------------------------------------------------------------------


def test_expert_shards_cover_every_expert_once() -> None:
    assert shard_experts(8, 2, 0) == [0, 1, 2, 3] and shard_experts(8, 2, 1) == [4, 5, 6, 7]
    assert [shard_experts(5, 3, rank) for rank in range(3)] == [[0, 1], [2, 3], [4]]
    assert [shard_experts(5, 2, rank, "round_robin") for rank in range(2)] == [[0, 2, 4], [1, 3]]
    assert shard_experts(2, 3, 2) == []
    assert expert_owners(5, 3).tolist() == [0, 0, 1, 1, 2]
    with pytest.raises(ValueError, match="outside"):
        shard_experts(4, 2, 2)
    with pytest.raises(ValueError, match="layout"):
        shard_experts(4, 2, 0, "striped")


def test_dp_ep_greedy_equals_single_worker_and_stops_together(
        ep_pair: Cluster, single_reference: tuple[dict[str, list[int]], list[float]],
        prompts: list[list[int]]) -> None:
    expected, single_seconds = single_reference
    workers = ep_pair.workers

    # Idle: the lockstep loop backs off instead of spinning, and heartbeats keep coming.
    cpu_before = [_cpu_seconds(worker.proc.pid) for worker in workers]
    beats_before = [float(worker.signals.worker_heartbeat.value[0]) for worker in workers]
    time.sleep(2.0)
    idle_cpu = [_cpu_seconds(worker.proc.pid) - before for worker, before in zip(workers, cpu_before)]
    assert all(cpu < 0.5 for cpu in idle_cpu), f"idle EP workers used {idle_cpu} CPU seconds in 2 s"
    assert all(float(worker.signals.worker_heartbeat.value[0]) > before + 1.0
               for worker, before in zip(workers, beats_before))

    seqs_per_rank = [
        _sequences(prompts[rank * PROMPTS_PER_RANK:(rank + 1) * PROMPTS_PER_RANK],
                   [f"r{rank}-{i}" for i in range(PROMPTS_PER_RANK)], RANK_NEW_TOKENS[rank])
        for rank in range(2)
    ]
    rounds = _drive(workers, seqs_per_rank, RANK_START_ROUND)
    # Rank 0 alone for two rounds at the start, rank 1 alone for the last rounds.
    assert rounds == RANK_START_ROUND[1] + RANK_NEW_TOKENS[1]
    for seqs in seqs_per_rank:
        for seq in seqs:
            assert seq.output == expected[seq.request_id], seq.request_id
    outputs = [seq.output for seqs in seqs_per_rank for seq in seqs]
    assert len({tuple(output) for output in outputs}) == len(outputs), "prompts must give distinct outputs"
    logger.info("step seconds: single worker %s; EP rank 0 %s; EP rank 1 %s",
                [round(s, 4) for s in single_seconds], [round(s, 4) for s in workers[0].step_seconds],
                [round(s, 4) for s in workers[1].step_seconds])

    # A batch one rank cannot run (block table too short) fails its request there; that rank still
    # joins the round's collectives (dummy forward), so the other rank's prefill completes correctly.
    bad = ScheduledSeq("bad", list(prompts[0]), len(prompts[0]), [0], True, GREEDY, 0)
    again = Sequence("again", prompts[PROMPTS_PER_RANK], list(range(NUM_BLOCKS // 2)), 1)
    workers[0].send(StepBatch(100, [bad]))
    workers[1].send(StepBatch(101, [again.scheduled()]))
    bad_result, good_result = workers[0].recv(), workers[1].recv()
    assert "blocks" in bad_result.errors["bad"] and not bad_result.sampled_token_ids
    assert good_result.sampled_token_ids == {"again": expected["r1-0"][0]} and not good_result.errors

    # A shutdown sent to rank 1 only stops both ranks, cleanly.
    workers[1].send(WorkerShutdown("test: coordinated stop"))
    for worker in workers:
        worker.proc.join(EXIT_TIMEOUT_S)
        assert worker.proc.exitcode == 0, f"rank {worker.rank} exit code {worker.proc.exitcode}"
        assert not worker.kv_segment_exists()
        assert worker.signals.worker_ready.value[0] == 0


def test_killed_rank_makes_the_other_exit_with_an_error(ep_pair: Cluster) -> None:
    survivor, victim = ep_pair.workers
    time.sleep(0.5)  # both in the idle lockstep loop
    os.kill(victim.proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    survivor.proc.join(EXIT_TIMEOUT_S)
    assert not survivor.proc.is_alive(), f"rank 0 still running {EXIT_TIMEOUT_S:.0f} s after its peer was killed"
    assert survivor.proc.exitcode == EP_FAILURE_EXIT_CODE
    logger.info("rank 0 exited %.2f s after rank 1 was killed", time.monotonic() - killed_at)
    assert not survivor.kv_segment_exists()  # it still cleaned up
