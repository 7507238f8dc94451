"""The multi-group workload on two Ray Serve replicas (radixserve.ray:app, docs/ray.md),
routed by radixserve's tree router against Ray's default (power of two choices), in one
run: hit rate (cached / prompt tokens), output tokens/s, TTFT p50/p99, through Ray's HTTP
proxy. Ray's PrefixCacheAffinityRouter is not run: it ships in ray.serve.llm, which needs
vLLM. A local Ray instance; each router gets a fresh deployment (empty caches).

    python bench/ray_router.py --preset fronts      # ~5 minutes on 2 cores
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python bench/<this>.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import machine_line, preset_args  # noqa: E402
from bench.report import save_table  # noqa: E402
from bench.router import PRESETS as ROUTER_PRESETS  # noqa: E402
from bench.router import compare, run_front, workload  # noqa: E402
from bench.runners.llama_server import free_port  # noqa: E402

PRESETS = {"fronts": {**ROUTER_PRESETS["fronts"], "routers": ("pow2", "radix")},
           "smoke": {**ROUTER_PRESETS["fronts_smoke"], "routers": ("pow2", "radix")}}


def main() -> None:
    import ray
    from ray import serve

    from radixserve.config import DEFAULT_MODEL
    from radixserve.ray import app

    args = preset_args(__doc__, PRESETS, DEFAULT_MODEL)
    shape = PRESETS[args.preset]
    model_dir, _, texts, groups, params, report = workload(args, shape)
    port = free_port()
    ray.init(num_cpus=shape["replicas"] + 1)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        for router in shape["routers"]:
            serve.run(app({"model": str(model_dir), "num_replicas": shape["replicas"],
                           "router": router, "max_total_tokens": shape["replica_tokens"]}),
                      name="bench", route_prefix="/")
            result = run_front(f"http://127.0.0.1:{port}", texts, groups, params,
                               shape["concurrency"])
            serve.delete("bench")
            report["fronts"][router] = result
            print(router, json.dumps({k: v for k, v in result.items() if k != "outputs"}),
                  flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    compare(report)
    save_table(report, args.out / "ray_router", markdown(report))


def markdown(report: dict) -> str:
    shape = report["shape"]
    lines = [
        "# Ray Serve: radixserve's tree router against Ray's default", "",
        f"`python bench/ray_router.py --preset {report['preset']}`. "
        f"{machine_line(report['machine'])}; "
        f"{', '.join(f'{k} {v:.1f}' for k, v in report['limits'].items())}. "
        f"{shape['replicas']} Ray Serve replicas (radixserve.ray:app, one local Ray "
        f"instance) of {shape['replica_tokens']} KV tokens each on those cores; "
        f"{shape['groups']} groups x {shape['per_group']} requests, {shape['system_tokens']}"
        f"-token system prompts, {shape['question_tokens']}-token questions, "
        f"{shape['output_tokens']} output tokens, {shape['concurrency']} streams in flight "
        f"through Ray's HTTP proxy. Greedy outputs equal across routers: "
        f"{report['outputs_equal']}. Ratios against {report['base']}.", "",
        "| router | hit rate | ratio | tokens/s | ratio | TTFT p50 s | ratio | TTFT p99 s "
        "| ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["fronts"].items():
        v = r["vs_base"]
        lines.append(f"| {name} | {r['hit_rate']:.3f} | {v['hit_rate']:.2f}x | "
                     f"{r['output_tokens_per_s']:.2f} | {v['output_tokens_per_s']:.2f}x | "
                     f"{r['ttft_p50_s']:.2f} | {v['ttft_p50_s']:.2f}x | "
                     f"{r['ttft_p99_s']:.2f} | {v['ttft_p99_s']:.2f}x |")
    return "\n".join(lines + [""])


if __name__ == "__main__":
    main()
