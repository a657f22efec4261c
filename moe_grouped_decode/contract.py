"""Shape contracts and the one admission function.

A *contract* names one MoE layer family that the grouped decode route is built
and tuned for. ``admits`` is the single source of truth for every admission
decision in the project: the runtime route, warmup, the Inductor rewrite, the
vLLM method and the CLI all ask it, so they can never disagree.

Shape letters used throughout the package:

    M  tokens in the step          k  top-k experts per token
    E  experts in the layer        K  hidden size
    N  per-rank intermediate size  G  AWQ group size (rows per scale/zero)
    A  active (distinct) experts   R  routed rows, R = M * k
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass, field
from typing import Iterator, Optional, Tuple, Union

import torch

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class LayerShape:
    """What an MoE layer looks like to the admission function."""

    num_experts: int  # E
    top_k: int  # k
    hidden_size: int  # K
    intermediate_size: int  # N (per rank)
    group_size: int  # G
    dtype: torch.dtype  # activation dtype

    @classmethod
    def from_tensors(
        cls,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        w13_qweight: torch.Tensor,
        w2_qweight: torch.Tensor,
        group_size: int,
    ) -> "LayerShape":
        """Read the shape off the op's arguments (works on fake tensors too)."""
        return cls(
            num_experts=int(w13_qweight.shape[0]),
            top_k=int(topk_ids.shape[-1]),
            hidden_size=int(w13_qweight.shape[1]),
            intermediate_size=int(w2_qweight.shape[1]),
            group_size=int(group_size),
            dtype=hidden_states.dtype,
        )


@dataclass(frozen=True)
class ShapeContract:
    """One admitted layer family and the token window it is admitted for."""

    name: str
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    group_size: int
    min_tokens: int
    max_tokens: int
    dtypes: Tuple[torch.dtype, ...] = field(default=ACTIVATION_DTYPES)

    def __post_init__(self) -> None:
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"contract {self.name!r}: token window must satisfy "
                f"1 <= min_tokens <= max_tokens, got {self.min_tokens}..{self.max_tokens}"
            )
        for what, size in (("hidden_size", self.hidden_size), ("intermediate_size", self.intermediate_size)):
            if size % self.group_size or size % 8:
                raise ValueError(
                    f"contract {self.name!r}: {what}={size} must be a multiple of "
                    f"group_size={self.group_size} and of 8 (int4 packing)"
                )

    def shape_mismatches(self, shape: LayerShape) -> list[str]:
        """Human-readable reasons why ``shape`` is not this contract's family."""
        reasons = []
        for attr, letter in (
            ("num_experts", "E"),
            ("top_k", "k"),
            ("hidden_size", "K"),
            ("intermediate_size", "N"),
            ("group_size", "G"),
        ):
            got, want = getattr(shape, attr), getattr(self, attr)
            if got != want:
                reasons.append(f"{letter}={got} (contract {want})")
        if shape.dtype not in self.dtypes:
            reasons.append(f"dtype={shape.dtype} (contract {', '.join(map(str, self.dtypes))})")
        return reasons

    @property
    def max_rows(self) -> int:
        """R at the top of the window: what a workspace for this contract must hold."""
        return self.max_tokens * self.top_k


QWEN38_TP4 = ShapeContract(
    name="qwen3.8-tp4",
    num_experts=512,
    top_k=10,
    hidden_size=2560,
    intermediate_size=160,  # 640 / TP4
    group_size=32,
    min_tokens=2,  # C1 keeps the dense route (seed evidence: no gain at C1)
    max_tokens=8,
)

_REGISTRY: dict[str, ShapeContract] = {QWEN38_TP4.name: QWEN38_TP4}


def registered_contracts() -> Tuple[ShapeContract, ...]:
    return tuple(_REGISTRY.values())


def register_contract(contract: ShapeContract) -> None:
    """Add a contract. Names are unique; re-registering the same one is a no-op."""
    existing = _REGISTRY.get(contract.name)
    if existing is not None and existing != contract:
        raise ValueError(f"a different contract named {contract.name!r} is already registered")
    _REGISTRY[contract.name] = contract


def unregister_contract(name: str) -> None:
    _REGISTRY.pop(name, None)


@contextlib.contextmanager
def contract_registered(contract: ShapeContract) -> Iterator[ShapeContract]:
    """Register ``contract`` for the duration of a block (tests, experiments)."""
    was_there = contract.name in _REGISTRY
    register_contract(contract)
    try:
        yield contract
    finally:
        if not was_there:
            unregister_contract(contract.name)


def contracts_fingerprint() -> str:
    """Stable digest of the registered contract set (feeds compile-cache keys)."""
    text = repr(sorted((repr(c) for c in _REGISTRY.values())))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


TokenRange = Tuple[int, int]


@dataclass(frozen=True)
class Admission:
    """The answer of :func:`admits`: truthy when admitted, with the reason either way."""

    contract: Optional[ShapeContract]
    reason: str

    def __bool__(self) -> bool:
        return self.contract is not None


def admits(shape: LayerShape, num_tokens: Union[int, TokenRange, None] = None) -> Admission:
    """Decide whether the grouped decode route may run ``shape`` at ``num_tokens``.

    ``num_tokens`` is a concrete M, an inclusive ``(lo, hi)`` range (a symbolic M
    whose every value must be admitted, as in a compile range), or ``None`` to ask
    about the layer shape alone (used when a layer is loaded).
    """
    if num_tokens is None:
        lo = hi = None
    elif isinstance(num_tokens, tuple):
        lo, hi = (int(v) for v in num_tokens)
        if lo > hi:
            raise ValueError(f"num_tokens range must be (lo, hi) with lo <= hi, got {num_tokens}")
    else:
        lo = hi = int(num_tokens)

    rejections = []
    for contract in _REGISTRY.values():
        mismatches = contract.shape_mismatches(shape)
        if mismatches:
            rejections.append(f"{contract.name}: {', '.join(mismatches)}")
            continue
        if lo is not None and not (contract.min_tokens <= lo and hi <= contract.max_tokens):
            tokens = f"M={lo}" if lo == hi else f"M in {lo}..{hi}"
            rejections.append(
                f"{contract.name}: {tokens} outside window "
                f"{contract.min_tokens}..{contract.max_tokens}"
            )
            continue
        return Admission(contract, f"matches {contract.name}")
    if not rejections:
        return Admission(None, "no contract registered")
    return Admission(None, "; ".join(rejections))


def admitted_window(shape: LayerShape, num_tokens: TokenRange) -> Optional[TokenRange]:
    """The sub-range of ``num_tokens`` that :func:`admits` accepts for ``shape``, or None.

    For a symbolic M ranging wider than a contract's window (a compile range such
    as 1..8192): the token counts for which the grouped route may still run.
    """
    contract = admits(shape).contract
    if contract is None:
        return None
    window = (max(num_tokens[0], contract.min_tokens), min(num_tokens[1], contract.max_tokens))
    return window if window[0] <= window[1] and admits(shape, window) else None
