"""The suite's one entry point.

    python -m bench                              # the studies, and each record's command
    python -m bench run --preset quick           # workloads x peers (bench/run.py)
    python -m bench run --baseline COMMIT ...    # this checkout against COMMIT
    python -m bench lora --preset quick          # a study (bench/studies.py lists them)

A study runs as its own script would (`python bench/<study>.py ARGS`): the same options,
the same record under bench/results/.
"""

from __future__ import annotations

import runpy
import sys

from bench.studies import STUDIES, commands


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(__doc__)
        for name, study in STUDIES.items():
            print(f"  {name:<17} {study.question}")
        print("\nRecords under bench/results/ and their commands:")
        for stem, command in sorted(commands().items()):
            print(f"  {stem:<30} {command}")
        return
    name, *rest = argv
    if name not in STUDIES:
        raise SystemExit(f"no study {name!r}; known: {', '.join(STUDIES)}")
    sys.argv = [f"bench/{name}.py", *rest]
    runpy.run_module(f"bench.{name}", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
