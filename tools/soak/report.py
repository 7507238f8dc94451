"""The verdict (the pass criteria) and the report: JSON, and the markdown derived from it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tools.soak.attacks import attack_table
from tools.soak.state import KILL_WINDOW_GRACE_S


def growth(start: float, end: float) -> float:
    return (end - start) / start if start else 0.0


def verdict(r: dict[str, Any]) -> dict[str, Any]:
    """The pass criteria; a figure the run could not measure (the server died or hung)
    fails its check."""
    s = r["soak"]
    measured = r["start"] is not None and r["end"] is not None
    rss_growth = growth(r["start"]["rss_mib"], r["end"]["rss_mib"]) if measured else None
    fd_growth = growth(r["start"]["fds"], r["end"]["fds"]) if measured else None
    checks = {
        "the server lived through the run": not r.get("server_dead"),
        "wrong answers = 0": s["wrong_answers"] == 0 and r["warmup"]["wrong_answers"] == 0,
        "KV blocks leaked = 0": r["leaked_blocks"] == 0,
        "RSS growth < 5%": rss_growth is not None and rss_growth < 0.05,
        "open fds growth < 5%": fd_growth is not None and fd_growth < 0.05,
        "no unexpected failure": not s["failed_unexpected"],
        "attacks: 0 unexplained failures": all(
            p.get("attacks", {}).get("total", {}).get("unexplained", 0) == 0
            for p in (s, r["warmup"])),
        "every worker kill survived": all(x["served_again"] and x.get("probe_correct")
                                          for x in r["restarts"]),
        "at rest the server agrees with the reference": not r["cases"]["at_rest_mismatches"],
        "no process left after shutdown": not r["orphans"],
    }
    return {"rss_growth": rss_growth and round(rss_growth, 4),
            "fd_growth": fd_growth and round(fd_growth, 4),
            "checks": checks, "passed": all(checks.values())}


def write(r: dict[str, Any], stem: Path) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(r, indent=1, default=str))
    md = markdown(r)
    stem.with_suffix(".md").write_text(md)
    print(md)


def markdown(r: dict[str, Any]) -> str:
    s, m, v, sched = r["soak"], r["machine"], r["verdict"], r["scheduler"]
    a = r["settings"]
    lim = r["limits"]
    kills = r["restarts"]
    survived = sum(1 for k in kills if k["served_again"] and k.get("probe_correct"))
    failed_by = ", ".join(f"{k} {n}" for k, n in sorted(s["failed_expected"].items())) or "none"
    unexpected = ", ".join(f"{k} {n}" for k, n in sorted(s["failed_unexpected"].items())) or "none"
    st, en = r["start"], r["end"]
    gone = "not measured: the server is gone"
    w = r["warmup"]
    lines = [
        (f"# Soak: {s['wall_s'] / 60:.1f} minutes of mixed RPC and HTTP traffic, "
         + (f"a worker kill every {a['kill_every']:g} s" if a["kill_every"] else "no worker kill"))
        if s["wall_s"] >= 1 else "# Soak: not run (the server was gone after the warm-up)",
        "",
        f"Commit `{m['commit_full']}` ({m['commit']}), {m['cpu']}, {m['cores']} cores, "
        f"{m['memory_gib']} GiB; torch {m['torch']}, transformers {m['transformers']}, "
        f"Python {m['python']}. Measured limits before the server started: fp32 matmul "
        f"{lim['matmul_gflops']:.1f} GFLOP/s, memory read {lim['read_gbs']:.1f} GB/s. Load "
        f"average at start {m['loadavg_at_start'][0]:.2f}, at end {r['loadavg_at_end'][0]:.2f}.",
        "",
        f"Server: model `{a['model']}` ({r['server']['dtype']}, {r['server']['device']}), KV pool "
        f"{r['server']['max_total_tokens']} tokens ({r['server']['num_blocks']} blocks of "
        f"{r['server']['page_size']}), `debug_invariants=True` (the block invariant checked "
        f"after every step), `init_new_token_ratio` {a['init_new_token_ratio']:g} (the "
        "server's default is 0.7: admission here overcommits the small pool, so running "
        f"requests are retracted often), max_prompt_chars {a['max_prompt_chars']}. Clients: "
        f"{a['rpc_threads']} RPC `Client` threads, {a['async_tasks']} `AsyncClient` tasks, "
        f"{a['http_threads']} HTTP threads (`/generate` and `/v1/chat/completions`), one chaos "
        f"thread (malformed frames, vanishing raw clients); call timeout {a['call_timeout']:g} s."
        + (f" Attacker: one thread, an attack every {a['attack_every']:g} s on average "
           f"({', '.join(a['attacks'])}), each bounded by {a['attack_timeout']:g} s; tenants "
           "`alice` and `bob` (the traffic's clients take turns), the idle checks and flushes "
           "with the operator's key." if a.get("attack_every") else "")
        + (" Environment: " + ", ".join(f"`{k}={v}`" for k, v in a["environment"].items()) + "."
           if a.get("environment") else ""),
        "",
        "| figure | value |", "|---|---|",
        f"| calls sent | {s['sent']} |",
        f"| completed (answered in full; greedy ones checked) | {s['completed']} "
        f"({s['greedy_checked']} greedy answers checked) |",
        f"| aborted by the soak mid-flight (answer a prefix of the reference) | {s['aborted']} |",
        f"| disconnected by the soak on purpose (HTTP closed, stream abandoned, raw client gone) "
        f"| {s['disconnected']} |",
        f"| refused as they must be (invalid requests: 4xx / invalid_request; malformed frames: "
        f"malformed_frame or invalid_request) | {s['refused']} |",
        f"| failed, explained by a worker kill | {sum(s['failed_expected'].values())} "
        f"({failed_by}) |",
        f"| failed otherwise (must be 0) | {sum(s['failed_unexpected'].values())} ({unexpected}) |",
        f"| **wrong answers** (must be 0) | **{s['wrong_answers']}** |",
        "| **KV blocks leaked** after the final flush (must be 0) | " + (
            f"**{r['leaked_blocks']}** of {r['end_stats']['num_blocks']} |" if r["end_stats"]
            else f"{gone} |"),
        "| RSS of the server's processes, start -> end | " + (
            f"{st['rss_mib']:.0f} -> {en['rss_mib']:.0f} MiB (**{v['rss_growth']:+.1%}**) |"
            if st and en else f"{gone} |"),
        "| open file descriptors, start -> end | " + (
            f"{st['fds']} -> {en['fds']} (**{v['fd_growth']:+.1%}**) |" if st and en
            else f"{gone} |"),
        f"| worker kills survived (served again, a greedy probe right) | **{survived} of "
        f"{len(kills)}** (restart {_restart_range(kills)}) |",
        *([f"| scheduler retractions / tokens evicted from the radix cache | "
           f"{sched['retractions']} / {sched['evicted_tokens']} |",
           f"| peak pool usage, running, waiting | {sched['peak_pool_usage']:.0%}, "
           f"{sched['peak_running']}, {sched['peak_waiting']} |",
           f"| prefix cache hit rate (prompt tokens) | "
           f"{sched['prompt_cached_tokens'] / max(sched['prompt_tokens'], 1):.0%} |"]
          if sched else []),
        f"| throughput | {s['completed_per_min']:.1f} completed calls/min, "
        f"{s['output_tok_s']:.1f} output tokens/s of completed calls |",
        "",
        "Checks: " + "; ".join(f"{name}: {'yes' if ok else '**no**'}"
                               for name, ok in v["checks"].items()) + ".",
        *(["", f"**The server is gone**: {r['server_dead']}."] if r.get("server_dead") else []),
        "", f"The warm-up ({w['wall_s']:g} s): {w['sent']} calls, {w['wrong_answers']} wrong "
        "answers, failed otherwise: " + (", ".join(
            f"{k} {n}" for k, n in sorted(w["failed_unexpected"].items())) or "none") + ".",
    ]
    lines += attacks_section(r)
    if st and en:
        lines += ["", "Per process (start -> end; the scheduler and worker at the end are the "
                  "ones the last kill started, the front door, which also runs the HTTP server, "
                  "lives through the whole run):", ""]
    for name in en["processes"] if st and en else []:
        e = en["processes"][name]
        b = st["processes"].get(name)
        was = f"{b['rss_mib']:.0f} MiB, {b['fds']} fds -> " if b else ""
        change = f" ({growth(b['rss_mib'], e['rss_mib']):+.1%} RSS)" if b else ""
        lines.append(f"- {name}: {was}{e['rss_mib']:.0f} MiB, {e['fds']} fds{change}")
    worker = [(x["t_s"], x["rss_mib_each"].get("worker")) for x in r["samples"]
              if x.get("rss_mib_each", {}).get("worker") is not None]
    if worker:
        lines += ["", "Worker RSS during the soak, MiB (every 30 s; each kill starts a new "
                  "worker, and a small value is one still loading): "
                  + ", ".join(f"{mib:.0f}" for _, mib in worker) + "."]
    lines += [
        "", "Calls by kind: " + ", ".join(f"{k} {n}" for k, n in s["sent_by_kind"].items()) + ".",
        "", "How it is measured:", "",
        f"- The start figures are taken after a {a['warmup_seconds']:g} s warm-up of the same "
        "traffic (no kill), so that allocator pools, caches and lazy imports have reached "
        "steady state; both start and end are taken idle, after a cache flush, with only the "
        "control client connected. RSS is summed over the front door, scheduler and worker "
        "(shared library pages count once per process, the same at both ends).",
        "- Greedy references: transformers, fp32, one prompt at a time, computed before the "
        f"server started; {r['cases']['cases']} chat-formatted prompts (of "
        f"{r['cases']['prompt_tokens']} tokens; several share a system prompt of some 400 "
        f"tokens), each cut before its first near-tie (top-2 logits within 1e-4): "
        f"{r['cases']['cut_at_near_tie'] or 'none was'}. So every greedy answer, whatever the "
        "batch it ran in, must equal its reference exactly (ids on RPC and /generate, text on "
        "the chat route); one aborted mid-way must be a prefix of it.",
        "- Failures `worker_died` and `not_ready` count as explained only within a kill's "
        f"window (kill -> served again + {KILL_WINDOW_GRACE_S:g} s); any other failure, and a "
        "call with no answer within the call timeout (`no_answer`), counts against the run.",
        "- Retractions and evictions are the scheduler's own counters, polled every 5 s and "
        "summed over the schedulers the kills started (so a few seconds before each kill are "
        "missing: at least these many).",
        f"- The machine has {m['cores']} cores, shared during the run with other jobs (the load "
        "average above); throughput is modest for that reason and because every step checks "
        "the block invariant. The point of this run is the correctness counts, not speed.",
    ]
    if r.get("notes"):  # written after the run, into the JSON, by whoever read it
        lines += ["", "## Notes on this run", "", *r["notes"]]
    return "\n".join(lines) + "\n"


def attacks_section(r: dict[str, Any]) -> list[str]:
    """The attacker's table (soak phase), its unexplained failures, the warm-up's total."""
    s, w = r["soak"].get("attacks"), r["warmup"].get("attacks")
    if not s or not (s["total"]["sent"] or w["total"]["sent"]):
        return []
    lines = ["", "Attacks (tools/soak/attacks/) during the soak, by kind: refused as expected "
             "(a 4xx / invalid_request / unauthorized / forbidden in time; `tenants.rid_*`: "
             "alice's stream came out whole and right), served where the issue allows it, "
             "failed in a worker kill's window, and unexplained (must be 0):", "",
             *attack_table(s)]
    wt = w["total"]
    lines += ["", f"During the warm-up: {wt['sent']} attacks, {wt['refused']} refused, "
              f"{wt['served']} served, {wt['explained']} failed in a kill's window, "
              f"**{wt['unexplained']} unexplained**."]
    examples = s["unexplained_examples"] + w["unexplained_examples"]
    if examples:
        lines += ["", "Unexplained attack failures (the first of each kind and reason):", ""]
        seen = set()
        for e in examples:
            if (e["kind"], e["reason"]) not in seen:
                seen.add((e["kind"], e["reason"]))
                lines.append(f"- {e['kind']}: {e['reason']}: {e['detail'][:200]}")
    return lines


def _restart_range(kills: list[dict[str, Any]]) -> str:
    if not kills:
        return "no kill"
    times = [k["restart_s"] for k in kills]
    return f"{min(times):.1f}-{max(times):.1f} s"
