"""The ZeroMQ plumbing the tokenizer process and the router share: binding sockets
(`sockets.py`), replies to clients with a bounded backlog (`replies.py`) and the cache
events feed (`cache_events.py`)."""
