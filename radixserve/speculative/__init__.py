"""Speculative decoding without a draft model: draft sources and their bookkeeping."""
