"""How a model is cut across the ranks of a tensor-parallel group (Megatron-style).

Each rank holds: its share of the query heads and of the MLP's intermediate size
(column-parallel q/gate/up, row-parallel o/down); its share of the KV heads, or, where
there are fewer KV heads than ranks, one whole KV head that `world / num_kv_heads` ranks
hold alike (replicated, as vLLM does), always the one its query heads read; and a
contiguous range of the vocabulary (the embedding's rows and the LM head's).
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.model.config import ModelConfig
from radixserve.model.linear import ShardSpec


@dataclass(frozen=True)
class ModelShards:
    rank: int
    world: int
    num_heads: int
    """Query heads on this rank."""
    num_kv_heads: int
    """KV heads on this rank (the KV pool's heads)."""
    kv_replicas: int
    """Ranks holding the same KV head (1: KV heads are split, not replicated)."""
    vocab_rows: int
    """Rows of the vocabulary per rank (the last rank's range may end past the vocabulary:
    those rows do not exist, and their logits are never returned)."""

    @classmethod
    def of(cls, config: ModelConfig, rank: int = 0, world: int = 1) -> ModelShards:
        """This rank's cut; ValueError naming the dimension that does not divide."""
        heads, kv = config.num_heads, config.num_kv_heads
        for name, n in (("num_attention_heads", heads),
                        ("intermediate_size", config.intermediate_size)):
            if n % world:
                raise ValueError(f"tensor parallelism over {world} ranks needs the model's "
                                 f"{name} ({n}) to divide by {world}")
        if kv % world and world % kv:
            raise ValueError(f"tensor parallelism over {world} ranks needs the model's "
                             f"num_key_value_heads ({kv}) to divide by {world} (each rank "
                             f"its share) or {world} to divide by it (each KV head on "
                             f"{world}/{kv} ranks)")
        replicas = max(1, world // kv)
        return cls(rank, world, heads // world, max(1, kv // world), replicas,
                   -(-config.vocab_size // world))

    def column(self) -> ShardSpec:
        return ShardSpec("column", self.rank, self.world)

    def row(self) -> ShardSpec:
        return ShardSpec("row", self.rank, self.world)

    def kv_column(self) -> ShardSpec:
        """The k and v projections' cut: by KV head, several ranks alike when replicated."""
        return ShardSpec("column", self.rank // self.kv_replicas, self.world // self.kv_replicas)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows
