"""The step path's host-to-device copies (worker/staging.py, issue 52): the staging ring
never hands out a buffer whose copy may still be reading it, and no step-path module
copies to a device any other way."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

import radixserve
from radixserve.worker.staging import StagingRing, to_device


class FakeEvent:
    """A CUDA event's part the ring uses: done when the test says so."""

    def __init__(self, log: list[str]) -> None:
        self.log, self.done = log, False

    def record(self) -> None:
        self.log.append("record")

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.log.append("wait")
        self.done = True


@pytest.fixture
def ring() -> tuple[StagingRing, list[FakeEvent], list[str]]:
    """A ring over plain host buffers: a copy to the CPU returns the staged bytes
    themselves, so a buffer reused too early shows in an earlier copy's values."""
    events: list[FakeEvent] = []
    log: list[str] = []

    def event() -> FakeEvent:
        events.append(FakeEvent(log))
        return events[-1]
    return StagingRing(lambda n: torch.empty(n, dtype=torch.uint8), event, limit=3), events, log


def test_a_buffer_in_flight_is_not_reused(ring) -> None:
    r, events, log = ring
    first = r.copy(np.arange(4, dtype=np.int64), torch.device("cpu"))
    second = r.copy(np.full(4, 7, dtype=np.int64), torch.device("cpu"))
    assert first.tolist() == [0, 1, 2, 3] and second.tolist() == [7] * 4
    assert first.data_ptr() != second.data_ptr()
    assert log == ["record", "record"]  # nobody waited


def test_a_buffer_is_reused_once_its_copy_completed(ring) -> None:
    r, events, _ = ring
    first = r.copy(np.arange(4, dtype=np.int64), torch.device("cpu"))
    events[0].done = True
    again = r.copy(np.arange(3, dtype=np.int32), torch.device("cpu"))
    assert again.data_ptr() == first.data_ptr() and again.tolist() == [0, 1, 2]
    assert len(r.buffers) == 1


def test_past_the_limit_the_oldest_copy_is_waited_for(ring) -> None:
    r, events, log = ring
    for i in range(3):
        r.copy(np.array([i]), torch.device("cpu"))
    assert r.waits == 0 and len(r.buffers) == 3
    r.copy(np.array([3]), torch.device("cpu"))
    assert r.waits == 1 and log.count("wait") == 1 and events[0].done
    assert len(r.buffers) == 3


def test_a_bigger_copy_takes_a_bigger_buffer(ring) -> None:
    r, events, _ = ring
    r.copy(np.zeros(2, dtype=np.int64), torch.device("cpu"))
    events[0].done = True
    big = r.copy(np.arange(10_000, dtype=np.int64), torch.device("cpu"))
    assert big.tolist() == list(range(10_000))
    assert r.buffers[-1][0].numel() >= 80_000


@pytest.mark.parametrize("values, dtype", [
    ([1, 2, 3], torch.long), ([[1, 2], [3, 4]], torch.int32),
    (np.array([0.5, 1.5], dtype=np.float32), torch.float32),
    (np.array([[True, False]]), torch.bool), (torch.tensor([5, 6], dtype=torch.int32), torch.int32),
    ([], torch.long)])
def test_on_the_cpu_it_is_the_plain_tensor(values, dtype) -> None:
    out = to_device(values, "cpu", dtype)
    assert out.dtype == dtype and out.device.type == "cpu"
    assert out.tolist() == torch.as_tensor(np.asarray(values)).to(dtype).tolist()


def test_the_ring_packs_every_dtype_it_stages(ring) -> None:
    r, _, _ = ring
    for host in (np.array([[1, 2], [3, 4]], dtype=np.int32), np.array([True, False, True]),
                 np.array([-1.5, 2.0], dtype=np.float32), np.zeros((2, 0), dtype=np.int64)):
        out = r.copy(host, torch.device("cpu"))
        assert out.shape == host.shape and out.tolist() == host.tolist()


STEP_PATH = [Path(radixserve.__file__).parent / "worker",
             Path(radixserve.__file__).parent / "lora" / "slots.py"]
OFF_THE_STEP = {"staging.py", "cascade_cost.py", "tensor_parallel.py"}
"""The one home of the copies, the start-up measurement, the host collectives."""
MAKERS = {"tensor", "from_numpy", "as_tensor"}


def _maker(node: ast.expr) -> bool:
    """Whether `node` is (a chain of calls on) `torch.tensor/from_numpy/as_tensor(...)`."""
    while isinstance(node, (ast.Call, ast.Attribute)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in MAKERS and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"):
            return True
        node = node.func if isinstance(node, ast.Call) else node.value
    return False


def raw_copies(source: str) -> list[int]:
    """Lines of `source` that make a host tensor on a device directly
    (`torch.tensor(..., device=)`) or move one there (`torch.tensor(...).to(...)`,
    `torch.from_numpy(x).to(...)`, `.cuda()`): each a synchronous pageable copy on a GPU."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        direct = _maker(node) and any(k.arg == "device" for k in node.keywords)
        moved = node.func.attr in ("to", "cuda") and _maker(node.func.value)
        if direct or moved:
            lines.append(node.lineno)
    return lines


def test_the_checker_finds_the_raw_copies() -> None:
    source = """
a = torch.tensor(x, device=dev)
b = torch.tensor(x, dtype=torch.long).to(dev)
c = torch.from_numpy(x).long().to(dev)
d = torch.as_tensor(x).cuda()
e = torch.tensor(x)
f = staged.to(dev)
"""
    assert raw_copies(source) == [2, 3, 4, 5]


def test_no_step_path_module_copies_to_the_device_but_through_staging() -> None:
    found = []
    for top in STEP_PATH:
        for path in [top] if top.is_file() else sorted(top.rglob("*.py")):
            if path.name not in OFF_THE_STEP:
                found += [f"{path.name}:{line}" for line in raw_copies(path.read_text())]
    assert not found, f"host-to-device copies around worker/staging.py: {found}"
