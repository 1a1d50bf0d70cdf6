"""A ragged batched KV cache that transformers models write into.

Layout, per layer: K and V buffers ``[row_cap, heads, col_cap, head_dim]``. Active rows are
``0..rows-1`` (removal swaps the last row into the hole), active columns are the window
``[t0, t1)``; each row marks which of its columns are real tokens (``valid``) and their
positions (``pos``), so rows of different lengths — and rows with holes, e.g. a cached session
prefix followed by a left-padded suffix — share one buffer. A forward over ``q`` new tokens
writes columns ``[t1, t1+q)`` of every active row in place (no per-step concatenation) and
attends over views of the window; :meth:`attention_mask` builds the matching 4-D mask
(key valid, causal in column order, every query may see itself so pad rows stay finite).
New rows join right-aligned at ``t1``; the window grows left into headroom, and the buffer is
reallocated (compacted, with room to spare) only when it runs out of rows or columns.
With a ``kv_codec`` (the FP8 KV cache: :mod:`~miles_engine.engines.embedded.kv_codec`) the
buffers hold each vector encoded and attention gets the window decoded; everything else here
moves encoded columns as they are.
"""

from __future__ import annotations

from typing import Protocol

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

_KEEP_CELLS = 64 * 4096  # an empty batch keeps buffers up to rows x columns of this size


class _Layer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False

    def __init__(self, owner: RaggedKV, index: int) -> None:
        super().__init__()
        self.owner, self.index, self.is_initialized = owner, index, True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):  # type: ignore[override]
        return self.owner._write(self.index, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.width + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.width

    def get_max_length(self) -> int:
        return -1


class KVCodec(Protocol):
    def pack(self, x: torch.Tensor) -> torch.Tensor: ...  # noqa: E704 - [..., d] -> [..., stored]
    def unpack(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor: ...  # noqa: E704


class RaggedKV(Cache):
    def __init__(self, num_layers: int, *, device: torch.device | str, dtype: torch.dtype,
                 kv_codec: KVCodec | None = None) -> None:
        """``kv_codec``: how keys and values are stored (attention reads them decoded), e.g. the
        FP8 KV cache's; None: as computed, in ``dtype``."""
        super().__init__(layers=[_Layer(self, i) for i in range(num_layers)])
        self.kv_codec = kv_codec
        self.num_layers, self.device, self.dtype = num_layers, torch.device(device), dtype
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.row_cap = self.col_cap = 0
        self.rows = self.t0 = self.t1 = 0
        self.valid = torch.zeros(0, 0, dtype=torch.bool, device=self.device)
        self.pos = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self._pending = 0  # columns being written by the current forward

    # ------------------------------------------------------------------ geometry
    @property
    def width(self) -> int:
        return self.t1 - self.t0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)

    def _realloc(self, rows: int, left: int, right: int) -> None:
        """Make room for ``rows`` rows, ``left`` free columns before t0 and ``right`` after t1."""
        width = self.width
        new_rows = max(rows, self.row_cap, 1)
        if rows > self.row_cap:
            new_rows = max(rows, 2 * self.row_cap)
        new_t0 = max(left, 16)
        new_cols = new_t0 + width + max(right, 64, width // 2)
        def move(old: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
            ref = old if old is not None else like
            if ref is None:
                return None
            new = ref.new_zeros(new_rows, ref.shape[1], new_cols, ref.shape[3])
            if old is not None and self.rows and width:
                new[: self.rows, :, new_t0 : new_t0 + width] = old[: self.rows, :, self.t0 : self.t1]
            return new
        self.k = [move(k, None) for k in self.k]
        self.v = [move(v, None) for v in self.v]
        valid = torch.zeros(new_rows, new_cols, dtype=torch.bool, device=self.device)
        pos = torch.zeros(new_rows, new_cols, dtype=torch.long, device=self.device)
        if self.rows and width:
            valid[: self.rows, new_t0 : new_t0 + width] = self.valid[: self.rows, self.t0 : self.t1]
            pos[: self.rows, new_t0 : new_t0 + width] = self.pos[: self.rows, self.t0 : self.t1]
        self.valid, self.pos = valid, pos
        self.row_cap, self.col_cap = new_rows, new_cols
        self.t0, self.t1 = new_t0, new_t0 + width

    def _ensure(self, rows: int, left: int = 0, right: int = 0) -> None:
        if rows > self.row_cap or self.t0 < left or self.col_cap - self.t1 < right:
            self._realloc(rows, left, right)

    def _alloc_layer(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[i] = k.new_zeros(self.row_cap, k.shape[1], self.col_cap, k.shape[3])
        self.v[i] = v.new_zeros(self.row_cap, v.shape[1], self.col_cap, v.shape[3])

    # ------------------------------------------------------------------ forward
    def begin_forward(self, new_valid: torch.Tensor, new_pos: torch.Tensor) -> None:
        """Reserve ``q = new_valid.shape[1]`` columns at t1 for the next forward over all rows."""
        q = new_valid.shape[1]
        self._ensure(self.rows, 0, q)
        self.valid[: self.rows, self.t1 : self.t1 + q] = new_valid
        self.pos[: self.rows, self.t1 : self.t1 + q] = new_pos
        self._pending = q

    def _write(self, i: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = key.shape[2]
        if q != self._pending or key.shape[0] != self.rows:
            raise RuntimeError(f"ragged KV: forward of {key.shape[0]}x{q} tokens, expected {self.rows}x{self._pending}")
        codec = self.kv_codec
        if codec is not None:
            key, value = codec.pack(key), codec.pack(value)
        if self.k[i] is None:
            self._alloc_layer(i, key, value)
        kb, vb = self.k[i], self.v[i]
        kb[: self.rows, :, self.t1 : self.t1 + q] = key
        vb[: self.rows, :, self.t1 : self.t1 + q] = value
        keys, values = kb[: self.rows, :, self.t0 : self.t1 + q], vb[: self.rows, :, self.t0 : self.t1 + q]
        if codec is None:
            return keys, values
        return codec.unpack(keys, self.dtype), codec.unpack(values, self.dtype)

    def end_forward(self) -> None:
        self.t1 += self._pending
        self._pending = 0

    def attention_mask(self, q: int, *, float_dtype: torch.dtype | None = None,
                       sliding_window: int | None = None) -> torch.Tensor:
        """[rows, 1, q, width+q] mask for a forward reserved by :meth:`begin_forward`."""
        w = self.width
        keys = self.valid[: self.rows, self.t0 : self.t1 + q]
        if q == 1:
            mask = keys[:, None, None, :].clone()
        else:
            cols = torch.arange(w + q, device=self.device)
            causal = cols[None, :] <= (w + torch.arange(q, device=self.device))[:, None]
            mask = keys[:, None, None, :] & causal[None, None]
        mask[:, 0, torch.arange(q, device=self.device), w + torch.arange(q, device=self.device)] = True
        if sliding_window is not None:
            kpos = self.pos[: self.rows, self.t0 : self.t1 + q]
            qpos = self.pos[: self.rows, self.t1 : self.t1 + q]
            near = (qpos[:, :, None] - kpos[:, None, :]) < sliding_window
            mask &= near[:, None] | torch.eye(w + q, dtype=torch.bool, device=self.device)[w:][None, None]
        if float_dtype is None:
            return mask
        out = torch.zeros(mask.shape, dtype=float_dtype, device=self.device)
        return out.masked_fill_(~mask, torch.finfo(float_dtype).min)

    def keep_new(self, keep: list[int], q: int) -> None:
        """Speculative rollback after a forward over ``q`` columns: row ``r`` keeps the first
        ``keep[r]`` of them, the rest become holes; columns no row keeps are given back."""
        if q <= 0 or self.rows == 0:
            return
        first = self.t1 - q
        kept = torch.tensor(keep, device=self.device)[:, None]
        cols = torch.arange(q, device=self.device)[None, :]
        self.valid[: self.rows, first : self.t1] &= cols < kept
        new_t1 = first + max(keep)
        self.valid[:, new_t1 : self.t1] = False
        self.t1 = new_t1
        if self.width > 2 * self.longest_row() + 64:
            self.compact()

    def longest_row(self) -> int:
        if self.rows == 0:
            return 0
        return int(self.valid[: self.rows, self.t0 : self.t1].sum(1).max())

    def compact(self) -> None:
        """Right-align every row's valid columns at t1 (column order kept), dropping the holes
        speculative rollbacks leave behind; the window shrinks to the longest row."""
        if self.rows == 0:
            return
        window = self.valid[: self.rows, self.t0 : self.t1]
        counts = window.sum(1)
        w = int(counts.max())
        # stable sort: holes first, then the valid columns in their order
        order = torch.sort(window.to(torch.int8), dim=1, stable=True).indices[:, window.shape[1] - w :]
        src = order + self.t0
        valid = torch.gather(self.valid[: self.rows], 1, src)
        pos = torch.gather(self.pos[: self.rows], 1, src)
        for bufs in (self.k, self.v):
            for i, buf in enumerate(bufs):
                if buf is None:
                    continue
                idx = src[:, None, :, None].expand(self.rows, buf.shape[1], w, buf.shape[3])
                moved = torch.gather(buf[: self.rows], 2, idx)
                buf[: self.rows, :, self.t1 - w : self.t1] = moved
        self.valid[: self.rows, self.t0 : self.t1] = False
        self.valid[: self.rows, self.t1 - w : self.t1] = valid
        self.pos[: self.rows, self.t1 - w : self.t1] = pos
        self.t0 = self.t1 - w

    # ------------------------------------------------------------------ rows
    def add_rows(self, src: RaggedKV, which: list[int] | None = None) -> list[int]:
        """Copy rows of ``src`` in (right-aligned at t1, holes kept); returns their new row indices."""
        which = list(range(src.rows)) if which is None else which
        n, w = len(which), src.width
        if not n:
            return []
        if self.rows == 0:
            self.t0 = self.t1 = max(self.t0, w)  # fresh batch: start right after headroom
        need_left = max(0, w - self.width)
        self._ensure(self.rows + n, need_left, 1)
        start = self.t1 - w
        first = self.rows
        idx = torch.tensor(which, device=self.device)
        for i in range(self.num_layers):
            if src.k[i] is None:
                continue
            if self.k[i] is None:
                self._alloc_layer(i, src.k[i], src.v[i])
            self.k[i][first : first + n, :, start : self.t1] = src.k[i].index_select(0, idx)[:, :, src.t0 : src.t1]
            self.v[i][first : first + n, :, start : self.t1] = src.v[i].index_select(0, idx)[:, :, src.t0 : src.t1]
        self.valid[first : first + n].zero_()
        self.valid[first : first + n, start : self.t1] = src.valid.index_select(0, idx)[:, src.t0 : src.t1]
        self.pos[first : first + n, start : self.t1] = src.pos.index_select(0, idx)[:, src.t0 : src.t1]
        self.rows += n
        self.t0 = min(self.t0, start)
        return list(range(first, first + n))

    def remove_row(self, r: int) -> int | None:
        """Remove row ``r``; the last row moves into its place. Returns the moved row's old index."""
        last = self.rows - 1
        moved = None
        if r != last:
            for buf in self.k + self.v:
                if buf is not None:
                    buf[r, :, self.t0 : self.t1] = buf[last, :, self.t0 : self.t1]
            self.valid[r, self.t0 : self.t1] = self.valid[last, self.t0 : self.t1]
            self.pos[r, self.t0 : self.t1] = self.pos[last, self.t0 : self.t1]
            moved = last
        self.valid[last].zero_()
        self.rows = last
        self._trim()
        return moved

    def _trim(self) -> None:
        if self.rows == 0:
            if self.col_cap * self.row_cap > _KEEP_CELLS:  # empty: give a large buffer back
                self.k = [None] * self.num_layers
                self.v = [None] * self.num_layers
                self.row_cap = self.col_cap = 0
                self.valid = self.valid[:0, :0]
                self.pos = self.pos[:0, :0]
            self.t0 = self.t1 = min(self.t1, max(16, self.col_cap // 4))
            return
        live = self.valid[: self.rows, self.t0 : self.t1].any(0)
        if live.numel() and not bool(live[0]):
            self.t0 += int(live.to(torch.int8).argmax())

    def clear(self) -> None:
        self.valid.zero_()
        self.rows = 0
        self._trim()

    def row_tokens(self, r: int) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """Contiguous copies of row ``r``'s valid K/V ([heads, n, dim] per layer) and positions."""
        cols = self.valid[r, self.t0 : self.t1].nonzero().squeeze(1) + self.t0
        ks = [k[r].index_select(1, cols) for k in self.k if k is not None]
        vs = [v[r].index_select(1, cols) for v in self.v if v is not None]
        return ks, vs, self.pos[r].index_select(0, cols)

    def load_prefix(self, entries: list[tuple[list[torch.Tensor], list[torch.Tensor]] | None]) -> None:
        """Start a fresh cache (used for one prefill) with one row per entry: a cached prefix
        ``(keys, values)`` right-aligned, or nothing. Positions are 0..n-1."""
        self.rows, n = 0, len(entries)
        width = max((kv[0][0].shape[1] for kv in entries if kv is not None), default=0)
        self.t0 = self.t1 = 0
        self._realloc(n, 0, width + 64)
        self.t1 = self.t0 + width
        self.rows = n
        for r, kv in enumerate(entries):
            if kv is None:
                continue
            ks, vs = kv
            c = ks[0].shape[1]
            for i in range(self.num_layers):
                if self.k[i] is None:
                    self._alloc_layer(i, ks[i][None], vs[i][None])
                self.k[i][r, :, self.t1 - c : self.t1] = ks[i]
                self.v[i][r, :, self.t1 - c : self.t1] = vs[i]
            self.valid[r, self.t1 - c : self.t1] = True
            self.pos[r, self.t1 - c : self.t1] = torch.arange(c, device=self.device)
