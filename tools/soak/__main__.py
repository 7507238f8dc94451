"""`python -m tools.soak` (the options: `python -m tools.soak --help`)."""

from tools.soak.main import main

main()
