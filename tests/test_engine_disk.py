"""The disk tier with the default model: a pool too small for the workload sends prefixes
to disk and brings them back, a restart on the same directory resumes warm, and a damaged
file is a miss; greedy output equals transformers throughout, and the block invariant
(disk entries included) holds after every step."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from radixserve.disk_layout import entry_path
from tests.conftest import assert_blocks_accounted
from tests.factories import tiny_model_dir
from tests.test_engine_exact import assert_matches_reference

POOL = 640
"""KV tokens: room for one of the prompts below at a time, and a little more."""
NEW = 6


def prompts(tokenizer, n: int) -> list[list[int]]:
    """`n` distinct prompts of ~330 tokens: two cannot sit in the pool together."""
    out = []
    for i in range(n):
        system = (f"You are assistant number {i}. " + " ".join(
            f"Rule {j}: answer about topic {i * 31 + j} briefly." for j in range(30)))
        out.append(tokenizer.encode(system + f" Question {i}: what is {i} plus {i}?"))
    return out


def greedy(engine, ids: list[int]) -> dict:
    return engine.generate(input_ids=ids, sampling_params={
        "max_new_tokens": NEW, "temperature": 0, "ignore_eos": True})


def disk_engine(make_engine, directory: Path, **config):
    return make_engine(max_total_tokens=POOL, kv_disk_dir=str(directory), **config)


class TestDiskTier:
    def test_evicted_prefixes_come_back_from_disk_exactly(self, make_engine, hf, tokenizer,
                                                          tmp_path):
        engine = disk_engine(make_engine, tmp_path)
        batch = prompts(tokenizer, 3)
        for ids in batch:  # each evicts the one before: to disk
            assert greedy(engine, ids)["meta_info"]["cached_tokens"] == 0
        stats = engine.stats()
        assert stats["disk_tokens"] > 0 and stats["disk_stores"] > 0
        for i, ids in enumerate(batch):
            res = greedy(engine, ids)
            meta = res["meta_info"]
            assert meta["cached_tokens_details"]["disk"] > 300, meta
            assert meta["cached_tokens"] == sum(meta["cached_tokens_details"].values())
            assert_matches_reference(res["output_ids"], hf.greedy(ids, NEW), f"disk hit #{i}")
        stats = engine.stats()
        assert stats["disk_loads"] >= 3 and stats["disk_hit_tokens"] > 900
        assert stats["disk_load_failures"] == 0

    def test_a_batch_that_outgrows_the_pool_with_the_disk_tier(self, make_engine, hf,
                                                               tokenizer, tmp_path):
        """Requests in flight together, with eviction and loads in the same steps, and a
        chunk size that splits every prompt."""
        engine = disk_engine(make_engine, tmp_path, chunked_prefill_size=96)
        batch = prompts(tokenizer, 3)
        for ids in batch:
            greedy(engine, ids)
        results = engine.generate(input_ids=batch + batch[:1], sampling_params={
            "max_new_tokens": NEW, "temperature": 0, "ignore_eos": True})
        for i, (ids, res) in enumerate(zip(batch + batch[:1], results)):
            assert_matches_reference(res["output_ids"], hf.greedy(ids, NEW), f"batch #{i}")
        assert engine.stats()["disk_loads"] > 0

    @pytest.mark.parametrize("damage", ["corrupted", "truncated", "missing"])
    def test_a_damaged_file_is_a_miss(self, make_engine, hf, tokenizer, tmp_path, caplog,
                                      damage):
        engine = disk_engine(make_engine, tmp_path)
        first, second = prompts(tokenizer, 2)
        greedy(engine, first)
        greedy(engine, second)  # first goes to disk
        with engine._lock:  # the files are written off the step's path: wait for them
            engine.worker.disk.sync()
        entries = [n.disk_id for n in engine.scheduler.cache.radix_cache.nodes() if n.on_disk]
        assert entries
        for entry in entries:
            path = entry_path(tmp_path, entry)
            data = path.read_bytes()
            if damage == "corrupted":
                path.write_bytes(data[:-100] + bytes(b ^ 0xFF for b in data[-100:]))
            elif damage == "truncated":
                path.write_bytes(data[:len(data) // 2])
            else:
                path.unlink()
        with caplog.at_level(logging.WARNING, logger="radixserve.worker.kv_disk"):
            res = greedy(engine, first)
        assert res["meta_info"]["cached_tokens_details"]["disk"] == 0
        assert_matches_reference(res["output_ids"], hf.greedy(first, NEW), f"{damage} file")
        assert engine.stats()["disk_load_failures"] >= 1
        assert "a miss" in caplog.text

    def test_a_restart_resumes_warm_and_another_model_starts_cold(self, make_engine, hf,
                                                                  tokenizer, tmp_path, caplog):
        first, second = prompts(tokenizer, 2)
        engine = disk_engine(make_engine, tmp_path / "kv")
        cold = greedy(engine, first)
        greedy(engine, second)
        engine.shutdown()  # writes every cached prefix out and saves the index
        assert (tmp_path / "kv" / "index.msgpack").exists()
        engine = disk_engine(make_engine, tmp_path / "kv")
        assert engine.stats()["disk_tokens"] > 600  # both prompts, on disk
        for ids in (first, second):
            res = greedy(engine, ids)
            assert res["meta_info"]["cached_tokens_details"]["disk"] > 300
            assert_matches_reference(res["output_ids"], hf.greedy(ids, NEW), "after restart")
        assert greedy(engine, first)["output_ids"] == cold["output_ids"]
        engine.shutdown()
        from radixserve import Engine

        with caplog.at_level(logging.WARNING, logger="radixserve.cache.persist"):
            other = Engine(str(tiny_model_dir(tmp_path / "models")), max_total_tokens=POOL,
                           kv_disk_dir=str(tmp_path / "kv"), debug_invariants=True)
        try:
            assert "another model" in caplog.text
            assert other.stats()["disk_tokens"] == 0
            assert greedy(other, first)["meta_info"]["cached_tokens"] == 0
            assert_blocks_accounted(other)
        finally:
            other.shutdown()
        assert not [p for p in os.listdir(tmp_path / "kv") if p.endswith(".kv")
                    and int(p[:-3], 16) not in other.scheduler.cache.radix_cache.disk.entries]

    def test_the_index_is_saved_while_serving(self, make_engine, tokenizer, tmp_path):
        engine = disk_engine(make_engine, tmp_path / "kv", kv_persist_interval=0.001)
        first, second = prompts(tokenizer, 2)
        greedy(engine, first)
        greedy(engine, second)  # first is on disk, and a step has run since
        assert (tmp_path / "kv" / "index.msgpack").exists()

    def test_the_cache_view_shows_the_disk_tier(self, make_engine, tokenizer, tmp_path):
        engine = disk_engine(make_engine, tmp_path)
        first, second = prompts(tokenizer, 2)
        greedy(engine, first)
        greedy(engine, second)
        info = engine.cache_info()
        tiers = {n["tier"] for n in info["nodes"]}
        assert tiers == {"memory", "disk"}
        assert info["totals"]["disk"]["tokens"] > 300
        on_disk = [n["text"] for n in info["nodes"] if n["tier"] == "disk" and n["depth"] == 0]
        assert any("assistant number 0" in text for text in on_disk), info["nodes"]
