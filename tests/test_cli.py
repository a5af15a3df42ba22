"""``python launch.py``'s command line as a user meets it: every flag's bad value is refused with one line.

The walk takes the flag list from ``launch.py --help`` itself, so a new flag without a bad-value case
here fails ``test_every_flag_in_help_has_a_bad_value_case``. Each case runs launch.py as a subprocess
(no server comes up: every refusal happens before anything is started) and checks what a user sees:
exit code 2, exactly one line on stderr naming the flag, nothing on stdout, no traceback.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from config.model_config import default_model_path
from harness.server import STOP_TIMEOUT_S, ServerProcess
from scripts.make_tiny_moe import make_tiny_moe

REPO_ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 60

# A free-looking port keeps a case that wrongly passes validation from colliding with a real server; none
# of these should get as far as binding it.
PORT = ("--port", "18997")


def run_launch(*argv: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {name: value for name, value in os.environ.items() if name != "MOONCAKE_MASTER_SERVER_ADDR"}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "launch.py", *argv], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=env)


@pytest.fixture(scope="module")
def help_text() -> str:
    result = run_launch("--help")
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Directories that are not models: empty, and one with config.json but no weights or tokenizer."""
    empty = tmp_path_factory.mktemp("empty_model")
    partial = tmp_path_factory.mktemp("partial_model")
    (partial / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    not_a_dir = tmp_path_factory.mktemp("storage") / "a_file"
    not_a_dir.write_text("")
    # A complete tiny checkpoint whose weights file then loses its tail (a download cut short).
    truncated = make_tiny_moe(str(tmp_path_factory.mktemp("truncated_model")), seed=0)
    weights = Path(truncated) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    truncated_gguf = tmp_path_factory.mktemp("truncated_gguf") / "model.gguf"
    with open(default_model_path(), "rb") as source:
        truncated_gguf.write_bytes(source.read(5_000_000))
    return {"empty": str(empty), "partial": str(partial), "file": str(not_a_dir), "truncated": truncated,
            "truncated_gguf": str(truncated_gguf)}


def help_flags(text: str) -> set[str]:
    """The long options listed in the options section of ``--help``."""
    options = text.split("options:", 1)[1]
    return {flag for flag in re.findall(r"(?m)^\s+(?:-\w, )?(--[a-z][a-z0-9-]*)", options)} | set(
        re.findall(r", (--no-[a-z0-9-]+)", options))


# flag -> (bad arguments, a fragment the one error line must contain besides the flag). The model
# directories are filled in from the model_dirs fixture ("{empty}" etc.).
BAD_VALUES: dict[str, tuple[tuple[str, ...], str]] = {
    "--model": (("--model", "{empty}"), "config.json"),
    "--host": (("--host", ""), "must not be empty"),
    "--port": (("--port", "99999"), "1..65535"),
    "--served-model-name": (("--served-model-name", " "), "must not be empty"),
    "--max-num-seqs": (("--max-num-seqs", "0"), "at least 1"),
    "--max-model-len": (("--max-model-len", "0"), "at least 1"),
    "--max-num-batched-tokens": (("--max-num-batched-tokens", "-4"), "at least 1"),
    "--lone-prefill-tokens": (("--lone-prefill-tokens", "-1"), ">= 0 (0: off)"),
    "--block-size": (("--block-size", "0"), "at least 1"),
    "--num-gpu-blocks-override": (("--num-gpu-blocks-override", "0"), "at least 1"),
    "--kv-cache-space": (("--kv-cache-space", "0"), "positive"),
    "--tensor-parallel-size": (("--tensor-parallel-size", "2"), "does not divide the model's 9 query heads"),
    "--num-threads": (("--num-threads", "0"), "at least 1"),
    "--api-key": (("--api-key", ""), "must not be empty"),
    "--enable-prefix-caching": (("--enable-prefix-caching=yes",), "ignored explicit argument"),
    "--no-enable-prefix-caching": (("--no-enable-prefix-caching=1",), "ignored explicit argument"),
    "--swap-space": (("--swap-space", "-1"), ">= 0"),
    "--kvcache-storage-backend": (("--kvcache-storage-backend", "s3"), "invalid choice"),
    "--write-policy": (("--write-policy", "write_back"), "--kvcache-storage-backend"),
    "--data-parallel-size": (("--data-parallel-size", "0"), "at least 1"),
    "--enable-expert-parallel": (("--enable-expert-parallel",), "mixture-of-experts"),
    "--nnodes": (("--nnodes", "0"), "at least 1"),
    "--node-rank": (("--node-rank", "1"), "[0, --nnodes=1)"),
    "--master-addr": (("--master-addr", ""), "must not be empty"),
    "--master-port": (("--master-port", "70000"), "1..65535"),
    "--file-backend-storage-dir": (("--file-backend-storage-dir", "/tmp"), "--kvcache-storage-backend file"),
    "--max-tokens-default": (("--max-tokens-default", "0"), "at least 1"),
    "--file-backend-max-bytes": (("--kvcache-storage-backend", "file", "--file-backend-max-bytes", "-1"), ">= 0"),
    "--dtype": (("--dtype", "float16"), "invalid choice"),
    "--splitwise-role": (("--splitwise-role", "both"), "invalid choice"),
    "--pd-host": (("--pd-host", " "), "must not be empty"),
}

# Further refusals: values of the right type that are still wrong, and combinations.
MORE_BAD_VALUES: list[tuple[str, tuple[str, ...], str]] = [
    ("--port", ("--port", "0"), "1..65535"),
    ("--port", ("--port", "eighty"), "invalid int value"),
    ("--max-model-len", ("--max-model-len", "-5"), "at least 1"),
    ("--max-model-len", ("--max-model-len", "100000"), "exceeds the model's context length 8192"),
    ("--max-model-len", ("--num-gpu-blocks-override", "2", "--block-size", "16", "--max-model-len", "64"),
     "fewer than --max-model-len 64"),
    ("--model", ("--model", "{partial}"), "*.safetensors"),
    ("--model", ("--model", "/nonexistent/model.gguf"), "does not exist"),
    ("--model", ("--model", "{file}"), "neither a .gguf file nor"),
    ("--model", ("--model", "{truncated}"), "incomplete metadata"),
    ("--model", ("--model", "{truncated_gguf}"), "cannot be read"),
    ("--kv-cache-space", ("--kv-cache-space", "nan"), "positive"),
    ("--kv-cache-space", ("--kv-cache-space", "100000"), "/dev/shm"),
    ("--kv-cache-space", ("--kv-cache-space", "0.5", "--num-gpu-blocks-override", "16"),
     "--num-gpu-blocks-override"),
    ("--swap-space", ("--swap-space", "inf"), ">= 0"),
    ("--num-gpu-blocks-override", ("--num-gpu-blocks-override", "100000000"), "/dev/shm"),
    ("--data-parallel-size", ("--data-parallel-size", "3", "--nnodes", "2"), "multiple of --nnodes"),
    ("--node-rank", ("--node-rank", "-1"), "[0, --nnodes=1)"),
    ("--file-backend-storage-dir", ("--kvcache-storage-backend", "file", "--file-backend-storage-dir", "{file}"),
     "not a directory"),
    ("--max-tokens-default", ("--max-model-len", "256", "--max-tokens-default", "256"), "no room for a prompt"),
    ("--kvcache-storage-backend", ("--kvcache-storage-backend", "mooncake"), "MOONCAKE_MASTER_SERVER_ADDR"),
    ("--file-backend-max-bytes", ("--file-backend-max-bytes", "1000000"), "--kvcache-storage-backend file"),
    ("--master-port", ("--master-port", "29555"), "only apply with --enable-expert-parallel"),
    ("--master-addr", ("--master-addr", "192.0.2.7"), "only apply with --enable-expert-parallel"),
    ("--splitwise-role", ("--splitwise-role", "decode", "--data-parallel-size", "2"), "--data-parallel-size > 1"),
    ("--splitwise-role", ("--splitwise-role", "prefill", "--no-enable-prefix-caching"), "needs the prefix cache"),
    ("--pd-host", ("--splitwise-role", "decode", "--pd-host", "0.0.0.0"), "wildcard"),
    ("--unknown-flag", ("--unknown-flag", "1"), "unrecognized arguments"),
]


def assert_one_line_refusal(result: subprocess.CompletedProcess[str], flag: str, fragment: str) -> None:
    shown = f"stdout={result.stdout!r}\nstderr={result.stderr!r}"
    assert result.returncode == 2, shown
    assert "Traceback" not in result.stderr + result.stdout, shown
    assert result.stdout == "", shown
    lines = result.stderr.splitlines()
    assert len(lines) == 1, shown
    assert lines[0].startswith("launch.py: error: "), shown
    assert flag in lines[0] and fragment in lines[0], shown


def test_every_flag_in_help_has_a_bad_value_case(help_text: str) -> None:
    flags = help_flags(help_text) - {"--help"}
    assert len(flags) >= 25, sorted(flags)  # the parse found the real list
    assert flags == set(BAD_VALUES), f"missing cases: {sorted(flags - set(BAD_VALUES))}, " \
                                     f"stale cases: {sorted(set(BAD_VALUES) - flags)}"


def test_help_shows_every_default(help_text: str) -> None:
    options = help_text.split("options:", 1)[1]
    # One entry per flag: a line starting with "  -" opens it; its help text runs to the next one.
    entries = re.split(r"\n(?=  -)", options.strip("\n"))
    missing = [entry.split()[0] for entry in entries
               if not entry.lstrip().startswith("-h") and "default" not in " ".join(entry.split())]
    assert missing == [], f"flags whose --help shows no default: {missing}"
    for shown in ("--max-num-seqs MAX_NUM_SEQS\n                        most requests running at once (default: 64)",
                  "(default: 512)", "tokens per KV-cache block (default: 64)", "(default: 1.0;", "(default: 0.0)"):
        assert shown in help_text


@pytest.mark.parametrize("flag", sorted(BAD_VALUES))
def test_bad_value_is_one_line_and_exit_2(flag: str, model_dirs: dict[str, str]) -> None:
    argv, fragment = BAD_VALUES[flag]
    result = run_launch(*PORT, *(arg.format(**model_dirs) for arg in argv))
    assert_one_line_refusal(result, flag.removeprefix("--no-") if flag.startswith("--no-") else flag, fragment)


@pytest.mark.parametrize(("flag", "argv", "fragment"), MORE_BAD_VALUES,
                         ids=[" ".join(argv) for _, argv, _ in MORE_BAD_VALUES])
def test_more_bad_values_and_combinations(flag: str, argv: tuple[str, ...], fragment: str,
                                          model_dirs: dict[str, str]) -> None:
    result = run_launch(*PORT, *(arg.format(**model_dirs) for arg in argv))
    assert_one_line_refusal(result, flag, fragment)


def test_busy_port_is_one_line_and_exit_2() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = run_launch("--port", str(port))
    assert_one_line_refusal(result, "--port", f"cannot bind 127.0.0.1:{port}: Address already in use")


@pytest.mark.parametrize(("name", "value"), [("FD_NUM_THREADS", "two"), ("FD_USE_KVCACHE_LOCK", "1"),
                                           ("FD_KVCACHE_TRANSFER_TIMEOUT", "soon"), ("FD_LOG_LEVEL", "loud")])
def test_bad_environment_variable_is_one_line_and_exit_2(name: str, value: str) -> None:
    result = run_launch(*PORT, "--max-model-len", "0", env_extra={name: value})
    if name == "FD_USE_KVCACHE_LOCK":  # a valid value: the flag error comes next, so the variable passed
        assert_one_line_refusal(result, "--max-model-len", "at least 1")
        return
    assert_one_line_refusal(result, name, f"{name}={value!r} is not a ")


def test_host_that_is_not_an_address_here_is_one_line_and_exit_2() -> None:
    # 192.0.2.1 (TEST-NET-1) is on no interface: bind() fails locally, nothing is sent anywhere.
    assert_one_line_refusal(run_launch(*PORT, "--host", "192.0.2.1"), "--host",
                            "cannot bind 192.0.2.1:18997: Cannot assign requested address")


# --- Paddle's start-up noise stays out of the server's output ---------------------------------------------

PADDLE_NOISE = ("No ccache found", "OMP_NUM_THREADS set to", "PLEASE USE OMP_NUM_THREADS WISELY")


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT_S, env={**os.environ, **env})


def test_plain_paddle_import_prints_the_notices_that_the_compute_env_removes() -> None:
    plain = run_python("import paddle", OMP_NUM_THREADS="2")
    assert plain.returncode == 0, plain.stderr
    # The source still speaks (paddle warns about ccache only where no ccache is installed).
    expected = [noise for noise in PADDLE_NOISE if noise != "No ccache found" or shutil.which("ccache") is None]
    assert all(noise in plain.stderr for noise in expected), plain.stderr

    quiet = run_python("import os, envs\nenvs.apply_compute_thread_env(2)\nimport paddle\n"
                       "print(os.environ['OMP_NUM_THREADS'], paddle.__version__)")
    assert quiet.returncode == 0, quiet.stderr
    assert not any(noise in quiet.stderr + quiet.stdout for noise in PADDLE_NOISE), quiet.stderr
    assert quiet.stdout.split()[0] == "2"  # the thread count the banner warned about is still set


def test_paddle_import_filter_passes_other_output_through(tmp_path: Path) -> None:
    # A stand-in paddle package that prints the banner, warns about ccache and prints one line of its own.
    fake = tmp_path / "paddle"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "import sys, warnings\n"
        "print('WARNING: OMP_NUM_THREADS set to 2, not 1. ...', file=sys.stderr)\n"
        "print('PLEASE USE OMP_NUM_THREADS WISELY.', file=sys.stderr)\n"
        "warnings.warn('No ccache found. Please be aware ...')\n"
        "print('paddle says something else', file=sys.stderr)\n")
    result = run_python("import envs\nenvs.apply_compute_thread_env(1)\nimport paddle\nprint(paddle.__file__)",
                        PYTHONPATH=f"{tmp_path}:{REPO_ROOT}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(fake / "__init__.py")
    assert result.stderr == "paddle says something else\n"


def test_sigterm_handler_survives_the_paddle_import() -> None:
    # Paddle's import installs a C++ SIGTERM handler that prints "FatalError: Termination signal" and
    # aborts; a worker's own handler (graceful shutdown) must still be the one that runs.
    result = run_python("import os, signal, time, envs\n"
                        "signal.signal(signal.SIGTERM, lambda *_: print('own handler', flush=True))\n"
                        "envs.apply_compute_thread_env(1)\n"
                        "os.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(0.2)\nprint('alive')")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["own", "handler", "alive"] and "FatalError" not in result.stderr


@pytest.mark.integration
def test_first_run_server_output_is_clean_and_max_tokens_default_caps_chat(tmp_path: Path) -> None:
    """One server, started as a user would (plus a small KV pool): its whole output, start to stop, has no
    Paddle notice and no traceback; --max-tokens-default caps a chat completion without max_tokens, while
    /v1/completions keeps OpenAI's default of 16."""
    log = tmp_path / "server.log"
    with ServerProcess("--num-gpu-blocks-override", "16", "--max-num-seqs", "4", "--max-tokens-default", "5",
                       log_path=log) as server:
        started = log.read_text()
        chat = httpx.post(server.base_url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Tell me a long story about a dragon."}],
            "temperature": 0, "ignore_eos": True}).json()
        completion = httpx.post(server.base_url + "/v1/completions", timeout=120, json={
            "prompt": "Once upon a time", "temperature": 0, "ignore_eos": True}).json()
        capped = httpx.post(server.base_url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Tell me a long story about a dragon."}],
            "temperature": 0, "ignore_eos": True, "max_tokens": 9}).json()
        # Stopped as systemd or `timeout` stop a service: SIGTERM to every process of the group at once.
        os.killpg(server.proc.pid, signal.SIGTERM)
        returncode = server.proc.wait(STOP_TIMEOUT_S)
    stopped = log.read_text()
    assert "worker ready" in started and "engine ready" in started  # the log holds every process's output
    for noise in PADDLE_NOISE:
        assert noise not in stopped, f"{noise!r} in the server's output:\n{stopped}"
    assert "Traceback" not in stopped and "FatalError" not in stopped, stopped
    assert "worker exited (rank 0, code 0)" in stopped, stopped  # its own shutdown ran, not paddle's abort
    assert returncode == 0 and server.leftovers == [], stopped

    assert chat["usage"]["completion_tokens"] == 5 and chat["choices"][0]["finish_reason"] == "length", chat
    assert completion["usage"]["completion_tokens"] == 16, completion
    assert capped["usage"]["completion_tokens"] == 9, capped  # the flag is a default, not a limit
