"""How the virtual KV layout on CUDA cuts its blocks into the driver's pages
(`virtual_kv_cuda.py`), and which cuts it refuses.

The driver maps whole allocation-granularity pages (2 MiB on Hopper). Two layouts:
- `block`: all layers of a block in one unit of whole pages (`[2 x layers, page_size,
  kv_heads, head_dim]`, padded up to pages): one mapping per block in a view. The page
  size must make a block fill its pages: the default model in bf16 holds 23,040 bytes a
  token over its 30 layers, so 91-token blocks fill 2 MiB (prefixes shared at that grain).
- `layer`: each layer's K, and its V, of a block in its own unit (`[page_size, kv_heads,
  head_dim]` padded to pages), so that in a view a sequence's keys of one layer are one
  stretch, as the CPU's plane regions (`virtual_kv.plane_regions`): 2 x layers mappings
  per block. One 2 MiB page holds 5,461 of the default model's tokens per layer's K: every
  sequence holds at least that much memory, however short.

The rule for `auto` is the CPU's: `layer` where a block's rows of one layer fill whole
pages (within `MAX_PADDING`), else `block`. At a page size both fit, `layer` reads each
layer's rows as one stretch and maps as few blocks (they are large); below it only
`block` wastes little. A layout whose padding would take more than `MAX_PADDING` of its
memory is refused, naming the other layout where that one fits, else a page size that
fits. (Which reads faster on a GPU at equal waste is for bench/gpu/run.py's `virtual`
section to measure.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MAX_PADDING = 1 / 8
"""The largest share of a unit of pages its padding may take."""

LayoutName = Literal["auto", "block", "layer"]


@dataclass(frozen=True)
class PageLayout:
    """One layout's cut of a block: `regions` units (1, or 2 x layers) of `unit` bytes,
    each one physical handle, each holding `planes` layers' K or V planes (2 x layers, or
    1): `used` bytes of KV."""

    name: Literal["block", "layer"]
    regions: int
    planes: int
    used: int
    unit: int

    @property
    def padding(self) -> float:
        return 1 - self.used / self.unit

    @property
    def block_bytes(self) -> int:
        """The device memory one block takes, padding included."""
        return self.regions * self.unit


def cut(name: Literal["block", "layer"], num_layers: int, page_size: int,
        plane_token_bytes: int, granule: int) -> PageLayout:
    """`name`'s units for blocks of `page_size` tokens, `plane_token_bytes` a token in one
    layer's K (or V)."""
    planes = 2 * num_layers if name == "block" else 1
    used = planes * page_size * plane_token_bytes
    return PageLayout(name, 2 * num_layers // planes, planes, used,
                      -(-used // granule) * granule)


def choose(name: LayoutName, num_layers: int, page_size: int, plane_token_bytes: int,
           granule: int) -> PageLayout:
    """The layout `name` names (`auto`: by the rule in the module docstring); ValueError
    naming a better configuration when its padding exceeds `MAX_PADDING`."""
    def layout(n: Literal["block", "layer"], p: int = page_size) -> PageLayout:
        return cut(n, num_layers, p, plane_token_bytes, granule)

    if name not in ("auto", "block", "layer"):
        raise ValueError(f"virtual_page_layout must be auto, block or layer, got {name!r}")
    if name == "auto":
        name = "layer" if layout("layer").padding <= MAX_PADDING else "block"
    chosen = layout(name)
    if chosen.padding <= MAX_PADDING:
        return chosen
    other = layout("layer" if name == "block" else "block")
    if other.padding <= MAX_PADDING:
        better = (f"use virtual_page_layout='{other.name}' ({other.padding:.1%} padding at "
                  f"this page_size)")
    else:
        limit = max(1024, 2 * granule // (chosen.planes * plane_token_bytes) + 1)
        best = min(range(1, limit + 1), key=lambda p: (layout(name, p).padding, p))
        better = (f"use a page_size whose blocks fill their pages, such as {best} "
                  f"({layout(name, best).padding:.1%} padding)")
    raise ValueError(
        f"kv_layout='virtual' on CUDA maps whole {granule}-byte pages: with "
        f"virtual_page_layout='{name}' a unit of page_size={page_size} holds {chosen.used} "
        f"bytes ({chosen.planes} layer planes of {plane_token_bytes} bytes a token), "
        f"{chosen.padding:.0%} of its {chosen.unit} would be padding (more than "
        f"{MAX_PADDING:.1%}); {better}")
