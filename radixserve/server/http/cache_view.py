"""`GET /cache/view`: the radix tree as an HTML page for a person, self-contained (inline
CSS, no script, no external asset): an indented tree of the summary's nodes, each a bar
whose width is its tokens (relative to the largest prefix) and whose colour is its hits
(pale: cold, deep orange: the hottest), with its tier and a pin mark, and the first words
of its own edge (where it branches off; a top node's: its prefix's; the prefix's first
words on hover); then the pins and the totals per tier. All text from the cache is
HTML-escaped: it is users' prompts."""

from __future__ import annotations

from html import escape
from typing import Any

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em}table{border-collapse:collapse;margin:.5em 0 1.5em}
td,th{padding:2px 10px;border-bottom:1px solid #ddd;text-align:left}
.node{display:flex;align-items:center;gap:8px;margin:2px 0;white-space:nowrap}
.bar{height:16px;border-radius:3px;min-width:3px;flex:none}
.tier{font-size:11px;padding:0 4px;border-radius:3px;background:#dde7f5}
.tier.disk{background:#e4e4e4}.pin{color:#b00;font-weight:bold}
.meta{color:#666;font-size:12px}.text{font-family:ui-monospace,monospace;color:#333}
.legend span{display:inline-block;width:14px;height:10px;margin:0 2px}
"""


def _colour(hits: int, hottest: int) -> str:
    """Light yellow (no hits) to deep orange (the most hits); grey for the disk tier."""
    share = hits / hottest if hottest else 0.0
    return f"hsl({50 - 35 * share:.0f},90%,{85 - 40 * share:.0f}%)"


def _snippet(text: str, limit: int = 120) -> str:
    one_line = " ".join(text.split())
    return one_line if len(one_line) <= limit else one_line[:limit - 1] + "\u2026"


def _expiry(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:.0f}s"


def render_cache_page(info: dict[str, Any]) -> str:
    """The page for `describe_cache`'s answer (nodes in tree order, each after its parent)."""
    nodes = info["nodes"]
    widest = max((n["prefix_tokens"] for n in nodes), default=1) or 1
    hottest = max((n["hits"] for n in nodes), default=0)
    rows = []
    for n in nodes:
        width = max(3, round(400 * n["tokens"] / widest))
        colour = "#bbb" if n["tier"] == "disk" else _colour(n["hits"], hottest)
        pin = '<span class="pin" title="pinned">&#128204; pinned</span>' if n["pinned"] else ""
        rows.append(
            f'<div class="node" style="margin-left:{24 * n["depth"]}px">'
            f'<div class="bar" style="width:{width}px;background:{colour}" '
            f'title="{n["tokens"]} tokens, {n["hits"]} hits"></div>'
            f'<span class="tier {escape(n["tier"])}">{escape(n["tier"])}</span>{pin}'
            f'<span class="meta">{n["tokens"]} tok (to {n["prefix_tokens"]}), '
            f'{n["hits"]} hits, idle {n["idle_seconds"]:.0f}s</span>'
            f'<span class="text" title="{escape(" ".join(n["text"].split()))}">'
            f'{escape(_snippet(n["edge_text"] if n["depth"] else n["text"]))}</span></div>')
    pins = "".join(
        f"<tr><td>{p['tokens']}</td><td>{_expiry(p['expires_in'])}</td>"
        f"<td class=\"text\">{escape(_snippet(p['text']))}</td></tr>" for p in info["pins"])
    totals = "".join(
        f"<tr><td>{escape(tier)}</td><td>{t['nodes']}</td><td>{t['tokens']}</td>"
        f"<td>{t['pinned_tokens']}</td><td>{t['hits']}</td></tr>"
        for tier, t in info["totals"].items())
    tree = "".join(rows) or "<p>The cache is empty.</p>"
    return (
        "<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>radixserve cache</title>"
        f"<style>{_STYLE}</style></head><body><h1>Radix cache</h1>"
        "<p class=\"legend\">Bar width: tokens of the node's edge, relative to the longest "
        "prefix. Colour: hits <span style=\"background:hsl(50,90%,85%)\"></span>few "
        "<span style=\"background:hsl(15,90%,45%)\"></span>many. Indent: depth in the tree."
        f"</p>{tree}<h2>Pins</h2><table><tr><th>tokens</th><th>expires in</th><th>text</th>"
        f"</tr>{pins}</table><h2>Totals per tier</h2><table><tr><th>tier</th><th>nodes</th>"
        "<th>tokens</th><th>pinned tokens</th><th>hits</th></tr>"
        f"{totals}</table><p class=\"meta\">max pinned tokens: {info['max_pinned_tokens']}"
        "</p></body></html>")
