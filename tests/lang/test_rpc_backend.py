"""The DSL over RPC (RuntimeEndpoint) gives what it gives in-process, streams, and counts
the server's cache hits."""

from __future__ import annotations

import pytest

import radixserve.lang as sgl
from radixserve.server.runtime import Runtime
from tests.server.conftest import assert_server_idle

SYSTEM = "You are a librarian who answers in one short sentence. " * 4


@sgl.function
def program(s, question):
    s += sgl.system(SYSTEM)
    s += sgl.user(question)
    s += sgl.assistant_begin()
    s += "Category:" + sgl.select("kind", choices=[" fiction", " science", " history"])
    s += "\nAnswer:" + sgl.gen("answer", max_tokens=4)
    s += sgl.assistant_end()
    forks = s.fork(2)
    forks += lambda i: (sgl.user(f"Give hint {i + 1}.")
                        + sgl.assistant(sgl.gen("hint", max_tokens=4)))
    forks.join()


@pytest.fixture(scope="module")
def endpoint(model_dir):
    with Runtime(str(model_dir), max_total_tokens=8192, debug_invariants=True) as rt:
        ep = sgl.RuntimeEndpoint(rt.rpc_address, timeout=300)
        yield ep
        ep.shutdown()
        assert_server_idle(rt.rpc_address)


class TestRuntimeEndpoint:
    def test_same_results_as_in_process(self, endpoint, backend):
        kw = dict(question="Who was Napoleon?", temperature=0)
        remote = program.run(backend=endpoint, **kw)
        local = program.run(backend=backend, **kw)
        assert remote.error() is None, remote.error()
        assert remote.text() == local.text()
        assert remote["hint"] == local["hint"]
        stats = endpoint.stats()
        assert stats["requests"] >= 6 and stats["cache_hit_rate"] > 0.5, stats
        assert endpoint.runtime_stats()["cache_hit_rate"] > 0

    def test_streams_pieces(self, endpoint):
        @sgl.function
        def story(s):
            s += "Once upon a time" + sgl.gen("story", max_tokens=6, temperature=0)

        state = story.run(backend=endpoint, stream=True)
        pieces = list(state.text_iter("story"))
        assert len(pieces) > 1 and "".join(pieces) == state["story"]
