"""The mapping account admission keeps for the virtual KV layout (scheduler/mappings.py):
a block table costs its runs of consecutive ids plus one, once per sequence it stands for."""

from __future__ import annotations

from types import SimpleNamespace

from radixserve.scheduler.mappings import MappingAccount, table_runs


def seq(table: list[int], width: int = 1):
    return SimpleNamespace(kv=SimpleNamespace(block_table=table),
                           group=SimpleNamespace(queued_width=width))


def test_a_table_costs_its_runs():
    assert table_runs([]) == 0
    assert table_runs([4, 5, 6, 7]) == 1
    assert table_runs([7, 6, 5]) == 3  # descending ids are no run
    assert table_runs([0, 1, 9, 10, 3]) == 3


def test_fits_counts_runs_only_when_the_bound_does_not_fit():
    account = MappingAccount(views_budget=11)  # 10 for the sequences
    running = [seq(list(range(8))), seq([20, 21], width=2)]  # cost 2 + 2 * 2
    assert account.fits(running, 4) and not account.fits(running, 5)
    assert account.admits(running, seq([30, 31, 40]))  # two runs and a zero stretch
    assert not account.admits(running, seq([30, 31, 40, 50, 60]))
    assert account.admits([], seq(list(range(0, 100, 2))))  # alone it always runs
    assert MappingAccount.for_budget(0) is None  # no budget (the paged layout): no account
