"""radixserve benchmarks: workloads, runners, metrics, machine limits, reports.

Entry point: ``python bench/run.py --preset quick`` (see bench/run.py). The radix tree
microbenchmark is ``python bench/radix_micro.py --preset quick``.
"""
