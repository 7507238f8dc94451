"""What one `/generate` costs over HTTP in two checkouts of radixserve, side by side: each
runs its own `radixserve serve` (the tiny random model of the tests, on the CPU), and
rounds alternate between them so that a change in the machine's load hits both.

Each round sends `requests` sequential one-token requests (greedy, a cached 8-token
prompt: the smallest forward step) to each server over one kept-alive connection, a and b
alternating request by request, then the same through the RPC client (the floor both HTTP
paths stand on). It reports each path's median latency, and the CPU time the front door's
process spent per request (less disturbed by a busy machine than latency is).

    git worktree add --detach /tmp/base BASE   # the checkout to compare with
    python bench/http_hop.py --a /tmp/base --b .   # ~2 min on 2 cores: results/http_hop_quick
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


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process `pid` so far (its threads together)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return 1000 * (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--a", type=Path, required=True, help="a checkout (the baseline)")
    parser.add_argument("--b", type=Path, required=True, help="the checkout to compare")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--name", default="http_hop_quick", help="the record's stem")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from bench.machine import git_commit
    from bench.report import save_table
    from radixserve.client import Client
    from tests.factories import tiny_model_dir

    model = str(tiny_model_dir(Path(tempfile.gettempdir()) / "radixserve-trace"))
    body = {"input_ids": PROMPT, "sampling_params": PARAMS}
    keys = [f"{n}_{p}" for n in "ab" for p in ("http", "rpc")]
    latency: dict[str, list[float]] = {k: [] for k in keys}
    cpu_ms: dict[str, list[float]] = {k: [] for k in keys}
    with tempfile.TemporaryDirectory() as tmp:
        servers: dict[str, Server] = {}
        try:
            for name, tree in (("a", args.a), ("b", args.b)):
                servers[name] = Server(tree, model, Path(tmp) / f"{name}.log")
            paths = {}
            for name, server in servers.items():
                http = httpx.Client(base_url=server.url, timeout=60)
                rpc = Client(f"tcp://127.0.0.1:{server.rpc_port}", timeout=60)
                paths[f"{name}_http"] = lambda h=http: h.post(
                    "/generate", json=body).raise_for_status()
                paths[f"{name}_rpc"] = lambda c=rpc: c.generate(input_ids=PROMPT,
                                                                sampling_params=PARAMS)
            for call in paths.values():
                for _ in range(20):  # warm: the prompt cached, each path's code loaded
                    call()
            for r in range(args.rounds):
                for path in ("http", "rpc"):
                    # Request by request, a and b alternate (who goes first too), so that
                    # the machine's load falls on both alike; each server's front door's
                    # CPU time over the phase is its own requests' alone.
                    before = {n: cpu_seconds(servers[n].process.pid) for n in servers}
                    for i in range(args.requests):
                        for name in ("ab" if i % 2 == 0 else "ba"):
                            latency[f"{name}_{path}"].append(timed(paths[f"{name}_{path}"]))
                    for n in servers:
                        spent = cpu_seconds(servers[n].process.pid) - before[n]
                        cpu_ms[f"{n}_{path}"].append(1000 * spent / args.requests)
                print(f"round {r}: front door CPU ms/request " + ", ".join(
                    f"{k} {v[-1]:.3f}" for k, v in cpu_ms.items()), flush=True)
        finally:
            for server in servers.values():
                server.stop()
    lat = {k: statistics.median(v) for k, v in latency.items()}
    cpu = {k: statistics.median(v) for k, v in cpu_ms.items()}
    lines = [f"# One-token `/generate`: {args.a} (a) versus {args.b} (b)", "",
             f"{args.rounds} rounds of {args.requests} sequential requests per path, a and b "
             "alternating request by request. Latency: the median request, in ms. Front "
             "door CPU: the `serve` process's user + system time per request (its HTTP "
             "thread and its loop together), the median of the rounds, in ms.", "",
             "| path | latency a | latency b | b - a | front door CPU a | CPU b | b - a |",
             "|---|---|---|---|---|---|---|"]
    for path in ("http", "rpc"):
        a, b = f"a_{path}", f"b_{path}"
        lines.append(f"| {path} | {lat[a]:.3f} | {lat[b]:.3f} | {lat[b] - lat[a]:+.3f} | "
                     f"{cpu[a]:.3f} | {cpu[b]:.3f} | {cpu[b] - cpu[a]:+.3f} |")
    lines += ["", "HTTP over RPC, latency: a {:+.3f} ms, b {:+.3f} ms; front door CPU: a "
              "{:+.3f} ms, b {:+.3f} ms".format(
                  lat["a_http"] - lat["a_rpc"], lat["b_http"] - lat["b_rpc"],
                  cpu["a_http"] - cpu["a_rpc"], cpu["b_http"] - cpu["b_rpc"])]
    record = {"a": str(args.a), "b": str(args.b), "commit": git_commit(), "rounds": args.rounds,
              "requests": args.requests, "latency_ms": lat, "front_door_cpu_ms": cpu}
    save_table(record, ROOT / "bench" / "results" / args.name, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
