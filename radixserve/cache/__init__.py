"""KV-cache bookkeeping: the block allocator and the radix tree of cached prefixes.

Pure Python data structures (no torch): the scheduler owns them; the worker only ever
sees the block ids they hand out.
"""

from radixserve.cache.allocator import AllocatorError, BlockAllocator
from radixserve.cache.events import TreeEvents
from radixserve.cache.node import InsertResult, MatchResult, RadixNode
from radixserve.cache.radix import RadixCache

__all__ = [
    "AllocatorError",
    "BlockAllocator",
    "InsertResult",
    "MatchResult",
    "RadixCache",
    "RadixNode",
    "TreeEvents",
]
