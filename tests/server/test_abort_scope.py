"""Which requests an abort reaches (issue 41, finding 11): a tenant's only its own, with
`abort_all` all of them; the operator's every tenant's, or a named tenant's; a tenant
naming a tenant is refused, naming the rule."""

from __future__ import annotations

import pytest

from radixserve.messages import AbortCall
from radixserve.rids import RidsInFlight
from radixserve.front_door.admin import abort_targets


@pytest.fixture
def rids() -> RidsInFlight[int]:
    flight: RidsInFlight[int] = RidsInFlight()
    flight.claim("alice", ["a1", "a2"], 1)
    flight.claim("bob", ["b1", "a1"], 2)
    return flight


def test_a_tenants_abort_reaches_its_own_requests_only(rids) -> None:
    assert sorted(abort_targets(AbortCall(0, abort_all=True), "bob", False, rids)) == [
        "bob/a1", "bob/b1"]
    assert abort_targets(AbortCall(0, "a2"), "bob", False, rids) == []  # alice's rid
    assert abort_targets(AbortCall(0, "a1"), "bob", False, rids) == ["bob/a1"]
    with pytest.raises(ValueError, match="only the operator"):
        abort_targets(AbortCall(0, abort_all=True, tenant="alice"), "bob", False, rids)
    with pytest.raises(ValueError, match="pass rid, or abort_all"):
        abort_targets(AbortCall(0), "bob", False, rids)


def test_the_operator_aborts_every_tenant_or_a_named_one(rids) -> None:
    assert sorted(abort_targets(AbortCall(0, abort_all=True), "default", True, rids)) == [
        "alice/a1", "alice/a2", "bob/a1", "bob/b1"]
    assert sorted(abort_targets(AbortCall(0, abort_all=True, tenant="bob"), "default", True,
                                rids)) == ["bob/a1", "bob/b1"]
    assert abort_targets(AbortCall(0, "a2", tenant="alice"), "default", True, rids) == [
        "alice/a2"]
    assert abort_targets(AbortCall(0, abort_all=True, tenant="nobody"), "default", True,
                         rids) == []
