"""Tools that run against radixserve from outside it: the soak (`python -m tools.soak`)."""
