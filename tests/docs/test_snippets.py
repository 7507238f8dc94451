"""The README's and docs' code works as written (see `tests/docs/snippets.py` for the kinds):
the `run-server` snippets (curl, `openai`, `Client`, `AsyncClient`, raw msgpack) run against
`radixserve serve` and against `radixserve serve --replicas 2`, each server left with every
KV block free; the `run` snippets (Engine, DSL, Runtime) run on their own; every other
documented command names a program and options that exist."""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from radixserve.cli import build_parser
from tests.conftest import require
from tests.docs.snippets import (KINDS, PAGES, ROOT, Command, Snippet, all_snippets,
                                 commands_in, inline_commands)
from tests.server.conftest import assert_server_idle

SNIPPETS = all_snippets()
RUN_SERVER = [s for s in SNIPPETS if s.kind == "run-server"]
RUN = [s for s in SNIPPETS if s.kind == "run"]
SNIPPET_SECONDS = 240
"""How long one snippet may run (an Engine or server of its own loads the model first)."""


def test_every_block_has_a_kind() -> None:
    unmarked = [f"{s.where} ({s.kind or 'no kind'})" for s in SNIPPETS if s.kind not in KINDS]
    assert not unmarked, (f"fenced blocks without `<!-- snippet: KIND -->` before them "
                          f"(KIND one of {KINDS}): {unmarked}")
    assert len(RUN_SERVER) >= 5 and len(RUN) >= 3  # the collector still finds the snippets


def test_python_snippets_compile() -> None:
    for s in SNIPPETS:
        if s.lang == "python":
            compile(s.text, s.where, "exec", flags=ast.PyCF_ONLY_AST)


def _documented_commands() -> list[Command]:
    blocks = [c for s in SNIPPETS if s.lang == "bash" for c in commands_in(s)]
    return blocks + [c for page in PAGES for c in inline_commands(page)]


def _radixserve_options(subcommand: str) -> set[str] | None:
    """The options `radixserve SUBCOMMAND --help` lists; None: the CLI has no such
    subcommand (argparse refuses it)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()), \
            pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([subcommand, "--help"])
    return set(re.findall(r"--[a-z0-9-]+", out.getvalue())) if exit_.value.code == 0 else None


_HELP_OF_SCRIPTS = """
import contextlib, io, json, runpy, sys
helps = {}
for path in sys.argv[1:]:
    sys.argv, sys.path[0], out = [path, "--help"], path.rsplit("/", 1)[0], io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit:
            pass
    helps[path] = out.getvalue()
print(json.dumps(helps))
"""


def test_documented_commands_exist_with_their_options() -> None:
    """Each documented `radixserve` subcommand, script and option exists (a renamed flag
    or a moved bench script fails here)."""
    commands = _documented_commands()
    assert any(c.program == ("radixserve", "serve") for c in commands)
    scripts = sorted({c.program[0] for c in commands if c.program[0] != "radixserve"})
    missing = [p for p in scripts if not (ROOT / p).is_file()]
    assert not missing, f"documented scripts that do not exist: {missing}"
    python = [p for p in scripts if p.endswith(".py")]
    out = subprocess.run([sys.executable, "-c", _HELP_OF_SCRIPTS, *python], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    helps = json.loads(out.splitlines()[-1])
    options = {("radixserve", sub): _radixserve_options(sub)
               for sub in {c.program[1] for c in commands if c.program[0] == "radixserve"}}
    wrong = []
    for c in commands:
        if c.program[0] == "radixserve" and options[c.program] is None:
            wrong.append(f"{c.where}: no subcommand {' '.join(c.program)!r}")
            continue
        known = options.get(c.program) or set(re.findall(r"--[a-z0-9-]+",
                                                         helps.get(c.program[0], "")))
        wrong += [f"{c.where}: {' '.join(c.program)} has no {o}" for o in c.options
                  if o not in known and o != "--help"]
    assert not wrong, "\n".join(wrong)


def _run(code: str, lang: str, where: str, env: dict[str, str]) -> str:
    """Run a snippet's text; its stdout, or a failure with what it wrote."""
    argv = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else \
        [sys.executable, "-c", code]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=SNIPPET_SECONDS)
    assert done.returncode == 0, (f"{where} failed ({done.returncode}):\n{code}\n"
                                  f"stdout: {done.stdout[-2000:]}\nstderr: {done.stderr[-4000:]}")
    assert done.stdout.strip(), f"{where} printed nothing"
    return done.stdout


@pytest.fixture(scope="module")
def shell_env(tmp_path_factory) -> dict[str, str]:
    """The environment snippets run in: the venv's `radixserve` and `python` first on PATH,
    and a `curl` that fails on an HTTP error (as a reader would notice a 404 page)."""
    real_curl = shutil.which("curl")
    assert real_curl, "the README's HTTP examples need curl on PATH"
    bin_dir = tmp_path_factory.mktemp("bin")
    curl = bin_dir / "curl"
    curl.write_text(f'#!/bin/sh\nexec {shlex.quote(real_curl)} --fail-with-body -sS "$@"\n')
    curl.chmod(0o755)
    venv_bin = Path(sys.executable).parent
    return {**os.environ, "PATH": f"{bin_dir}:{venv_bin}:{os.environ['PATH']}"}


@contextlib.contextmanager
def serving(extra: list[str]) -> Iterator[tuple[int, int]]:
    """`radixserve serve` as documented (plus `extra`) on free ports (0), until its ready
    line names them; stopped with SIGTERM afterwards, as Ctrl-C does. Its HTTP and RPC
    ports."""
    argv = [sys.executable, "-m", "radixserve", "serve", "--port", "0", "--rpc-port", "0",
            "--max-total-tokens", "8192", *extra]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            ready = re.search(r"ready: RPC at tcp://127\.0\.0\.1:(\d+) HTTP at "
                              r"http://127\.0\.0\.1:(\d+)", line)
            if ready:
                break
        else:
            pytest.fail(f"{argv} exited ({proc.wait()}) before its ready line")
        yield int(ready.group(2)), int(ready.group(1))
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0


@pytest.fixture(scope="module", params=[[], ["--replicas", "2"]], ids=["server", "replicas"])
def server(request) -> Iterator[tuple[int, int]]:
    """A server, then the router over two, each ending with every KV block free (through
    the router: it flushes and counts on every replica)."""
    require("openai")
    with serving(request.param) as ports:
        yield ports
        assert_server_idle(f"tcp://127.0.0.1:{ports[1]}")


@pytest.mark.parametrize("snippet", RUN_SERVER, ids=[s.where for s in RUN_SERVER])
def test_snippet_against_a_server(snippet: Snippet, server, shell_env) -> None:
    _run(snippet.on_ports(*server), snippet.lang, snippet.where, shell_env)


@pytest.mark.parametrize("snippet", RUN, ids=[s.where for s in RUN])
def test_snippet_on_its_own(snippet: Snippet, shell_env) -> None:
    _run(snippet.text, snippet.lang, snippet.where, shell_env)
