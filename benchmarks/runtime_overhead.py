"""Runtime overhead: serving throughput at concurrency C vs the raw model's decode rate, in one run.

1. starts ``launch.py`` on a free 127.0.0.1 port and runs ``benchmarks/serving.py`` against it
   (short prompts, long outputs, ``ignore_eos``: the load is almost all decode);
2. stops the server and runs ``benchmarks/forward.py`` at batch C with the load's mean context
   length (input + output / 2), so both sides do the same attention work per step;
3. prints and writes JSON with both results and ``ratio = serving tok/s / raw tok/s``.

    python benchmarks/runtime_overhead.py --concurrency 32 --out benchmarks/results/overhead.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from harness.server import ServerProcess  # noqa: E402  (needs ROOT on sys.path)


def run_json(cmd: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([*cmd, "--out", out.name], check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())


def serving(args: argparse.Namespace) -> dict:
    server = ServerProcess("--max-num-seqs", str(max(args.concurrency, 1)), die_with_parent=True)
    try:
        server.start(timeout=300.0)
        result = run_json([sys.executable, str(ROOT / "benchmarks" / "serving.py"), "--port", str(server.port),
                           "--num-requests", str(args.num_requests), "--concurrency", str(args.concurrency),
                           "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                           "--warmup", "2"])
    finally:
        server.close(timeout=20.0)
    server.remove_log()  # only after success: a failed run keeps its log for whoever investigates
    return result


def raw_forward(args: argparse.Namespace) -> dict:
    context = args.input_len + args.output_len // 2
    return run_json([sys.executable, str(ROOT / "benchmarks" / "forward.py"), "--batch-sizes",
                     str(args.concurrency), "--context", str(context), "--steps", "24"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    served = serving(args)
    raw = raw_forward(args)
    raw_tps = raw["results"][0]["decode_tokens_per_s"]
    report = {
        "concurrency": args.concurrency,
        "serving_output_tokens_per_s": served["output_throughput_tps"],
        "serving_tpot_ms_p50": served["tpot_ms"]["p50"],
        "raw_decode_tokens_per_s": raw_tps,
        "raw_decode_step_ms_median": raw["results"][0]["decode_step_ms_median"],
        "raw_context": args.input_len + args.output_len // 2,
        "ratio": round(served["output_throughput_tps"] / raw_tps, 3),
        "serving": served,
        "raw": raw,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
