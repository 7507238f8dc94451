"""The suite's index: each study (a question the runner's workloads x peers does not ask),
and for every record under bench/results/ the one command that regenerates it, or the
commit whose script made it where that study is answered and gone (bench/results/README.md
keeps their conclusions). `python -m bench` prints it; tests/bench/test_suite.py holds it
to the folder."""

from __future__ import annotations

from dataclasses import dataclass, field

LAST_WITH_STUDIES = "6a24ceb"
"""The last commit holding the deleted studies' scripts: `git worktree add /tmp/old
6a24ceb && cd /tmp/old && python bench/<script>.py ...` reruns one."""


@dataclass(frozen=True)
class Study:
    question: str
    results: dict[str, str] = field(default_factory=dict)
    """Record stem under bench/results/ -> the arguments after `python -m bench <study>`."""


STUDIES: dict[str, Study] = {
    "run": Study("workloads x peers: the radix cache against transformers and the cache off; "
                 "`--baseline COMMIT` against an earlier commit", {
                     "quick": "--preset quick --threads 1",
                     "full_shared_prefix": "--preset full --workloads shared_prefix --threads 2",
                     "full_no_sharing": "--preset full --workloads no_sharing --runners "
                                        "radixserve,radixserve-nocache --threads 2 --no-probes",
                     "vs_baseline_492c3ff": "--baseline 492c3ff --preset full "
                                            "--workloads shared_prefix",
                     "vs_baseline_e9eb8a4_quick": "--baseline e9eb8a4 --preset quick --rounds 3 "
                                                  "--workloads shared_prefix,multi_turn,agent,"
                                                  "no_sharing",
                     "vs_baseline_6644d8a_quick": "--baseline 6644d8a --preset quick --rounds 3 "
                                                  "--workloads shared_prefix,multi_turn,agent,"
                                                  "no_sharing"}),
    "cascade_decode": Study("tree attention's decode step on the worker, and its cost model", {
        "cascade_decode_full": "--preset full", "cascade_decode_gates": "--preset gates",
        "cascade_decode_shared": "--preset shared",
        "cascade_decode_shared_1thread": "--preset shared --threads 1 (then renamed)"}),
    "cascade_engine": Study("tree attention end to end through the Engine", {
        "cascade_engine_quick": "--preset quick", "cascade_engine_long": "--preset long",
        "cascade_engine_long_avx2": "--preset long, RADIXSERVE_NATIVE_ARCH=x86-64-v3, renamed",
        "cascade_engine_long_zen3": "--preset long, on a Zen 3 EPYC (AVX2 only), renamed"}),
    "disk_tier": Study("the disk tier under prompts that do not fit the pool, and warm restarts", {
        "disk_tier": "--preset full", "disk_tier_quick": "--preset quick",
        "disk_tier_first_run": "--preset full (its first run, renamed)"}),
    "llamacpp": Study("radixserve beside llama.cpp's llama-server, fp32 and 4-bit", {
        "llamacpp_quick": "--preset quick"}),
    "batched_decode": Study("batched decode, 1/8/32 streams over a shared 1k prefix, beside "
                            "llama-server's parallel slots, each against its floor", {
        "batched_decode_quick": "--preset quick", "batched_decode_full": "--preset full",
        "batched_decode_full_zen3": "--preset full, on a Zen 3 EPYC (AVX2 only), renamed"}),
    "llama_bench": Study("pp512 and tg128 beside llama-bench's, on this CPU and held to AVX2", {
        "llama_bench": "--repeats 5", "llama_bench_avx2": "--isa avx2 --repeats 5",
        "llama_bench_zen3": "--repeats 5, on a Zen 3 EPYC (AVX2 only), renamed"}),
    "lora": Study("multi-LoRA serving against the base alone and transformers + PEFT", {
        "lora_quick": "--preset quick"}),
    "quant": Study("int8 and q4 weights: decode speed and agreement", {
        "quant_quick": "--preset quick", "quant_layers": "--preset layers",
        "quant_extends": "--preset extends",
        "quant_layers_avx2": "--preset layers, with RADIXSERVE_NATIVE_ARCH=x86-64-v3",
        "quant_speed_avx2": "--preset speed, 2 runs each alternated: at 98342db~1 (its CFLAGS' "
                            "-march set to x86-64-v3) and with RADIXSERVE_NATIVE_ARCH=x86-64-v3 "
                            "at 98342db (the runs' records merged into one)"}),
    "router": Study("the router's policies over 3 local replicas; SGLang's router and ours on "
                    "2 vs one", {"router": "--preset quick", "router_fronts": "--preset fronts"}),
    "ray_router": Study("radixserve's tree router against Ray Serve's default on 2 Ray replicas",
                        {"ray_router": "--preset fronts"}),
    "speculative": Study("speculative decoding (lookup, tree) on chat workloads of real text", {
        "speculative_quick": "--preset quick"}),
    "tp": Study("tensor parallelism's decode step over 2 ranks on one host's CPU", {
        "tp_quick": "--preset quick"}),
}

SOAK = {"soak": "python -m tools.soak --minutes 20",
        "soak_uncapped_caches": "python -m tools.soak --minutes 20 (before the caches were "
                                "capped; renamed)",
        "soak_capped_caches": "python -m tools.soak --minutes 5 --name soak_capped_caches",
        "soak_nokill_default_caches": f"an earlier soak script ({LAST_WITH_STUDIES} and before)"}
"""The soak's records (a tool of its own, tools/soak/)."""

HISTORICAL: dict[str, str] = {
    "omp_policy_quick": "bench/omp_policy.py --preset quick",
    "sampler_host": "bench/sampler_host.py --threads 1", "grammar": "bench/grammar.py",
    "host_overhead_before": "bench/host_overhead.py --preset quick (at its baseline)",
    "host_overhead_after": "bench/host_overhead.py --preset quick",
    "radix_micro_quick": "bench/radix_micro.py --preset quick",
    "http_vs_rpc_quick": "bench/http_vs_rpc.py --preset quick",
    "rpc_vs_engine_quick": "bench/rpc_vs_engine.py --preset quick",
    "draft_sources": "bench/draft_sources.py",
    "virtual_kv_quick": "bench/virtual_kv.py --preset quick",
    "virtual_kv_full": "bench/virtual_kv.py --preset full",
    "http_hop_quick": "bench/http_hop.py --a /tmp/base --b . (/tmp/base: a worktree of e9eb8a4) "
                      "@d83c928",
    "forks": "bench/forks.py @d0c3693",
    "lang_quick": "bench/lang_select_fork.py --preset quick @d0c3693",
    "lang_full": "bench/lang_select_fork.py --preset full @d0c3693",
}
"""Records of answered studies, by the script that made them: at `LAST_WITH_STUDIES`, or at
the commit after its `@`."""


def commands() -> dict[str, str]:
    """Every record's stem -> the command that regenerates it."""
    found = {stem: f"python -m bench {name} {argv}".rstrip()
             for name, study in STUDIES.items() for stem, argv in study.results.items()}
    found |= SOAK
    for stem, entry in HISTORICAL.items():
        script, _, commit = entry.partition(" @")
        found[stem] = f"historical: python {script} at {commit or LAST_WITH_STUDIES}"
    return found
