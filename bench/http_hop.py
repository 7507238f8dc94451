"""What one `/generate` costs over HTTP in two checkouts of radixserve, side by side: each
runs its own `radixserve serve` (the tiny random model of the tests, on the CPU), and
rounds alternate between them so that a change in the machine's load hits both.

Each round sends `requests` sequential one-token requests (greedy, a cached 8-token
prompt: the smallest forward step) over one kept-alive connection, and the same through
the RPC client (the floor both HTTP paths stand on). Medians per round; the report gives
the median of the rounds' medians.

    git archive BASE radixserve | tar -x -C /tmp/base   # the checkout to compare with
    python bench/http_hop.py --a /tmp/base --b .        # about two minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
PARAMS = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}
PROMPT = [1, 422, 3575, 282, 4649, 314, 253, 1345]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`radixserve serve` from the checkout at `tree` (its `radixserve/` first on the path)."""

    def __init__(self, tree: Path, model: str, log: Path) -> None:
        self.port, self.rpc_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONPATH=str(tree.resolve()))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "radixserve", "serve", "--model", model, "--device", "cpu",
             "--port", str(self.port), "--rpc-port", str(self.rpc_port),
             "--cache-events-port", "0"],
            env=env, cwd=tree, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
        deadline = time.monotonic() + 1800  # a checkout builds its native kernels once
        while True:
            try:
                if httpx.get(self.url + "/health").json()["status"] == "ok":
                    return
            except (httpx.HTTPError, json.JSONDecodeError):
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server of {tree} did not start: {log.read_text()}")
            time.sleep(0.5)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def median_ms(call, n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--a", type=Path, required=True, help="a checkout (the baseline)")
    parser.add_argument("--b", type=Path, required=True, help="the checkout to compare")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--out", type=Path, help="write the table here (markdown)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from radixserve.client import Client
    from tests.factories import tiny_model_dir

    model = str(tiny_model_dir(Path(tempfile.gettempdir()) / "radixserve-trace"))
    body = {"input_ids": PROMPT, "sampling_params": PARAMS}
    rows: dict[str, list[float]] = {f"{n}_{p}": [] for n in "ab" for p in ("http", "rpc")}
    with tempfile.TemporaryDirectory() as tmp:
        servers: dict[str, Server] = {}
        try:
            for name, tree in (("a", args.a), ("b", args.b)):
                servers[name] = Server(tree, model, Path(tmp) / f"{name}.log")
            paths = {}
            for name, server in servers.items():
                http = httpx.Client(base_url=server.url, timeout=60)
                rpc = Client(f"tcp://127.0.0.1:{server.rpc_port}")
                paths[f"{name}_http"] = lambda h=http: h.post(
                    "/generate", json=body).raise_for_status()
                paths[f"{name}_rpc"] = lambda c=rpc: c.generate(input_ids=PROMPT,
                                                                sampling_params=PARAMS)
            for call in paths.values():
                median_ms(call, 20)  # warm: the prompt cached, each path's code loaded
            for r in range(args.rounds):
                for name in ("ab" if r % 2 == 0 else "ba"):
                    for path in ("http", "rpc"):
                        key = f"{name}_{path}"
                        rows[key].append(median_ms(paths[key], args.requests))
                print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.3f} ms" for k, v in rows.items()),
                      flush=True)
        finally:
            for server in servers.values():
                server.stop()
    med = {k: statistics.median(v) for k, v in rows.items()}
    lines = [f"# One-token `/generate`: {args.a} (a) versus {args.b} (b)", "",
             f"Sequential requests, {args.requests} per round, {args.rounds} rounds "
             "alternating a and b; the median of the rounds' medians, in ms.", "",
             "| path | a | b | b - a |", "|---|---|---|---|"]
    for path in ("http", "rpc"):
        a, b = med[f"a_{path}"], med[f"b_{path}"]
        lines.append(f"| {path} | {a:.3f} | {b:.3f} | {b - a:+.3f} |")
    lines += ["", "HTTP over RPC: a {:+.3f} ms, b {:+.3f} ms".format(
        med["a_http"] - med["a_rpc"], med["b_http"] - med["b_rpc"])]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
