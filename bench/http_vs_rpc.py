"""The shared-prefix workload streamed over HTTP (SGLang-native /generate, server-sent
events) versus the RPC client (streaming too), against one server in one run.

Both drivers keep `concurrency` requests in flight (each sends its next request when the
previous stream ends) and read every event; the cache is flushed before each run, so each
run does the same work. Rounds alternate RPC and HTTP so that a change in the machine's
load hits both. A second measure isolates the extra hop itself: sequential one-token
requests on a cached prompt, where the forward step is smallest, RPC versus HTTP.

    python bench/http_vs_rpc.py --preset quick      # < 3 minutes on 2 cores
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python bench/<this>.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.concurrency import drive, summary  # noqa: E402
from bench.report import save_table  # noqa: E402

PRESETS = {
    "quick": dict(groups=4, per_group=6, system_tokens=256, question_tokens=24,
                  output_tokens=24, concurrency=12, rounds=5, hop_requests=30),
    "smoke": dict(groups=2, per_group=2, system_tokens=32, question_tokens=8,
                  output_tokens=4, concurrency=2, rounds=2, hop_requests=3),
    "full": dict(groups=8, per_group=16, system_tokens=1000, question_tokens=30,
                 output_tokens=64, concurrency=32, rounds=5, hop_requests=100),
}


def run_rpc(client, prompts: list[list[int]], params: dict, concurrency: int) -> dict:
    def one(prompt: list[int]) -> tuple[float, int]:
        start, first, n = time.perf_counter(), None, 0
        for chunk in client.generate(input_ids=prompt, sampling_params=params, stream=True):
            if first is None:
                first = time.perf_counter() - start
            n += len(chunk.get("token_ids", []))
        return first or 0.0, n

    return drive(one, prompts, concurrency)


def run_http(url: str, prompts: list[list[int]], params: dict, concurrency: int) -> dict:
    import aiohttp

    async def main() -> dict:
        todo = list(reversed(prompts))
        ttfts: list[float] = []
        tokens = [0]

        async def loop(session: aiohttp.ClientSession) -> None:
            while todo:
                prompt = todo.pop()
                start, first, last = time.perf_counter(), None, None
                body = {"input_ids": prompt, "sampling_params": params, "stream": True}
                async with session.post(url + "/generate", json=body) as r:
                    assert r.status == 200, await r.text()
                    async for line in r.content:
                        if line.startswith(b"data: {"):
                            if first is None:
                                first = time.perf_counter() - start
                            last = line
                assert last is not None
                ttfts.append(first or 0.0)
                tokens[0] += json.loads(last[6:])["meta_info"]["completion_tokens"]

        connector = aiohttp.TCPConnector(limit=concurrency)
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            start = time.perf_counter()
            await asyncio.gather(*[loop(session) for _ in range(concurrency)])
            return summary(time.perf_counter() - start, len(prompts), tokens[0], ttfts)

    return asyncio.run(main())


def hop_latency(client, url: str, prompt: list[int], n: int) -> dict:
    """Median latency of sequential one-token requests on a cached prompt: the fixed cost
    of each path, with the smallest forward step the server can take."""
    import httpx

    params = {"max_new_tokens": 1, "temperature": 0}
    out = {}
    with httpx.Client(base_url=url, timeout=600) as http:
        for name, call in (
                ("rpc", lambda: client.generate(input_ids=prompt, sampling_params=params)),
                ("http", lambda: http.post("/generate", json={
                    "input_ids": prompt, "sampling_params": params}).raise_for_status())):
            call()
            times = []
            for _ in range(n):
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            out[f"{name}_ms"] = 1000 * statistics.median(times)
    out["extra_ms"] = out["http_ms"] - out["rpc_ms"]
    return out


def main() -> None:
    from bench.machine import preset_args
    from radixserve.config import DEFAULT_MODEL

    args = preset_args(__doc__, PRESETS, DEFAULT_MODEL)
    shape = PRESETS[args.preset]

    from bench.machine import machine_info
    from bench.workloads import shared_prefix_of
    from radixserve.client import Client
    from radixserve.model.loader import load_tokenizer, resolve_model
    from radixserve.server.runtime import Runtime

    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    prompts = [list(r.segment) for r in shared_prefix_of(
        lambda text: tokenizer.encode(text, add_special_tokens=False), shape)]
    params = {"max_new_tokens": shape["output_tokens"], "temperature": 0, "ignore_eos": True}
    report: dict = {"preset": args.preset, "shape": shape, "machine": machine_info(),
                    "rounds": []}
    with Runtime(str(model_dir)) as rt, Client(rt.rpc_address, timeout=3600) as client:
        client.generate(input_ids=prompts[0][:8], sampling_params={"max_new_tokens": 1})
        for r in range(shape["rounds"]):
            row = {}
            for name in ("rpc", "http") if r % 2 == 0 else ("http", "rpc"):
                assert client.flush_cache()["flushed"]
                before = client.stats()
                row[name] = (run_rpc(client, prompts, params, shape["concurrency"])
                             if name == "rpc" else
                             run_http(rt.http_url, prompts, params, shape["concurrency"]))
                after = client.stats()
                row[name]["steps"] = after["steps"] - before["steps"]
                row[name]["forward_s"] = (after["forward_seconds_total"]
                                          - before["forward_seconds_total"])
                row[name]["outside_forward_s"] = row[name]["wall_s"] - row[name]["forward_s"]
                print(f"round {r} {name}", json.dumps(row[name]), flush=True)
            report["rounds"].append(row)
        report["hop"] = hop_latency(client, rt.http_url, prompts[0], shape["hop_requests"])
        print("hop", json.dumps(report["hop"]), flush=True)
    for name in ("rpc", "http"):  # medians over rounds: robust to one disturbed run
        report[name] = {key: statistics.median(row[name][key] for row in report["rounds"])
                        for key in report["rounds"][0][name]}
    # Adjacent runs see the same machine: the median of the rounds' ratios is the figure.
    report["http_vs_rpc"] = statistics.median(
        row["http"]["output_tokens_per_s"] / row["rpc"]["output_tokens_per_s"]
        for row in report["rounds"])
    save_table(report, args.out / f"http_vs_rpc_{args.preset}", markdown(report))


def markdown(r: dict) -> str:
    s, hop = r["shape"], r["hop"]
    rows = [f"# HTTP (streamed /generate) vs RPC client ({r['preset']}, "
            f"{s['concurrency']} concurrent, median of {s['rounds']} rounds)", "",
            f"{s['groups']} groups x {s['per_group']} prompts, system prompt "
            f"{s['system_tokens']} tokens, question {s['question_tokens']}, "
            f"{s['output_tokens']} output tokens, greedy, streamed on both paths.", "",
            "| path | output tok/s | req/s | TTFT p50 s | TTFT p99 s | wall s | forward s | "
            "wall - forward s |", "|---|---|---|---|---|---|---|---|"]
    for name in ("rpc", "http"):
        x = r[name]
        rows.append(f"| {name} | {x['output_tokens_per_s']:.1f} | {x['requests_per_s']:.2f} | "
                    f"{x['ttft_p50_s']:.2f} | {x['ttft_p99_s']:.2f} | {x['wall_s']:.1f} | "
                    f"{x['forward_s']:.1f} | {x['outside_forward_s']:.2f} |")
    rows += ["", "Both paths run the same steps. `forward s` is the time the scheduler waited for "
             "the worker; `wall - forward` is what the rest (front door, HTTP or RPC, clients) "
             "added in series. Work done meanwhile hides inside `forward s`, where on 2 cores it "
             "slows the worker: only throughput shows that. The forward time of identical runs "
             "varies severalfold when the machine is shared, hence alternating rounds and "
             "medians.",
             "", "Each run (output tok/s, wall s, of which the worker's forward steps s):", ""]
    for k, row in enumerate(r["rounds"]):
        rows.append(f"- round {k}: " + "; ".join(
            f"{name} {row[name]['output_tokens_per_s']:.1f} tok/s, {row[name]['wall_s']:.1f} s "
            f"({row[name]['forward_s']:.1f} s forward)" for name in row))
    per_round = ", ".join(
        f"{row['http']['output_tokens_per_s'] / row['rpc']['output_tokens_per_s']:.3f}"
        for row in r["rounds"])
    rows += ["", "- HTTP / RPC throughput, median of the rounds' ratios: "
             f"**{r['http_vs_rpc']:.3f}** (target >= 0.90); per round: {per_round}",
             f"- one-token request on a cached prompt, median of {s['hop_requests']}: RPC "
             f"{hop['rpc_ms']:.1f} ms, HTTP {hop['http_ms']:.1f} ms: the extra hop costs "
             f"**{hop['extra_ms']:.1f} ms** per request", ""]
    return "\n".join(rows)


if __name__ == "__main__":
    main()
