"""`python -m bench.soak` (the options: `python -m bench.soak --help`)."""

from bench.soak.main import main

main()
