"""`python -m tools.soak`: the options, the server, the two phases and the report."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil

import tools.soak
from bench.machine import machine_info, measure_limits
from tools.soak.attacks import GROUPS, TENANTS, Sentinel
from tools.soak.cases import build_cases
from tools.soak.monitor import Monitor, names_of, process_tree
from tools.soak.phases import run_traffic, settle, summarize
from tools.soak.report import markdown, verdict, write
from tools.soak.state import Phase, Soak
from radixserve.client import Client, ServerError
from radixserve.config import ServerConfig


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.soak",
                                     description=tools.soak.__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="length of the soak phase")
    parser.add_argument("--max-requests", type=int, default=1_000_000,
                        help="stop sending after this many calls (warm-up included)")
    parser.add_argument("--warmup-seconds", type=float, default=90.0)
    parser.add_argument("--kill-every", type=float, default=180.0,
                        help="seconds between worker kills (0: none)")
    parser.add_argument("--max-total-tokens", type=int, default=1536,
                        help="KV pool size: small, so eviction and retraction never stop")
    parser.add_argument("--init-new-token-ratio", type=float, default=0.3,
                        help="admission's first estimate of the share of max_new_tokens a "
                        "request will use: lower than the server's 0.7, so admission overcommits "
                        "the small pool and running requests get retracted often")
    parser.add_argument("--max-prompt-chars", type=int, default=20_000)
    parser.add_argument("--rpc-threads", type=int, default=3)
    parser.add_argument("--http-threads", type=int, default=3)
    parser.add_argument("--async-tasks", type=int, default=3)
    parser.add_argument("--call-timeout", type=float, default=300.0,
                        help="seconds a call may wait for an answer (else: no_answer)")
    parser.add_argument("--attack-every", type=float, default=3.0,
                        help="mean seconds between the attacker's attacks (0: no attacker)")
    parser.add_argument("--attack-timeout", type=float, default=30.0,
                        help="seconds an attack may wait for its refusal (else: no_answer)")
    parser.add_argument("--attacks", type=lambda v: [g for g in v.split(",") if g],
                        default=list(GROUPS), help="comma-separated attack groups, of "
                        + ", ".join(GROUPS) + " (default: all)")
    parser.add_argument("--max-server-rss-mib", type=float, default=6144.0,
                        help="past this RSS (the server's processes together) the sentinel "
                        "kills the server and ends the run (an attack growing it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parents[2] / "bench" / "results")
    parser.add_argument("--name", default="soak", help="file stem of the results")
    parser.add_argument("--render", type=Path, default=None,
                        help="only redraw the markdown from this JSON result")
    args = parser.parse_args()
    if unknown := set(args.attacks) - set(GROUPS):
        parser.error(f"unknown attack groups {sorted(unknown)}; known: {', '.join(GROUPS)}")
    if args.render is not None:  # the markdown is derived from the JSON alone
        report = json.loads(args.render.read_text())
        args.render.with_suffix(".md").write_text(markdown(report))
        return

    from radixserve.model.loader import load_tokenizer, resolve_model
    from radixserve.server.runtime import Runtime

    print("[soak] measuring the machine", flush=True)
    machine = machine_info()
    machine["commit_full"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                            text=True, cwd=Path(__file__).parent).stdout.strip()
    limits = measure_limits(quick=True)
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    print("[soak] computing the greedy references with transformers", flush=True)
    t = time.monotonic()
    cases, case_info = build_cases(model_dir, tokenizer)
    case_info["reference_s"] = round(time.monotonic() - t, 1)
    print(f"[soak] {case_info}", flush=True)

    kills_planned = int(args.minutes * 60 // args.kill_every) if args.kill_every else 0
    keys = {tenant: secrets.token_urlsafe(16) for tenant in TENANTS}
    admin_key = secrets.token_urlsafe(16)
    has_admin = "admin_api_key" in {f.name for f in dataclasses.fields(ServerConfig)}
    options = dict(max_total_tokens=args.max_total_tokens, debug_invariants=True,
                   max_worker_restarts=kills_planned + 5, max_prompt_chars=args.max_prompt_chars,
                   init_new_token_ratio=args.init_new_token_ratio,
                   min_new_token_ratio=min(0.05, args.init_new_token_ratio),
                   log_level="warning")
    shown = {**options, "api_key": [f"<key>={tenant}" for tenant in keys]}
    options["api_key"] = [f"{key}={tenant}" for tenant, key in keys.items()]
    if has_admin:  # the operator key (issue 25), where this commit's server has it
        options["admin_api_key"], shown["admin_api_key"] = admin_key, "<key>"
    report: dict[str, Any] = {"settings": {**vars(args), "out": str(args.out),
                                           "server_options": shown},
                              "machine": machine, "limits": limits, "cases": case_info}
    control_key = admin_key if has_admin else keys[TENANTS[0]]
    with Runtime(str(model_dir), **options) as rt, \
            Client(rt.rpc_address, timeout=60, api_key=control_key) as control:
        info = control.model_info()
        report["server"] = {k: info[k] for k in ("num_blocks", "page_size", "max_total_tokens",
                                                  "context_length", "device", "dtype")}
        soak = Soak(args, rt, cases, {**info, "keys": keys, "control_key": control_key,
                                      "a_token": tokenizer.convert_tokens_to_ids("a")})
        root = rt.process.popen.pid
        sentinel_done = threading.Event()
        sentinel = threading.Thread(target=Sentinel(soak, root, args.max_server_rss_mib).run,
                                    args=(sentinel_done,), name="sentinel")
        sentinel.start()

        # The references agree with the server at rest (one batch of every case), or the
        # soak's check would be meaningless.
        results = control.generate(input_ids=[c.ids for c in cases],
                                   sampling_params=[c.params for c in cases])
        report["cases"]["at_rest_mismatches"] = [
            c.name for c, r in zip(cases, results) if r["output_ids"] != c.expected]
        print(f"[soak] at rest, mismatches: {report['cases']['at_rest_mismatches']}", flush=True)

        monitor = Monitor(control, root)
        print(f"[soak] warm-up {args.warmup_seconds:.0f}s", flush=True)
        warm, phase = Phase("warm-up"), Phase("soak")
        run_traffic(soak, warm, args.warmup_seconds, None, monitor, control)
        restarts: list[dict[str, Any]] = []
        start_tree = end_tree = end_stats = pids_at_end = None
        try:
            if soak.server_dead is None:
                settle(control)
                start_tree = process_tree(root, names_of(control))
                print(f"[soak] start: {start_tree}", flush=True)
        except (ServerError, TimeoutError, psutil.Error) as e:
            soak.server_dead = f"no answer after the warm-up: {e!r}"
        if soak.server_dead is None:
            print(f"[soak] soak {args.minutes:g} min, a worker kill every {args.kill_every:g}s",
                  flush=True)
            monitor.base, monitor.last = Counter(), {}
            monitor.poll()
            counters_before = monitor.totals()
            monitor.t0 = time.monotonic()
            restarts = run_traffic(soak, phase, args.minutes * 60,
                                   args.kill_every or None, monitor, control)
            after = monitor.totals()
            report["scheduler"] = {
                **{k: after[k] - counters_before.get(k, 0) for k in Monitor.COUNTERS},
                "peak_pool_usage": round(monitor.peak_pool_usage, 3),
                "peak_running": monitor.peak_running, "peak_waiting": monitor.peak_waiting}
        try:  # a server the attacks hung or killed: the report says so instead of waiting
            if soak.server_dead is None:
                end_stats = settle(control)
                end_tree = process_tree(root, names_of(control))
                print(f"[soak] end: {end_tree}", flush=True)
                pids_at_end = control.health()["pids"]
        except (ServerError, TimeoutError, psutil.Error) as e:
            soak.server_dead = f"no answer at the end: {e!r}"
        sentinel_done.set()  # before the shutdown, which it would take for a death
        sentinel.join()
        if phase.ended is None:  # not run: the server was gone after the warm-up
            phase.ended = phase.started

        report["warmup"] = summarize(soak, warm)
        report["soak"] = summarize(soak, phase)
        report["server_dead"] = soak.server_dead
        report["restarts"] = restarts
        report.setdefault("scheduler", None)
        report["end_stats"] = end_stats and {k: end_stats[k] for k in (
            "num_blocks", "free_blocks", "evictable_blocks", "locked_blocks", "running",
            "waiting", "partial_blocks")}
        report["leaked_blocks"] = end_stats and end_stats["num_blocks"] - end_stats["free_blocks"]
        report["start"], report["end"] = start_tree, end_tree
        report["samples"] = monitor.samples
    # After shutdown: no process of the server may be left.
    time.sleep(2.0)
    report["orphans"] = [p for p in (pids_at_end or {}).values() if psutil.pid_exists(p)
                         and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    report["loadavg_at_end"] = os.getloadavg()
    report["verdict"] = verdict(report)
    write(report, args.out / args.name)
