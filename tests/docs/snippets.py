"""The code in the README and docs/, as the tests read it.

Every fenced block carries its kind in an HTML comment on the line before it, which GitHub
does not render:

    <!-- snippet: run-server -->
    ```bash
    curl localhost:30000/health
    ```

- `run-server`: runs as written against a server started with `radixserve serve` and
  against `radixserve serve --replicas 2`, with the default ports (30000 HTTP, 30001 RPC)
  rewritten to the test's;
- `run`: runs as written on its own (it starts its own Engine or server);
- `commands`: not run (it starts a long-lived server, or needs other machines): each command
  is checked to exist with the options it uses (`commands_in`);
- `text`: not code (a shape on the wire, a diagram).

A block without a kind fails the suite, so no new snippet escapes being checked.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
KINDS = ("run-server", "run", "commands", "text")
_KIND = re.compile(r"<!--\s*snippet:\s*([a-z-]+)\s*-->")
_PORTS = re.compile(r"(localhost|127\.0\.0\.1):3000([01])\b")


@dataclass(frozen=True)
class Snippet:
    page: Path
    line: int
    """The line of the opening fence (1-based)."""
    lang: str
    kind: str | None
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    def on_ports(self, http_port: int, rpc_port: int) -> str:
        """The text with the default HTTP and RPC ports rewritten."""
        return _PORTS.sub(lambda m: f"{m.group(1)}:{(http_port, rpc_port)[int(m.group(2))]}",
                          self.text)


def snippets(page: Path) -> list[Snippet]:
    """The fenced blocks of `page`, each with the kind its preceding comment names."""
    lines = page.read_text().splitlines()
    found: list[Snippet] = []
    i = 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        kind = _KIND.fullmatch(before.strip())
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        found.append(Snippet(page, i + 1, lines[i][3:].strip(), kind and kind.group(1),
                             "\n".join(lines[i + 1:end]) + "\n"))
        i = end + 1
    return found


def all_snippets() -> list[Snippet]:
    return [s for page in PAGES for s in snippets(page)]


@dataclass(frozen=True)
class Command:
    """One documented command line: the program (`radixserve serve`, `python bench/run.py`,
    `bash scripts/test.sh`) and the options it passes."""

    where: str
    program: tuple[str, ...]
    options: tuple[str, ...]


def _command(where: str, words: list[str]) -> Command | None:
    words = [w.strip("[]") for w in words if w.strip("[]")]
    if words[:1] in (["python"], [".venv/bin/python"]) and words[1:2] == ["-m"]:
        words = words[2:]
    elif words[:1] in (["python"], [".venv/bin/python"], ["bash"]):
        words = words[1:]
    elif words[:1] == [".venv/bin/radixserve"]:
        words = ["radixserve", *words[1:]]
    if not words:
        return None
    if words[0] == "radixserve":
        program = tuple(words[:2])
    elif words[0].endswith((".py", ".sh")):
        program = (words[0],)
    else:
        return None  # curl, openssl, sysctl...: not ours to check
    options = tuple(o for w in words if w.startswith("--")
                    for o in w.split("=")[0].split("/"))  # `--host/--port`: two options
    return Command(where, program, options)


def _without_comments(text: str) -> str:
    """Shell text with its `# ...` comments removed (not a `#` inside quotes or a word)."""
    out, quote, i = [], "", 0
    while i < len(text):
        c = text[i]
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or text[i - 1].isspace()):
            i = text.find("\n", i)
            if i < 0:
                break
            c = "\n"
        out.append(c)
        i += 1
    return "".join(out)


def _words(text: str) -> list[list[str]]:
    """Shell text as commands of words: quotes kept whole across lines, continuation lines
    joined, comments dropped, split at newlines, `;`, `&&`, `|`."""
    text = _without_comments(text.replace("\\\n", " "))
    lexer = shlex.shlex(text, posix=True, punctuation_chars="();<>|&\n")
    lexer.whitespace, lexer.whitespace_split = " \t\r", True
    commands: list[list[str]] = [[]]
    for word in lexer:
        if word.strip("();<>|&\n"):
            commands[-1].append(word)
        elif commands[-1]:
            commands.append([])
    return [c for c in commands if c]


def commands_in(snippet: Snippet) -> list[Command]:
    """The commands of a shell block."""
    found = (_command(snippet.where, words) for words in _words(snippet.text))
    return [c for c in found if c]


def inline_commands(page: Path) -> list[Command]:
    """Commands written inline (`radixserve serve --kv-disk-dir DIR`, `python bench/x.py
    --preset full`) in the prose of `page`, outside fenced blocks."""
    prose = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    found = []
    for span in re.findall(r"`([^`\n]+)`", prose):
        if re.match(r"(radixserve [a-z]+( |$)|(\.venv/bin/)?python (-m radixserve|bench/|"
                    r"examples/|scripts/)|bash scripts/)", span):
            command = _command(f"{page.relative_to(ROOT)} (`{span}`)", _words(span)[0])
            if command:
                found.append(command)
    return found
