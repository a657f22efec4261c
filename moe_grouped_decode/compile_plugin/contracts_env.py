"""Extra shape contracts for vLLM processes, named in an environment variable.

vLLM builds the model in its engine process (and in worker processes), where
only the plugin runs; a contract registered in the caller's process is not
there. ``MOE_GROUPED_DECODE_CONTRACTS`` (not ``VLLM_``-prefixed, which vLLM
warns about as unknown) carries extra contracts as a
JSON list, which :func:`moe_grouped_decode.compile_plugin.register` registers
in every process, before any model is built::

    MOE_GROUPED_DECODE_CONTRACTS='[{"name": "my-moe", "num_experts": 8,
      "top_k": 2, "hidden_size": 128, "intermediate_size": 64, "group_size": 32,
      "min_tokens": 2, "max_tokens": 8, "dtypes": ["float16"]}]'
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Iterable, List

import torch

from ..contract import ShapeContract, register_contract

CONTRACTS_ENV = "MOE_GROUPED_DECODE_CONTRACTS"
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def contracts_to_json(contracts: Iterable[ShapeContract]) -> str:
    """The environment variable's value for ``contracts`` (as contracts written by hand: where a
    shipped contract was measured is the route tables' to say, not the environment's)."""
    return json.dumps([{**{k: v for k, v in asdict(c).items() if k != "measured"},
                        "dtypes": [str(d).removeprefix("torch.") for d in c.dtypes]} for c in contracts])


def contracts_from_json(text: str) -> List[ShapeContract]:
    """Contracts written by hand: they admit their layers unmeasured (``measured`` False)."""
    try:
        entries = json.loads(text)
        for entry in entries:
            if "measured" in entry:
                raise ValueError("'measured' is not set by hand: a contract given here admits its layers "
                                 "unmeasured; measured ones come from `python -m moe_grouped_decode tune`")
        return [ShapeContract(**{**entry, "dtypes": tuple(_DTYPES[d] for d in entry["dtypes"])}) for entry in entries]
    except (ValueError, TypeError, KeyError) as error:
        raise ValueError(f"{CONTRACTS_ENV} must be a JSON list of shape contracts: {error}") from error


def register_env_contracts() -> List[ShapeContract]:
    """Register the contracts the environment names (none when it is unset)."""
    contracts = contracts_from_json(os.environ.get(CONTRACTS_ENV) or "[]")
    for contract in contracts:
        register_contract(contract)
    return contracts
