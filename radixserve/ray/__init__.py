"""radixserve on Ray Serve (docs/ray.md): `radixserve.ray:app`, an application builder in
Ray's convention, whose replicas are whole radixserve servers, routed by their radix trees.

Optional: `ray[serve]` (`pip install radixserve[ray]`) is imported only in this package;
the core never needs it."""

from radixserve.ray.app import app, build_app

__all__ = ["app", "build_app"]
