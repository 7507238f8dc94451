"""The multi-group workload through front ends, in one run: radixserve's router's policies
against round_robin (`--preset quick`), or SGLang's router (sglang-router's `smg`) and
radixserve's, both cache_aware on 2 replicas, against one replica alone (`--preset fronts`).
Local replicas with KV pools too small for every group's system prompt (as a fleet at scale
has) share the router's cache secret, flushed before each front. Every front is driven alike:
streamed HTTP /generate, the prompt as text (what SGLang's router matches). Per front, as
ratios to the first: hit rate (cached / prompt tokens), throughput, TTFT p50/p99 (to the first
chunk); the groups' spread where the replica is named; for the policies, the added latency.

    python bench/router.py --preset quick       # ~5 minutes on 2 cores
    python bench/router.py --preset fronts      # ~4 minutes on 2 cores
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

if __package__ in (None, ""):  # `python bench/<this>.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.concurrency import drive  # noqa: E402
from bench.machine import machine_info, machine_line, measure_limits, preset_args  # noqa: E402
from bench.report import save_table  # noqa: E402

POLICIES = ("round_robin", "cache_aware", "shortest_queue")
PRESETS = {
    "quick": dict(replicas=3, groups=6, per_group=8, system_tokens=256, question_tokens=24,
                  output_tokens=16, concurrency=6, replica_tokens=1536, hop_requests=40),
    "smoke": dict(replicas=2, groups=2, per_group=3, system_tokens=48, question_tokens=8,
                  output_tokens=4, concurrency=2, replica_tokens=512, hop_requests=5),
}
PRESETS["fronts"] = {**PRESETS["quick"], "replicas": 2, "groups": 4, "concurrency": 4,
                     "replica_tokens": 1024, "fronts": ("single", "radixserve", "sglang")}
PRESETS["fronts_smoke"] = {**PRESETS["smoke"], "fronts": PRESETS["fronts"]["fronts"]}
RATIOS = ("hit_rate", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s")


def run_front(url: str, texts: list[str], groups: list[int], params: dict,
              concurrency: int) -> dict:
    finals: dict[int, dict] = {}
    with httpx.Client(timeout=3600) as client:
        def one(i: int) -> tuple[float, int]:
            start, first = time.perf_counter(), 0.0
            body = {"text": texts[i], "sampling_params": params, "stream": True}
            with client.stream("POST", f"{url}/generate", json=body) as answer:
                answer.raise_for_status()
                for line in answer.iter_lines():
                    if line.startswith("data: {"):
                        first = first or time.perf_counter() - start
                        finals[i] = json.loads(line[6:])
            return first, finals[i]["meta_info"]["completion_tokens"]

        result = drive(one, list(range(len(texts))), concurrency)
    metas = [finals[i]["meta_info"] for i in range(len(texts))]
    result["hit_rate"] = (sum(m["cached_tokens"] for m in metas)
                          / sum(m["prompt_tokens"] for m in metas))
    spread = [Counter(m.get("replica") for m, g in zip(metas, groups) if g == k) for k in {*groups}]
    result["group_on_one_replica"] = None if "replica" not in metas[0] else statistics.mean(
        c.most_common(1)[0][1] / sum(c.values()) for c in spread)
    result["outputs"] = [finals[i]["output_ids"] for i in range(len(texts))]
    return result


@contextmanager
def front(name: str, replicas: list, secret: str):
    """The front end `name` before `replicas`: (radixserve's router or None, its HTTP URL)."""
    from radixserve.router.runtime import RouterRuntime
    if name == "single":
        yield None, replicas[0].http_url
    elif name == "sglang":  # the test suite's launcher: `smg launch`, waits for health
        from tests.server.sglang_router import Router
        router = Router([rt.http_url for rt in replicas], Path(secret).with_name("smg.log"))
        try:
            yield None, router.url
        finally:
            router.stop()
    else:
        with RouterRuntime(replica=[rt.rpc_address for rt in replicas], cache_secret_file=secret,
                           policy="cache_aware" if name == "radixserve" else name) as router:
            yield router, router.http_url


def added_latency(router: str, prompt: list[int], n: int) -> dict:
    """Median latency of one-token requests on a cached prompt (RPC), straight to its replica
    and through the router; and the router's own time per call (excluding waits for a core)."""
    from radixserve.client import Client

    params = {"max_new_tokens": 1, "temperature": 0}
    out = {}
    with Client(router, timeout=600) as c:
        home = c.generate(input_ids=prompt, sampling_params=params)["meta_info"]["replica"]
        before = c.workers()
    for name, address in (("direct", home), ("routed", router)):
        with Client(address, timeout=600) as c:
            c.generate(input_ids=prompt, sampling_params=params)
            times = []
            for _ in range(n):
                start = time.perf_counter()
                c.generate(input_ids=prompt, sampling_params=params)
                times.append(time.perf_counter() - start)
        out[f"{name}_ms"] = 1000 * statistics.median(times)
    out["added_ms"] = out["routed_ms"] - out["direct_ms"]
    with Client(router, timeout=600) as c:
        after = c.workers()
    busy = sum(after["busy_seconds"].values()) - sum(before["busy_seconds"].values())
    out["router_busy_ms_per_call"] = 1000 * busy / (after["routed"] - before["routed"])
    return out


def workload(args: Any, shape: dict) -> tuple[Path, list, list[str], list[int], dict, dict]:
    """The preset's multi-group workload as text: the model's directory, the requests, their
    texts and groups, the sampling parameters, and the report begun (machine, limits)."""
    from bench.workloads import shared_prefix_of
    from radixserve.model.loader import load_tokenizer, resolve_model

    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    requests = shared_prefix_of(lambda text: tokenizer.encode(text, add_special_tokens=False),
                                shape)
    texts, groups = [tokenizer.decode(r.segment) for r in requests], [r.group for r in requests]
    params = {"max_new_tokens": shape["output_tokens"], "temperature": 0, "ignore_eos": True}
    report: dict = {"preset": args.preset, "shape": shape, "machine": machine_info(),
                    "limits": measure_limits(quick=True), "fronts": {}}
    return model_dir, requests, texts, groups, params, report


def compare(report: dict) -> dict:
    """Whether every front's greedy outputs were equal, and each figure's ratio to the
    first front's, in `report`."""
    fronts = report["fronts"]
    report["outputs_equal"] = len({json.dumps(r.pop("outputs")) for r in fronts.values()}) == 1
    report["base"] = base = next(iter(fronts))
    for result in fronts.values():
        result["vs_base"] = {k: result[k] / max(fronts[base][k], 1e-9) for k in RATIOS}
    return fronts


def main() -> None:
    from radixserve.client import Client
    from radixserve.config import DEFAULT_MODEL
    from radixserve.server.runtime import Runtime
    from radixserve.tenants import ensure_secret_file

    args = preset_args(__doc__, PRESETS, DEFAULT_MODEL)
    shape = PRESETS[args.preset]
    model_dir, requests, texts, groups, params, report = workload(args, shape)
    secret = str(ensure_secret_file(Path(tempfile.mkdtemp(prefix="bench-router-"))))
    replicas = [Runtime(str(model_dir), max_total_tokens=shape["replica_tokens"],
                        cache_secret_file=secret) for _ in range(shape["replicas"])]
    try:
        for name in shape.get("fronts", POLICIES):
            for rt in replicas:
                with Client(rt.rpc_address) as c:
                    assert c.flush_cache()["flushed"]
            with front(name, replicas, secret) as (router, url):
                result = run_front(url, texts, groups, params, shape["concurrency"])
                if name == "cache_aware":
                    report["latency"] = added_latency(
                        router.rpc_address, list(requests[0].segment[:64]), shape["hop_requests"])
            report["fronts"][name] = result
            print(name, json.dumps({k: v for k, v in result.items() if k != "outputs"}),
                  flush=True)
    finally:
        for rt in replicas:
            rt.shutdown()
    fronts = compare(report)
    if (sg := fronts.get("sglang")) and (rs := fronts.get("radixserve")):
        report["sglang_vs_radixserve"] = {k: sg[k] / max(rs[k], 1e-9) for k in RATIOS}
    save_table(report, args.out / ("router_fronts" if "fronts" in shape else "router"),
               markdown(report))


def markdown(report: dict) -> str:
    shape, base, m, limits = report["shape"], report["base"], report["machine"], report["limits"]
    lines = [
        f"# The router: {'front ends' if 'fronts' in shape else 'policies'} on the multi-group "
        "workload", "",
        f"`python bench/router.py --preset {report['preset']}`. {machine_line(m)}; "
        f"{', '.join(f'{k} {v:.1f}' for k, v in limits.items())}. {shape['replicas']} local "
        f"replicas of {shape['replica_tokens']} KV tokens each on those cores; {shape['groups']} "
        f"groups x {shape['per_group']} requests, {shape['system_tokens']}-token system prompts, "
        f"{shape['question_tokens']}-token questions, {shape['output_tokens']} output tokens, "
        f"{shape['concurrency']} streams in flight over HTTP. Greedy outputs equal across "
        f"fronts: {report['outputs_equal']}. Ratios against {base}.", "",
        "| front | hit rate | ratio | group on one replica | tokens/s | ratio | TTFT p50 s | "
        "ratio | TTFT p99 s | ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["fronts"].items():
        spread = "-" if r["group_on_one_replica"] is None else f"{r['group_on_one_replica']:.0%}"
        lines.append(f"| {name} | {r['hit_rate']:.3f} | {r['vs_base']['hit_rate']:.2f}x | "
                     f"{spread} | " + " | ".join(f"{r[k]:.2f} | {r['vs_base'][k]:.2f}x"
                                                 for k in RATIOS[1:]) + " |")
    if "sglang_vs_radixserve" in report:
        lines += ["", "SGLang's router against radixserve's: " + ", ".join(
            f"{k} {v:.2f}x" for k, v in report["sglang_vs_radixserve"].items()) + "."]
    if lat := report.get("latency"):
        lines += ["", f"Added latency per request (median of {shape['hop_requests']} one-token "
                  f"requests on a cached prompt, RPC): direct {lat['direct_ms']:.2f} ms, through "
                  f"the router {lat['routed_ms']:.2f} ms, added **{lat['added_ms']:.2f} ms** "
                  f"(target < 2 ms); the router's own work per call "
                  f"{lat['router_busy_ms_per_call']:.3f} ms."]
    return "\n".join(lines + [""])

if __name__ == "__main__":
    main()
