"""The fixtures of tests/ray (tests/ray/cluster.py), where `ray` is installed; where it is
not (an optional extra), each test module skips itself (`pytest.importorskip`)."""

import importlib.util

if importlib.util.find_spec("ray") is not None:
    from tests.ray.cluster import cluster, plain, served, tiny  # noqa: F401
