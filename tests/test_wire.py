"""The wire schema's shape: no untyped field in a struct that crosses a socket, control
operations round-trip in their envelope, and requests are named in one place
(radixserve/rids.py)."""

from __future__ import annotations

import typing

import msgspec
import pytest

import radixserve.messages as messages
from radixserve.messages import (AbortCall, CacheScope, Caller, Control, PinCall, RpcCall,
                                 SchedulerInput, UnpinCall)
from radixserve.rids import (NamingError, RidsInFlight, mint_rid, name_prompts, output_name,
                             scoped_rid)



def _mentions_any(tp: object, seen: set[int]) -> bool:
    if tp is typing.Any:
        return True
    if id(tp) in seen:
        return False
    seen.add(id(tp))
    return any(_mentions_any(arg, seen) for arg in typing.get_args(tp))


def test_no_struct_that_crosses_a_socket_has_an_untyped_field() -> None:
    structs = [obj for obj in vars(messages).values()
               if isinstance(obj, type) and issubclass(obj, msgspec.Struct)]
    assert len(structs) > 30
    untyped = [(s.__name__, name) for s in structs
               for name, tp in typing.get_type_hints(s, include_extras=True).items()
               if _mentions_any(tp, set())]
    assert not untyped, untyped


def test_a_control_operation_travels_as_its_rpc_struct_in_an_envelope() -> None:
    msg = Control(7, PinCall(call_id=3, input_ids=[1, 2, 3], ttl=5.0),
                  Caller(namespace="ns-a", scope=CacheScope("ns-", False), owner="ns-", quota=9))
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=SchedulerInput)
    assert decoded == msg and isinstance(decoded.op, PinCall)
    # The client's frame of the same operation decodes as the RPC call itself.
    call = msgspec.msgpack.decode(msgspec.msgpack.encode(
        {"type": "unpin", "call_id": 1, "all": True}), type=RpcCall)
    assert call == UnpinCall(call_id=1, all=True)


def test_rids_in_flight_are_scoped_by_tenant_and_claimed_once() -> None:
    rids: RidsInFlight[str] = RidsInFlight()
    scoped = rids.claim("a", ["x", "y"], "call-1")
    assert scoped == [scoped_rid("a", "x"), scoped_rid("a", "y")]
    rids.check_free("b", ["x"])  # another tenant may use the same rid
    with pytest.raises(ValueError, match="rid 'y' is already in use"):
        rids.check_free("a", ["z", "y"])
    with pytest.raises(ValueError, match="rid 'y' is already in use"):
        rids.claim("a", ["z", "y"], "call-2")
    assert rids.owner("a", "z") is None  # a refused claim records none of its rids
    assert rids.owner("a", "x") == "call-1" and rids.owner("b", "x") is None
    rids.release(scoped, "other-call")  # only the owner's names are released
    assert rids.owner("a", "x") == "call-1"
    rids.release(scoped, "call-1")
    assert rids.owners == {}


def test_name_prompts_mints_a_rid_per_prompt_and_keeps_the_callers() -> None:
    one = name_prompts("hi", None, None, "http")
    assert one.single and len(one.rids) == 1 and one.rid_arg == one.rids[0]
    assert one.rids[0].startswith("http-") and one.rids[0] != mint_rid("http")
    batch = name_prompts(None, [[1], [2], [3]], None, "router")
    assert not batch.single and batch.rid_arg == batch.rids and len(set(batch.rids)) == 3
    assert name_prompts("hi", None, ["mine"], "http").rid_arg == ["mine"]
    with pytest.raises(NamingError) as e:
        name_prompts(["a", "b"], None, "one", "http")
    assert e.value.field == "rid"
    with pytest.raises(NamingError) as e:
        name_prompts(None, None, None, "http")
    assert e.value.field == "text"
    assert output_name("r", 1, 2) == "r:1" and output_name("r", 0, 1) == "r"


def test_abort_is_a_control_operation_without_an_answer() -> None:
    frame = msgspec.msgpack.encode(Control(0, AbortCall(0, scoped_rid("t", "r"))))
    assert msgspec.msgpack.decode(frame, type=SchedulerInput).op.rid == "t/r"


def test_answer_names_count_each_prompts_answers() -> None:
    from radixserve.messages import SamplingParams
    from radixserve.rids import answer_names
    assert answer_names(["a", "b"], [SamplingParams(n=2), None], True) == (
        ["a:0", "a:1", "b"], True)
    assert answer_names(["a"], None, False) == (["a"], False)
    assert answer_names(["a"], SamplingParams(n=3), False) == (["a:0", "a:1", "a:2"], True)
    # SGLang's beam search answers once, its beams inside that answer.
    assert answer_names(["a"], SamplingParams(beam_width=3), False) == (["a"], False)


def test_every_decoder_decodes_through_messages_decode():
    """`messages.decode`'s promise (issue 42 found nine sockets that skipped it): no module
    of the packages calls a msgspec decoder's own `decode`, so bytes nested too deeply
    are a DecodeError on every socket, not a RecursionError that ends a receive loop."""
    import ast
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    own = root / "radixserve" / "messages" / "rpc.py"
    direct = []
    for path in [p for top in ("radixserve", "router", "kernels")
                 for p in (root / top).rglob("*.py") if p != own]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "decode"
                    and re.search(r"decoder|Decoder\(", ast.unparse(node.func.value), re.I)):
                direct.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not direct, f"decoders called directly, not through messages.decode: {direct}"
