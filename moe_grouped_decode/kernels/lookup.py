"""The one lookup: (device, layer shape, dtype, M) -> the route a call takes and the launch config it runs.

Every decision of a route or a launch config for a token count is made here: the ops' CUDA
implementations (``ops/cuda.py``, each the config of its own route), the vLLM method's route per
call (``compile_plugin/moe_method.py``), the token counts the warmup compiles
(``compile_plugin/startup.py``), the grouped window the Inductor rewrite bakes into a graph
(``lowerings/grouped_decode.py``, ``compile_plugin/passes.py``), the autotune and the benchmark.
So none of them can disagree with another, and none asks the device again: its name and
capability are ``device_facts``'s, asked once per device.

The route: "grouped" where the layer's contract admits M (``contract.admits``: the contracts hold
the grouped windows of the tables measured on this process's GPU, ``contract.apply_tables``), else
"prefill". The config: the grouped route's from ``config.grouped_config`` (tuned, then the table of
the kernel family that runs on the device, then the default), fitted to K; the prefill route's
from ``config.prefill_config`` (the table, then the default), or in batch-invariant mode its one
config at every M.

Answers are cached per (device, shape, dtype, M, route) and per state of everything else they
read: the generations of the tables, of the tuned configs and of the contracts, and the
batch-invariant and Gluon switches. A change of any of them drops the cache.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Tuple, Union

import torch

from .. import contract, env, tables
from . import DeviceFacts, device_facts
from . import config as kernel_config
from . import plan as launch_plans
from .config import GroupedConfig, PrefillConfig, Shape

ROUTES = ("grouped", "prefill")
TokenRange = Tuple[int, int]


@dataclass(frozen=True)
class LaunchChoice:
    """One call's route and the launch config it runs, with what they were looked up for."""

    route: str  # "grouped" or "prefill"
    # grouped: fitted to K; prefill: as the table names it (the plan swaps a wgmma config where
    # those kernels do not run: plan.prefill_config_run)
    config: Union[GroupedConfig, PrefillConfig]
    device: DeviceFacts
    shape: Shape  # (E, k, K, N, G)
    dtype: torch.dtype
    num_tokens: int  # M

    def with_config(self, config: Union[GroupedConfig, PrefillConfig]) -> "LaunchChoice":
        """This call under another config of its route (a benchmark's or a tuner's candidate)."""
        if self.route == "grouped":
            config = config.fitted(self.shape[2])
        return dataclasses.replace(self, config=config)

    def plan(self, check_ids: Optional[bool] = None, **options):
        """The launch plan of this call (cached by ``kernels.plan``). ``check_ids``: the debug
        mode's kernels (default: as MOE_GROUPED_DECODE_CHECK_IDS says); ``options``: the grouped
        plan's lab switches (``plan.grouped_plan``: stages, timeline, w2_rn_scale)."""
        E, k, K, N, G = self.shape
        check_ids = env.check_ids() if check_ids is None else check_ids
        if self.route == "grouped":
            return launch_plans.grouped_plan(self.num_tokens, k, K, N, G, self.dtype, self.device.capability,
                                             self.config, num_experts=E, check_ids=check_ids, **options)
        if options:
            raise TypeError(f"the prefill route's plan has no lab switches, got {sorted(options)}")
        return launch_plans.prefill_plan(self.num_tokens, k, E, K, N, G, self.dtype, self.device.capability,
                                         self.config, check_ids)


@dataclass(frozen=True)
class GroupedTokens:
    """Which token counts of a range take the grouped route, and why."""

    tokens: Optional[TokenRange]  # one sub-range of the range asked about; None: none of its counts
    reason: str  # the admission's (contract.admits): the contract that matched, or why each did not


def grouped_tokens(shape: Shape, dtype: torch.dtype, tokens: TokenRange) -> GroupedTokens:
    """The counts of ``tokens`` (lo, hi inclusive) that take the grouped route for a layer of
    ``shape`` and ``dtype``: all of them where a contract's window holds them all, else those
    inside the window of the contract the layer's shape matches (a graph compiled for the range
    then picks its route per M at run time), else none. For a single M (``tokens`` (M, M)) this
    is the lookup's route."""
    layer = contract.LayerShape(*shape, dtype)
    whole = contract.admits(layer, tokens)
    if whole:
        return GroupedTokens(tuple(tokens), whole.reason)
    part = contract.admitted_window(layer, tokens)
    if part is not None:
        reasons = dict.fromkeys(contract.admits(layer, m).reason for m in {part[0], part[1]})
        return GroupedTokens(part, "; ".join(reasons))
    return GroupedTokens(None, whole.reason)


def launch_choice(device, shape: Shape, dtype: torch.dtype, num_tokens: int,
                  route: Optional[str] = None) -> LaunchChoice:
    """The route a call of ``num_tokens`` tokens takes through a layer of ``shape`` (E, k, K, N, G)
    and ``dtype`` on ``device`` (a torch device, or its ``DeviceFacts``), and the config it runs
    there. ``route``: the config of that route instead (an op called directly runs its own)."""
    global _state_cached
    facts = device if isinstance(device, DeviceFacts) else device_facts(device)
    state = _decision_state()
    if state != _state_cached:
        _choice.cache_clear()
        _state_cached = state
    return _choice(facts, tuple(shape), dtype, int(num_tokens), route, state)


def grouped_token_counts(device, shape: Shape, dtype: torch.dtype, max_tokens: int) -> List[int]:
    """Every M from 1 to ``max_tokens`` whose route is the grouped one (what a warmup compiles)."""
    return [m for m in range(1, max_tokens + 1) if launch_choice(device, shape, dtype, m).route == "grouped"]


class _DecisionState(NamedTuple):
    """Everything besides the key that a cached answer read."""

    tables: int
    tuned: int
    contracts: int
    batch_invariant: bool
    gluon: bool


_state_cached: Optional[_DecisionState] = None


def _decision_state() -> _DecisionState:
    return _DecisionState(tables.generation(), kernel_config.tuned_generation(), contract.registry_generation(),
                          env.batch_invariant(), env.gluon_w13_enabled())


@functools.lru_cache(maxsize=8192)
def _choice(facts: DeviceFacts, shape: Shape, dtype: torch.dtype, M: int, route: Optional[str],
            state: _DecisionState) -> LaunchChoice:
    if route is None:
        # the same object as the route's own answer: an op then finds what its caller looked up
        route = "grouped" if grouped_tokens(shape, dtype, (M, M)).tokens else "prefill"
        return _choice(facts, shape, dtype, M, route, state)
    dtype_name = launch_plans.DTYPE_NAMES[dtype]
    if route == "grouped":
        config = kernel_config.grouped_config(shape, facts.name, launch_plans.kernel_family(facts), dtype_name, M)
    elif route == "prefill":
        config = (kernel_config.BATCH_INVARIANT_PREFILL if state.batch_invariant
                  else kernel_config.prefill_config(shape, facts.name, dtype_name, M))
    else:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    return LaunchChoice(route, config, facts, shape, dtype, M)
