"""The multi-group workload through the router, policy against policy, in one run.

Local replicas (`--replicas`, each with a KV pool too small for every group's system
prompt, as a fleet at scale is) behind a router started once per policy; before each run
every replica's cache is flushed, so each policy starts cold. The workload: `groups`
system prompts, `per_group` requests each, arrivals interleaved, `concurrency` streams in
flight. Per policy: the hit rate (cached / prompt tokens, from the results), throughput,
TTFT p50/p99, and how the groups were spread. Then the router's added latency: sequential
one-token requests on a cached prompt, straight to a replica versus through the router.

    python bench/router.py --preset quick       # ~5 minutes on 2 cores
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

if __package__ in (None, ""):  # `python bench/<this>.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.concurrency import drive  # noqa: E402
from bench.report import save_table  # noqa: E402

POLICIES = ("cache_aware", "round_robin", "shortest_queue")
PRESETS = {
    "quick": dict(replicas=3, groups=6, per_group=8, system_tokens=256, question_tokens=24,
                  output_tokens=16, concurrency=6, replica_tokens=1536, hop_requests=40),
    "smoke": dict(replicas=2, groups=2, per_group=3, system_tokens=48, question_tokens=8,
                  output_tokens=4, concurrency=2, replica_tokens=512, hop_requests=5),
}


def run_policy(address: str, prompts: list[list[int]], groups: list[int], params: dict,
               concurrency: int) -> dict:
    from radixserve.client import Client

    finals: dict[int, dict] = {}
    order = {id(p): i for i, p in enumerate(prompts)}

    with Client(address, timeout=3600) as client:
        def one(prompt: list[int]) -> tuple[float, int]:
            start, first, final = time.perf_counter(), None, None
            for chunk in client.generate(input_ids=prompt, sampling_params=params, stream=True):
                if first is None:
                    first = time.perf_counter() - start
                final = chunk.get("final", final)
            finals[order[id(prompt)]] = final
            return first or 0.0, final["meta_info"]["completion_tokens"]

        result = drive(one, prompts, concurrency)
    metas = [finals[i]["meta_info"] for i in range(len(prompts))]
    result["hit_rate"] = (sum(m["cached_tokens"] for m in metas)
                          / sum(m["prompt_tokens"] for m in metas))
    spread: dict[int, Counter] = defaultdict(Counter)
    for group, m in zip(groups, metas):
        spread[group][m["replica"]] += 1
    result["group_on_one_replica"] = statistics.mean(
        c.most_common(1)[0][1] / sum(c.values()) for c in spread.values())
    result["outputs"] = [finals[i]["output_ids"] for i in range(len(prompts))]
    return result


def added_latency(router: str, prompt: list[int], n: int) -> dict:
    """Median latency of one-token requests on a cached prompt, straight to the replica
    that caches it and through the router; the difference is what the router adds (two
    more hops, a decode, page hashes, an encode). And the router's own time per call, which
    excludes waiting for a core: on a machine whose cores the replicas keep busy, the
    router's process often waits to be scheduled."""
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
    calls = after["routed"] - before["routed"]
    busy = sum(after["busy_seconds"].values()) - sum(before["busy_seconds"].values())
    out["router_busy_ms_per_call"] = 1000 * busy / calls
    return out


def main() -> None:
    from bench.machine import preset_args
    from radixserve.config import DEFAULT_MODEL

    args = preset_args(__doc__, PRESETS, DEFAULT_MODEL)
    shape = PRESETS[args.preset]

    from radixserve.router.runtime import RouterRuntime

    from bench.machine import machine_info, measure_limits
    from bench.workloads import shared_prefix_of
    from radixserve.client import Client
    from radixserve.model.loader import load_tokenizer, resolve_model
    from radixserve.server.runtime import Runtime

    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    requests = shared_prefix_of(lambda text: tokenizer.encode(text, add_special_tokens=False),
                                shape)
    prompts, groups = [list(r.segment) for r in requests], [r.group for r in requests]
    params = {"max_new_tokens": shape["output_tokens"], "temperature": 0, "ignore_eos": True}
    report: dict = {"preset": args.preset, "shape": shape, "machine": machine_info(),
                    "limits": measure_limits(quick=True), "policies": {}}
    replicas = [Runtime(str(model_dir), max_total_tokens=shape["replica_tokens"])
                for _ in range(shape["replicas"])]
    try:
        for policy in POLICIES:
            for rt in replicas:
                with Client(rt.rpc_address) as c:
                    assert c.flush_cache()["flushed"]
            with RouterRuntime(replica=[rt.rpc_address for rt in replicas],
                               policy=policy) as router:
                result = run_policy(router.rpc_address, prompts, groups, params,
                                    shape["concurrency"])
                if policy == "cache_aware":
                    report["latency"] = added_latency(router.rpc_address, prompts[0][:64],
                                                      shape["hop_requests"])
            report["policies"][policy] = result
            print(policy, json.dumps({k: v for k, v in result.items() if k != "outputs"}),
                  flush=True)
    finally:
        for rt in replicas:
            rt.shutdown()
    outputs = {p: r.pop("outputs") for p, r in report["policies"].items()}
    report["outputs_equal"] = len({json.dumps(o) for o in outputs.values()}) == 1
    base = report["policies"]["round_robin"]
    for result in report["policies"].values():
        result["hit_rate_vs_round_robin"] = result["hit_rate"] / max(base["hit_rate"], 1e-9)
        result["throughput_vs_round_robin"] = (result["output_tokens_per_s"]
                                               / base["output_tokens_per_s"])
    save_table(report, args.out / "router", markdown(report))


def markdown(report: dict) -> str:
    shape, lat = report["shape"], report["latency"]
    m, limits = report["machine"], report["limits"]
    lines = [
        "# The router: policies on the multi-group workload",
        "",
        f"`python bench/router.py --preset {report['preset']}`; commit {m.get('commit')}; "
        f"{m.get('cpu')} ({', '.join(f'{k} {v:.1f}' for k, v in limits.items())}); "
        f"{shape['replicas']} local replicas of {shape['replica_tokens']} KV "
        f"tokens each on the same {m.get('cores', '?')} cores; {shape['groups']} groups x "
        f"{shape['per_group']} requests, {shape['system_tokens']}-token system prompts, "
        f"{shape['question_tokens']}-token questions, {shape['output_tokens']} output tokens, "
        f"{shape['concurrency']} streams in flight. Greedy outputs equal across policies: "
        f"{report['outputs_equal']}.",
        "",
        "| policy | hit rate | vs round-robin | group on one replica | tokens/s | "
        "vs round-robin | TTFT p50 s | TTFT p99 s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["policies"].items():
        lines.append(f"| {name} | {r['hit_rate']:.3f} | {r['hit_rate_vs_round_robin']:.2f}x | "
                     f"{r['group_on_one_replica']:.0%} | {r['output_tokens_per_s']:.1f} | "
                     f"{r['throughput_vs_round_robin']:.2f}x | {r['ttft_p50_s']:.2f} | "
                     f"{r['ttft_p99_s']:.2f} |")
    lines += ["", f"Added latency per request (median of {shape['hop_requests']} one-token "
              f"requests on a cached prompt): direct {lat['direct_ms']:.2f} ms, through the "
              f"router {lat['routed_ms']:.2f} ms, added **{lat['added_ms']:.2f} ms** "
              f"(target < 2 ms); the router's own work per call "
              f"{lat['router_busy_ms_per_call']:.3f} ms.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
