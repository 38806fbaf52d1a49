"""The fast path's caches: `StaticCache` (per-layer K/V buffers of a fixed capacity, allocated once; rolling
back is a length update; sliding-window layers may keep a ring) and `LinearStates` (a hybrid target's
linear-attention states, settled exactly to any position of the last forward), with the helpers that write
and address their rows: `write_rows`, `key_positions` (the bucketed key window a forward attends over),
`bucket` and `FAR`. The forwards that fill them are engine/static_forward.py's, driven by engine/fast.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dflash_cli.engine.errors import RollbackError
from dflash_cli.engine.hf_module import HFModule
from dflash_cli.engine.linear_attention import BlockRecord, conv_after, state_after


class StaticCache:
    """Per-layer K/V buffers of a fixed capacity, allocated once; `length` is a host int.

    Buffers start zeroed so that masked-out rows are finite (a NaN times a zero attention weight is NaN).
    Linear-attention layers (hybrid targets) keep their state in `LinearStates` instead.

    Layers may differ in shape (`layer_shapes`: Gemma 4's global layers have fewer, wider K/V heads than its
    sliding-window layers). Sliding-window layers of a long context keep their K/V in a ring (`ring`: a
    buffer of R rows where position p lives in row p % R, and `ring[r]` says which position row r holds,
    FAR when none): a query sees the `window` positions up to its own, R = window + 2 * slack, so a forward
    of up to `slack` tokens overwrites only positions no query after the last committed one reads, and the
    other `slack` rows let the sequence return up to `slack` positions behind the newest write
    (`reachable`). Every row a query may see at position p was written at or before p, as in the
    full-length buffers.

    `batch` > 1 holds that many independent sequences, one per batch row (batched generation of training
    data, train/batched.py: `FastPath.forward_rows`); `length` then means nothing, each row's is the caller's.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int, *,
                 dtype: torch.dtype, device: torch.device | Sequence[torch.device],
                 linear: LinearStates | None = None, attention_layers: set[int] | None = None,
                 layer_shapes: Sequence[tuple[int, int, int]] | None = None,
                 ring: torch.Tensor | None = None, window: int | None = None, batch: int = 1):
        # one device for all layers, or each layer's own (a target split over devices)
        self.devices = list(device) if isinstance(device, Sequence) else [device] * num_layers

        def buffer(i: int) -> torch.Tensor:
            # (kv heads, head dim, rows) of layer i: the model's own, or all layers alike
            heads, dim, rows = layer_shapes[i] if layer_shapes is not None else (kv_heads, head_dim, capacity)
            rows = rows if attention_layers is None or i in attention_layers else 0
            return torch.zeros((batch, heads, rows, dim), dtype=dtype, device=self.devices[i])

        self.keys = [buffer(i) for i in range(num_layers)]
        self.values = [buffer(i) for i in range(num_layers)]
        self.capacity = capacity
        self.length = 0
        self.linear = linear
        self.ring, self.window = ring, window
        self.written = 0  # positions < written have been written since the cache was emptied (ring bound)
        self.owner = 0  # the DecodeState holding this cache (engine/state.py)

    def get_seq_length(self) -> int:
        return self.length

    def reachable(self, length: int) -> int:
        """The longest prefix of at most `length` positions that crop() can return to."""
        if self.linear is not None:
            return self.linear.reachable(min(length, self.length))
        if self.ring is not None and self.window is not None and self.written > self.ring.shape[0]:
            # the ring holds positions written-R..written-1: the window before `length` must be among them
            return length if length - self.window >= self.written - self.ring.shape[0] else 0
        return length

    def crop(self, length: int) -> None:
        """Forgets positions >= length: a length update, nothing is copied or freed."""
        assert 0 <= length <= self.length, (length, self.length)
        if self.linear is not None and length < self.length:
            self.linear.crop(length)
        if self.ring is not None and self.reachable(length) != length:
            raise RollbackError(f"the sliding-window ring no longer holds the positions before {length}")
        self.length = length
        if length == 0:
            self.written = 0


class LinearStates:
    """The recurrent and convolution states of a hybrid target's linear-attention layers.

    A forward reads the states and leaves a BlockRecord per layer; `settle(p)` then makes each state that
    after position p-1, for any p within the last forward's tokens. Each layer has two buffers: settling
    writes the one not in use and then switches, in one assignment, so a Ctrl-C at any point leaves every
    layer either settled or still able to settle. One checkpoint (the state just before a prompt's last
    token) lets a chat regenerate its last reply without reading the prompt again; any other earlier
    length starts over from position 0.
    """

    def __init__(self, nets: list[HFModule], *, dtype: torch.dtype, device: torch.device | Sequence[torch.device]):
        self.kernel = nets[0].conv_kernel_size
        devices = list(device) if isinstance(device, Sequence) else [device] * len(nets)
        conv = [(1, net.conv_dim, net.conv_kernel_size - 1) for net in nets]
        state = [(net.num_v_heads, net.head_k_dim, net.head_v_dim) for net in nets]
        self.convs = [[torch.zeros(c, dtype=dtype, device=d) for c, d in zip(conv, devices)] for _ in range(3)]
        self.states = [[torch.zeros(s, dtype=torch.float32, device=d) for s, d in zip(state, devices)]
                       for _ in range(3)]
        # per layer: (buffer in use 0|1, record of the last forward or None, its base position or the
        # state's position); buffer 2 is the checkpoint
        self.slots: list[tuple[int, BlockRecord | None, int]] = [(0, None, 0)] * len(nets)
        self.checkpoint_at: int | None = None

    def current(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return ([self.convs[cur][j] for j, (cur, _, _) in enumerate(self.slots)],
                [self.states[cur][j] for j, (cur, _, _) in enumerate(self.slots)])

    def _covers(self, j: int, position: int) -> bool:
        _, record, base = self.slots[j]
        return base <= position <= base + record.tokens if record is not None else position == base

    def reachable(self, length: int) -> int:
        if all(self._covers(j, length) for j in range(len(self.slots))):
            return length
        if self.checkpoint_at is not None and self.checkpoint_at <= length:
            return self.checkpoint_at
        return 0

    def _install(self, j: int, conv: torch.Tensor, state: torch.Tensor, position: int) -> None:
        cur = self.slots[j][0]
        self.convs[1 - cur][j].copy_(conv)
        self.states[1 - cur][j].copy_(state)
        self.slots[j] = (1 - cur, None, position)

    def settle(self, position: int) -> None:
        """Makes every layer's state the one after positions < `position`."""
        for j, (_, record, base) in enumerate(self.slots):
            if record is None:
                if base != position:
                    raise RollbackError(f"linear-attention state is at {base}, not {position}")
                continue
            m = position - base
            if not 0 <= m <= record.tokens:
                raise RollbackError(f"position {position} is outside the last forward ({base}..)")
            self._install(j, conv_after(record, m, self.kernel), state_after(record, m), position)

    def record(self, base: int, records: list[BlockRecord]) -> None:
        for j, record in enumerate(records):
            self.slots[j] = (self.slots[j][0], record, base)

    def save_checkpoint(self, position: int) -> None:
        """Keeps the state after positions < `position` (within the last forward) aside."""
        self.checkpoint_at = None
        for j, (_, record, base) in enumerate(self.slots):
            m = position - base
            assert record is not None and 0 <= m <= record.tokens, (position, base)
            self.convs[2][j].copy_(conv_after(record, m, self.kernel))
            self.states[2][j].copy_(state_after(record, m))
        self.checkpoint_at = position

    def crop(self, length: int) -> None:
        if self.checkpoint_at is not None and length < self.checkpoint_at:
            self.checkpoint_at = None  # the tokens it summarised may change
        if all(self._covers(j, length) for j in range(len(self.slots))):
            return  # settled lazily by the next forward
        if length == 0:
            for j in range(len(self.slots)):
                self._install(j, torch.zeros_like(self.convs[2][j]), torch.zeros_like(self.states[2][j]), 0)
        elif length == self.checkpoint_at:
            for j in range(len(self.slots)):
                self._install(j, self.convs[2][j], self.states[2][j], length)
        else:
            raise RollbackError(f"linear-attention state cannot return to position {length}")


def write_rows(buffer: torch.Tensor, at: torch.Tensor, rows: torch.Tensor) -> None:
    """Writes K/V rows (b, heads, n, hd) into a cache buffer (b, heads, capacity, hd) at `at`: (n,) buffer
    rows for every sequence alike (decoding), or (b, n), each sequence its own (batched generation); fp32
    rows into an fp16 buffer are rounded to nearest, as the C layers write theirs."""
    rows = rows.to(buffer.dtype)
    if at.dim() == 1:
        buffer.index_copy_(2, at, rows)
    else:  # advanced indices first: the target is (b, n, heads, hd). (scatter_ measured 100x slower.)
        buffer[torch.arange(at.shape[0], device=at.device)[:, None], :, at] = rows.transpose(1, 2)


# the position a ring row holds when it holds none: ahead of every query, so no mask lets it through
FAR = 2**62


def bucket(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    size = 1
    while size < n:
        size *= 2
    return size


def key_positions(length: int, most: int, device: torch.device, minimum: int = 256) -> torch.Tensor:
    """Rows 0..L-1 to attend over: L is `length` rounded up to a power of two (at least `minimum`, at most
    `most`), so attention reads what the sequence needs, not the whole buffer."""
    return torch.arange(min(max(bucket(length), minimum), most), device=device)
