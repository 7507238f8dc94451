"""How calls reach the front door and the router, and replies leave them: binding sockets
(`sockets.py`), replies to clients with a bounded backlog (`replies.py`), the cache events
feed (`cache_events.py`), and the in-process hand-off from the HTTP server's thread
(`in_process.py`)."""
