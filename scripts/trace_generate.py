"""Count the radixserve code one `/generate` of 4 tokens passes through `radixserve serve`.

    python scripts/trace_generate.py              # a tiny random model (seconds to start)
    python scripts/trace_generate.py --model DIR  # any model `serve` takes

It starts `radixserve serve` (front door, scheduler, worker) with a profiling hook in
every process, warms it up with a few requests, switches the hook on (SIGUSR1) in the
three processes, sends ONE `/generate` (4 new tokens, greedy, `ignore_eos`), switches it
off (SIGUSR2, which writes what was seen) and prints the distinct radixserve files and
functions each process ran, and in total. Start-up and warm-up are not counted.

What counts: code objects whose file lies in this checkout's `radixserve/` package, one per
(file, qualified name); a generator or coroutine resumed many times is one function. List,
set and dict comprehensions are not counted: Python 3.12 inlines them (PEP 709), so they
are no functions there, and the count would depend on the interpreter. The
processes' idle loops (polling, heartbeats) count too when they run within the window:
they are part of the trip. The hook lives in a `sitecustomize` module that only this
script puts on `PYTHONPATH`: the package itself carries no tracing code and pays nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "radixserve"
INLINED = {"<listcomp>", "<setcomp>", "<dictcomp>"}

# Runs at the start of every Python process the server starts (they inherit PYTHONPATH).
# The main thread (start-up's imports and loading) is profiled from SIGUSR1 on; a thread
# started later runs the hook from its start, one flag test per call until SIGUSR1.
HOOK = '''
import os, signal, sys, threading, json
_dir = os.environ.get("RADIXSERVE_TRACE_DIR")
if _dir:
    _on = False
    _codes = set()

    def _profile(frame, event, arg):
        if _on and event == "call":
            _codes.add(frame.f_code)

    def _start(*_):
        global _on
        _codes.clear()
        _on = True
        sys.setprofile(_profile)
        open(os.path.join(_dir, f"on-{os.getpid()}"), "w").close()

    def _stop(*_):
        global _on
        _on = False
        sys.setprofile(None)
        seen = sorted({(c.co_filename, c.co_qualname) for c in _codes})
        path = os.path.join(_dir, f"trace-{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(seen, f)
        os.replace(path + ".tmp", path)

    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
    threading.setprofile(_profile)
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 120.0) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def get(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def wait_for(paths: list[Path], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} from {[p.name for p in paths if not p.exists()]}")
        time.sleep(0.01)


def tiny_model(root: Path) -> Path:
    sys.path.insert(0, str(ROOT))
    from tests.factories import tiny_model_dir

    return tiny_model_dir(root)


def trace(model: str, work: Path, warmup: int) -> dict[str, list[tuple[str, str]]]:
    """Start the server, trace one request, stop it; (file, function) seen per process."""
    (work / "site").mkdir()
    (work / "site" / "sitecustomize.py").write_text(HOOK)
    traces = work / "traces"
    traces.mkdir()
    env = dict(os.environ, RADIXSERVE_TRACE_DIR=str(traces),
               PYTHONPATH=os.pathsep.join([str(work / "site"), str(ROOT)]))
    port, rpc_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "radixserve", "serve", "--model", model, "--port", str(port),
         "--rpc-port", str(rpc_port), "--cache-events-port", "0", "--device", "cpu"],
        env=env, cwd=work, stdout=subprocess.DEVNULL, stderr=open(work / "server.log", "w"))
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None:
                raise RuntimeError("the server exited:\n" + (work / "server.log").read_text())
            try:
                if get(f"{url}/health")["status"] == "ok":
                    break
            except urllib.error.HTTPError:  # 503 while the model loads
                time.sleep(0.5)
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        body = {"text": "The capital of France is", "stream": False, "sampling_params": {
            "max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
        for _ in range(warmup):
            post(f"{url}/generate", body)
        roles = _pids(f"tcp://127.0.0.1:{rpc_port}")
        for pid in roles:
            os.kill(pid, signal.SIGUSR1)
        wait_for([traces / f"on-{pid}" for pid in roles], 30, "start marker")
        result = post(f"{url}/generate", body)
        for pid in roles:
            os.kill(pid, signal.SIGUSR2)
        wait_for([traces / f"trace-{pid}.json" for pid in roles], 30, "trace")
        assert result["meta_info"]["completion_tokens"] == 4, result
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    return {role: [tuple(x) for x in json.loads((traces / f"trace-{pid}.json").read_text())]
            for pid, role in roles.items()}


def _pids(rpc_address: str) -> dict[int, str]:
    """The three processes by pid, as the front door's health call names them."""
    sys.path.insert(0, str(ROOT))
    from radixserve.client import Client

    with Client(rpc_address, timeout=10) as client:
        pids = client.health()["pids"]
    return {pid: role for role, pid in pids.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a model directory or name (default: a tiny "
                        "random Llama with the real tokenizer)")
    parser.add_argument("--warmup", type=int, default=3, help="requests before the traced one")
    parser.add_argument("--show", action="store_true",
                        help="list every function seen, by process")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="radixserve-trace-") as tmp:
        work = Path(tmp)
        # The tiny model is kept between runs (its folder is named by its recipe).
        model = args.model or str(tiny_model(Path(tempfile.gettempdir()) / "radixserve-trace"))
        seen = trace(model, work, args.warmup)
    prefix = str(PACKAGE) + os.sep
    total: set[tuple[str, str]] = set()
    per_role: dict[str, set[tuple[str, str]]] = defaultdict(set)
    foreign = set()
    for role, pairs in seen.items():
        for file, name in pairs:
            if name.rpartition(".")[2] in INLINED:
                continue
            if file.startswith(prefix):
                per_role[role].add((file[len(prefix):], name))
            elif "/radixserve/" in file:
                foreign.add(file)
    if foreign:
        sys.exit(f"a process ran radixserve from outside {PACKAGE}: {sorted(foreign)[:3]}")
    for role, pairs in sorted(per_role.items()):
        total |= pairs
        print(f"{role:12} {len({f for f, _ in pairs}):3} files {len(pairs):4} functions")
    print(f"{'total':12} {len({f for f, _ in total}):3} files {len(total):4} functions")
    if args.show:
        for role, pairs in sorted(per_role.items()):
            for file, name in sorted(pairs):
                print(f"  {role} {file}: {name}")


if __name__ == "__main__":
    main()
