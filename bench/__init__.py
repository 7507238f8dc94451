"""radixserve benchmarks, one suite: `python -m bench` (bench/__main__.py) lists the studies
and every record's command. The runner is bench/run.py (workloads x peers, or this checkout
against a commit with `--baseline`); the GPU run is bench/gpu/run.py."""
