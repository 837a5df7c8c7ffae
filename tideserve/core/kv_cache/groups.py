"""KV cache groups: which layers share a block table, and which blocks a sliding-window layer still reads.

A model whose layers do not all attend the same span (Gemma 2 and 3: sliding-window "local" layers beside
full-attention "global" ones) would waste most of its KV memory if every layer kept every position: a local
layer reads only the last ``window`` keys. So its layers are split into groups of ``group_size`` layers
each, every group all full attention or all one window; each group has its own block table per request,
and a block (an id of the one shared pool) belongs to one group and holds that group's ``group_size``
layers' K and V. The workers therefore keep ``group_size`` layer slots, not one per layer: group g's j-th
layer reads and writes slot j of the blocks in group g's table.

Why equal sizes: every block is then worth the same bytes, so the pool, the elastic policy (which decides
in bytes), swap and compaction keep working in plain blocks. ``group_size`` is the greatest common divisor
of the layer counts per kind, so no slot is ever padding (Gemma 3 270M: 3 global + 15 local layers ->
``group_size`` 3, one full group and five sliding groups).

A model with one kind of layer (every Llama, or every layer sliding as in Mistral v0.1) is one group of all
its layers: exactly the single-table layout (``KVCacheGroups.single``).

Plain Python over integers (no torch): the cache manager and the runner share these rules.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# With several groups, the id every sliding table holds before its window: reserved for the pool's lifetime
# (a fresh pool's first block), never written, kept zeroed by the workers so that a masked read adds 0.
NULL_BLOCK_ID = 0


@dataclass(frozen=True)
class KVCacheGroups:
    """The partition of a model's attention layers into KV cache groups.

    ``windows[g]``: the window of group g's layers (0: full attention); full groups come first.
    ``layer_group[i]`` and ``layer_slot[i]``: layer i's group and its slot in that group's blocks.
    Invariant: each group has exactly ``group_size`` layers, slots 0 .. group_size - 1.
    """

    windows: tuple[int, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]

    @classmethod
    def single(cls, num_layers: int, window: int = 0) -> KVCacheGroups:
        """One group of every layer (the layout of a model whose layers all attend alike)."""
        return cls((window,), (0,) * num_layers, tuple(range(num_layers)))

    @classmethod
    def from_windows(cls, layer_windows: Sequence[int]) -> KVCacheGroups:
        """Group layers by their window (0: full attention), ``group_size`` = gcd of the counts per window.

        Full groups first, then sliding groups by window; within a kind, layers keep their order. A model
        whose layers all share one window is one group (so its layout is exactly the single-table one).
        """
        if not layer_windows:
            raise ValueError("a model needs at least one attention layer for a KV cache")
        kinds = sorted(set(layer_windows))  # 0 (full) sorts first
        if len(kinds) == 1:
            return cls.single(len(layer_windows), kinds[0])
        members = {w: [i for i, lw in enumerate(layer_windows) if lw == w] for w in kinds}
        size = math.gcd(*(len(m) for m in members.values()))
        windows: list[int] = []
        group = [0] * len(layer_windows)
        slot = [0] * len(layer_windows)
        for w in kinds:
            layers = members[w]
            for start in range(0, len(layers), size):
                for j, layer in enumerate(layers[start:start + size]):
                    group[layer], slot[layer] = len(windows), j
                windows.append(w)
        return cls(tuple(windows), tuple(group), tuple(slot))

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def group_size(self) -> int:
        """Layers per group: the layer slots every block holds."""
        return len(self.layer_group) // len(self.windows)

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    @property
    def is_hybrid(self) -> bool:
        """More than one group: per-group block tables, window freeing and a null block."""
        return len(self.windows) > 1

    def describe(self) -> str:
        kinds = ", ".join(f"{self.windows.count(w)} {'full' if not w else f'window {w}'}"
                          for w in sorted(set(self.windows)))
        return f"{self.num_groups} KV cache groups of {self.group_size} layers ({kinds})"


def first_live_block(num_computed_tokens: int, window: int, block_size: int) -> int:
    """Index of the first block a request with ``num_computed_tokens`` computed may still read in a layer
    of ``window`` (0: full attention, always 0).

    The earliest query it can still run sits at position ``num_computed_tokens`` and attends keys from
    ``num_computed_tokens - window + 1`` on, so every block wholly before that key is out of the window
    for good (a request's computed tokens only grow, until a preemption frees everything).
    """
    if not window:
        return 0
    return max(0, num_computed_tokens - window + 1) // block_size
