"""The cache-aware router: one front door over several radixserve replicas.

It speaks a server's RPC protocol and HTTP API, and sends each generate call to the
replica whose radix tree holds most of its prompt (from the cache events each replica
publishes), else to the least loaded one. Installed as `radixserve.router`.
"""
