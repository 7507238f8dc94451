"""radixserve: a prefix-caching LLM serving runtime built on a global radix tree."""
