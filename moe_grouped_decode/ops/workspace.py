"""The grouped op's scratch: one flat int32 tensor, carved into named regions.

The workspace is allocated once (per engine, or per test) with the largest row
count R it must hold and passed to every call, so a CUDA graph captures fixed
addresses and a replay never allocates. It is declared mutated in the op's
schema (``Tensor(a!) workspace``), which is what lets torch.compile and CUDA
graphs order it correctly.

Layout for capacity R rows (every region starts on a 64-byte boundary)::

    combine_arrivals [R*K/8]   int32  CUDA fused combine: W2 programs arrived per (token, column tile);
                                      M * ceil(K / w2_block_k) are used, this bounds it for any tile
    activations     [R, N]     fp32   silu(gate) * up, one row per routed row
    row_outputs     [R, K]     fp32   W2 output per routed row, before the combine
    gate_up_partials [S, R, 2N] fp32  CUDA W13 split-K partial sums, room for S = MAX_SPLIT_K splits

Every CUDA ``tl`` W2 program of a routed row sums the row's W13 partials in a fixed order and
writes the same activations to ``activations`` (then reads its tensor-core fragments back from
there; the Gluon W2 keeps them in shared memory); the CPU implementation uses no partials.
The CUDA kernels index experts by routed row and need no compaction; the CPU implementation
compacts the rows in torch (``awq_moe.compact_rows``), outside the workspace.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.config import MAX_SPLIT_K

_ALIGN = 16  # int32 elements = 64 bytes


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class WorkspaceLayout:
    rows: int  # R capacity
    hidden_size: int  # K
    intermediate_size: int  # N

    def _regions(self):
        R, K, N = self.rows, self.hidden_size, self.intermediate_size
        return (
            ("combine_arrivals", R * -(-K // 8)),
            ("activations", R * N),
            ("row_outputs", R * K),
            ("gate_up_partials", MAX_SPLIT_K * R * 2 * N),
        )

    def offsets(self) -> dict:
        """Region name -> (start, length) in int32 elements."""
        out, start = {}, 0
        for name, length in self._regions():
            out[name] = (start, length)
            start += _aligned(length)
        return out

    @property
    def numel(self) -> int:
        return sum(_aligned(length) for _, length in self._regions())


def workspace_numel(rows: int, hidden_size: int, intermediate_size: int) -> int:
    """int32 elements a workspace for ``rows`` routed rows needs."""
    return WorkspaceLayout(rows, hidden_size, intermediate_size).numel


def alloc_workspace(max_tokens: int, top_k: int, hidden_size: int, intermediate_size: int, device) -> torch.Tensor:
    """Allocate scratch for up to ``max_tokens`` tokens routed to ``top_k`` experts each.

    Call it once, outside any CUDA-graph capture, and reuse the tensor.
    """
    for name, value in (
        ("max_tokens", max_tokens),
        ("top_k", top_k),
        ("hidden_size", hidden_size),
        ("intermediate_size", intermediate_size),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"alloc_workspace: {name} must be a positive int, got {value!r}")
    numel = workspace_numel(max_tokens * top_k, hidden_size, intermediate_size)
    return torch.empty(numel, dtype=torch.int32, device=device)


@dataclass(frozen=True)
class WorkspaceViews:
    combine_arrivals: torch.Tensor
    activations: torch.Tensor  # fp32 [R, N]
    row_outputs: torch.Tensor  # fp32 [R, K]
    gate_up_partials: torch.Tensor  # fp32 [MAX_SPLIT_K * R * 2N], flat


def workspace_views(workspace: torch.Tensor, rows: int, hidden_size: int, intermediate_size: int) -> WorkspaceViews:
    """Views of the regions for ``rows`` live rows (the caller checked capacity)."""
    layout = WorkspaceLayout(rows, hidden_size, intermediate_size)
    views = {}
    for name, (start, length) in layout.offsets().items():
        views[name] = workspace[start : start + length]
    return WorkspaceViews(
        combine_arrivals=views["combine_arrivals"],
        activations=views["activations"].view(torch.float32).view(rows, intermediate_size),
        row_outputs=views["row_outputs"].view(torch.float32).view(rows, hidden_size),
        gate_up_partials=views["gate_up_partials"].view(torch.float32),
    )
