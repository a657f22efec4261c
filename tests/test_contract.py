"""Shape contracts: the one admission function at every boundary."""

import dataclasses

import pytest
import torch

from moe_grouped_decode.contract import (
    QWEN38_TP4,
    LayerShape,
    ShapeContract,
    admits,
    admitted_window,
    contract_registered,
    contracts_fingerprint,
    register_contract,
    registered_contracts,
)

QWEN = LayerShape(num_experts=512, top_k=10, hidden_size=2560, intermediate_size=160, group_size=32, dtype=torch.float16)


def test_qwen38_tp4_preset():
    c = QWEN38_TP4
    assert (c.num_experts, c.top_k, c.hidden_size, c.intermediate_size, c.group_size) == (512, 10, 2560, 160, 32)
    assert (c.min_tokens, c.max_tokens) == (2, 8)
    assert c.dtypes == (torch.float16, torch.bfloat16)
    assert c.max_rows == 80
    assert QWEN38_TP4 in registered_contracts()


@pytest.mark.parametrize(
    "tokens,admitted",
    [
        (0, False),  # empty step
        (1, False),  # C1 keeps the dense route
        (2, True),  # bottom of the window
        (8, True),  # top of the window
        (9, False),  # just past it
        (32, False),
        (127, False),
        (128, False),  # prefill-sized
    ],
)
def test_token_window_boundaries(tokens, admitted):
    result = admits(QWEN, tokens)
    assert bool(result) is admitted
    if admitted:
        assert result.contract is QWEN38_TP4
    else:
        assert "outside window 2..8" in result.reason


@pytest.mark.parametrize(
    "field,value,letter",
    [
        ("num_experts", 256, "E=256"),
        ("top_k", 8, "k=8"),
        ("hidden_size", 2592, "K=2592"),
        ("intermediate_size", 384, "N=384"),
        ("group_size", 128, "G=128"),
        ("dtype", torch.float32, "dtype=torch.float32"),
    ],
)
def test_every_shape_mismatch_is_rejected_with_reason(field, value, letter):
    shape = dataclasses.replace(QWEN, **{field: value})
    for tokens in (None, 4):
        result = admits(shape, tokens)
        assert not result
        assert letter in result.reason


def test_bf16_admitted():
    assert admits(dataclasses.replace(QWEN, dtype=torch.bfloat16), 4)


def test_shape_only_question():
    assert admits(QWEN).contract is QWEN38_TP4


@pytest.mark.parametrize(
    "token_range,admitted",
    [
        ((2, 8), True),  # exactly the window: a compile range for decode
        ((4, 4), True),
        ((1, 8), False),  # includes C1
        ((2, 9), False),
        ((1, 8192), False),  # vLLM's default whole range
    ],
)
def test_symbolic_ranges_must_lie_inside_the_window(token_range, admitted):
    assert bool(admits(QWEN, token_range)) is admitted


def test_bad_range_raises():
    with pytest.raises(ValueError, match="lo <= hi"):
        admits(QWEN, (8, 2))


def test_registry_add_remove_and_fingerprint():
    small = ShapeContract("test-small", num_experts=8, top_k=2, hidden_size=64, intermediate_size=32, group_size=32, min_tokens=1, max_tokens=4)
    before = contracts_fingerprint()
    shape = LayerShape(8, 2, 64, 32, 32, torch.bfloat16)
    assert not admits(shape, 2)
    with contract_registered(small):
        assert admits(shape, 2).contract is small
        assert contracts_fingerprint() != before
        register_contract(small)  # re-registering the same contract is a no-op
        with pytest.raises(ValueError, match="already registered"):
            register_contract(dataclasses.replace(small, max_tokens=5))
    assert not admits(shape, 2)
    assert contracts_fingerprint() == before


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(min_tokens=0, max_tokens=4), "token window"),
        (dict(min_tokens=5, max_tokens=4), "token window"),
        (dict(hidden_size=48), "multiple of group_size"),  # 48 % 32
        (dict(intermediate_size=36, group_size=4), "multiple of group_size=4 and of 8"),  # 36 % 8
    ],
)
def test_invalid_contracts_raise(kwargs, match):
    base = dict(name="bad", num_experts=8, top_k=2, hidden_size=64, intermediate_size=32, group_size=32, min_tokens=1, max_tokens=4)
    with pytest.raises(ValueError, match=match):
        ShapeContract(**{**base, **kwargs})


def test_layer_shape_from_tensors():
    x = torch.empty(3, 2560, dtype=torch.bfloat16)
    ids = torch.empty(3, 10, dtype=torch.int64)
    w13 = torch.empty(512, 2560, 40, dtype=torch.int32)
    w2 = torch.empty(512, 160, 320, dtype=torch.int32)
    assert LayerShape.from_tensors(x, ids, w13, w2, 32) == dataclasses.replace(QWEN, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "token_range,window",
    [
        ((1, 8192), (2, 8)),  # vLLM's whole range: the grouped route runs inside the window only
        ((1, 4), (2, 4)),  # a range reaching below the window
        ((6, 20), (6, 8)),  # a range reaching above it
        ((3, 5), (3, 5)),  # a range inside it is its own window
        ((1, 1), None),  # C1 only: nothing admitted
        ((9, 64), None),  # past the window
    ],
)
def test_admitted_window(token_range, window):
    assert admitted_window(QWEN, token_range) == window


def test_admitted_window_needs_a_matching_shape():
    assert admitted_window(dataclasses.replace(QWEN, top_k=8), (1, 8192)) is None
