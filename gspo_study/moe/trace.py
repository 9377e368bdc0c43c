"""`RoutingTrace`: the top-k experts every MoE router chose, per decoder layer and token.

A trace maps the *decoder layer index* (not the position among MoE layers, so interleaved dense layers
never shift a layer's identity) to a LongTensor [B, T, k] of expert ids, in the router's top-k order.
Position t of row b is the token the forward saw at input position t, padding included.

While recording, each forward call appends a chunk along T (prefill, then one chunk per decode step in
KV-cached generation); chunks are joined lazily the first time the indices are read.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

Rows = int | slice | Sequence[int] | torch.Tensor


class RoutingTrace:
    """Recorded expert choices: `trace.indices[layer]` is a LongTensor [B, T, k]."""

    def __init__(self, indices: Mapping[int, torch.Tensor] | None = None):
        self._chunks: dict[int, list[torch.Tensor]] = {}
        for layer, ids in (indices or {}).items():
            if ids.dim() != 3:
                raise ValueError(f"layer {layer}: expected expert ids of shape [B, T, k], got {tuple(ids.shape)}")
            self._chunks[int(layer)] = [ids]
        self._check_consistent()

    # ---- recording -------------------------------------------------------------------------------
    def append(self, layer: int, ids: torch.Tensor) -> None:
        """Append one forward call's choices [B, t, k] for `layer` along the time axis."""
        chunks = self._chunks.setdefault(layer, [])
        if chunks and (chunks[0].shape[0], chunks[0].shape[2]) != (ids.shape[0], ids.shape[2]):
            raise RuntimeError(
                f"routing trace layer {layer}: a recorded forward had batch/top-k {tuple(ids.shape[::2])} but "
                f"earlier ones had {(chunks[0].shape[0], chunks[0].shape[2])}; one record_routing context "
                "appends forwards along T, so it must see one batch (record separate batches separately)"
            )
        chunks.append(ids)

    # ---- access ----------------------------------------------------------------------------------
    @property
    def indices(self) -> dict[int, torch.Tensor]:
        """Layer -> LongTensor [B, T, k] (chunks recorded so far, joined along T)."""
        for layer, chunks in self._chunks.items():
            if len(chunks) > 1:
                self._chunks[layer] = [torch.cat(chunks, dim=1)]
        return {layer: chunks[0] for layer, chunks in sorted(self._chunks.items())}

    @property
    def layers(self) -> list[int]:
        return sorted(self._chunks)

    def layer(self, layer: int) -> torch.Tensor:
        if layer not in self._chunks:
            raise KeyError(f"routing trace has no MoE layer {layer}; layers: {self.layers}")
        return self.indices[layer]

    def is_empty(self) -> bool:
        return not self._chunks

    @property
    def shape(self) -> tuple[int, int, int]:
        """(B, T, k), shared by every layer."""
        if self.is_empty():
            raise ValueError("empty routing trace (nothing was recorded)")
        ids = self.indices[self.layers[0]]
        return tuple(ids.shape)  # type: ignore[return-value]

    @property
    def batch_size(self) -> int:
        return self.shape[0]

    @property
    def seq_len(self) -> int:
        return self.shape[1]

    @property
    def top_k(self) -> int:
        return self.shape[2]

    @property
    def device(self) -> torch.device:
        return self.indices[self.layers[0]].device

    def __repr__(self) -> str:
        if self.is_empty():
            return "RoutingTrace(empty)"
        return f"RoutingTrace(layers={self.layers}, B={self.batch_size}, T={self.seq_len}, k={self.top_k})"

    # ---- derived traces --------------------------------------------------------------------------
    def _map(self, fn) -> RoutingTrace:
        return RoutingTrace({layer: fn(ids) for layer, ids in self.indices.items()})

    def select(self, rows: Rows) -> RoutingTrace:
        """The trace of a subset of sequences (batch rows), e.g. one micro-batch of a recorded batch.

        `rows`: an int (kept as a batch of one), a slice, a list / LongTensor of rows, or a bool mask [B].
        """
        if isinstance(rows, int):
            rows = slice(rows, rows + 1 if rows != -1 else None)
        elif not isinstance(rows, slice):
            rows = torch.as_tensor(rows)
            if rows.dim() != 1:
                raise ValueError(f"row selection must be 1-D, got shape {tuple(rows.shape)}")
            rows = rows.nonzero().squeeze(-1) if rows.dtype == torch.bool else rows.long()
            rows = rows.to(self.device)
        return self._map(lambda ids: ids[rows])

    __getitem__ = select

    def to(self, device: torch.device | str, non_blocking: bool = False) -> RoutingTrace:
        return self._map(lambda ids: ids.to(device, non_blocking=non_blocking))

    def clone(self) -> RoutingTrace:
        return self._map(torch.clone)

    @classmethod
    def cat(cls, traces: Iterable[RoutingTrace]) -> RoutingTrace:
        """Stack traces of separately recorded micro-batches along the batch axis (same layers, T and k)."""
        traces = list(traces)
        if not traces:
            raise ValueError("RoutingTrace.cat needs at least one trace")
        layers = traces[0].layers
        for t in traces[1:]:
            if t.layers != layers or t.shape[1:] != traces[0].shape[1:]:
                raise ValueError(
                    f"cannot concatenate routing traces along the batch: {traces[0]!r} vs {t!r} "
                    "(layers, T and k must match; pad micro-batches to one length before recording)"
                )
        return cls({layer: torch.cat([t.indices[layer] for t in traces], dim=0) for layer in layers})

    def _check_consistent(self) -> None:
        shapes = {layer: tuple(ids.shape) for layer, ids in self.indices.items()}
        if len(set(shapes.values())) > 1:
            raise ValueError(f"routing trace layers disagree on [B, T, k]: {shapes}")
