"""The one lookup (kernels/lookup.py): (device, layer shape, dtype, M) -> route and launch config.

CPU only: a GPU is faked by its ``DeviceFacts`` (the name the tables key it by and a Hopper's
capability), as the config tests fake one by its name and capability; no kernel runs here.
"""

import bisect
import dataclasses
import json
from pathlib import Path

import pytest
import torch

import moe_grouped_decode
from moe_grouped_decode import contract, kernels, tables
from moe_grouped_decode.awq import synthetic_moe_weights
from moe_grouped_decode.env import BATCH_INVARIANT_ENV, GLUON_W13_ENV, VLLM_BATCH_INVARIANT_ENV, WINDOW_ENV
from moe_grouped_decode.kernels import DeviceFacts, config, gluon_helpers, lookup, plan
from moe_grouped_decode.kernels.config import GroupedConfig, PrefillConfig
from moe_grouped_decode.ops import cuda

H100 = "NVIDIA H100 80GB HBM3"
H200 = "NVIDIA H200"
HOPPER = (9, 0)
QWEN38 = (512, 10, 2560, 160, 32)
QWEN3_30B = (128, 8, 2048, 768, 128)
UNTABLED = (64, 4, 1024, 96, 32)
LARGEST_STEP = 16384
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(autouse=True)
def _tables_alone(monkeypatch):
    """Every test sees the shipped tables and contracts alone (no window setting, no tuned
    config, no switch) and leaves no faked device behind."""
    for name in (WINDOW_ENV, GLUON_W13_ENV, BATCH_INVARIANT_ENV, VLLM_BATCH_INVARIANT_ENV):
        monkeypatch.delenv(name, raising=False)
    config.forget_tuned()
    kernels.forget_device_facts()
    contract.apply_tables(None)
    yield
    config.forget_tuned()
    kernels.forget_device_facts()
    contract.apply_tables(None)


# --------------------------------------------------------------------------- the rules, from the table files
# (tables.config_table's choice of table, contract.measured_contracts' windows, config.grouped_config's
# and config.prefill_config's entries), written here apart from the code under test


def shipped_files():
    directory = Path(moe_grouped_decode.__file__).parent / "tables"
    return [json.loads(path.read_text()) for path in sorted(directory.glob("*.json"))]


def table_for(files, gpu, shape, dtype):
    """The GPU's own table of the shape and dtype, else the H200's, else any GPU's (by name)."""
    same = sorted((t for t in files if tuple(t["shape"]) == shape and t["dtype"] == dtype),
                  key=lambda t: (t["gpu"] != gpu, t["gpu"] != H200, t["gpu"]))
    return same[0] if same else None


class TableRules:
    """Route and configs of one (GPU, shape, dtype) as the table files and the switches say."""

    def __init__(self, files, gpu, shape, dtype, family, batch_invariant):
        table = table_for(files, gpu, shape, dtype)
        window = table["route_table"]["grouped_tokens"] if table else None
        self.window = None if batch_invariant or window is None else tuple(window)
        self.hidden_size = shape[2]
        self.family = family
        self.batch_invariant = batch_invariant
        grouped = sorted((e for e in table["grouped"] if e["kernels"] == family), key=lambda e: e["M"]) if table else []
        self.grouped_bounds = [e["M"] for e in grouped]
        self.grouped_configs = [GroupedConfig(**e["config"]) for e in grouped]
        prefill = sorted(table["prefill"], key=lambda e: e["M"]) if table else []
        self.prefill_bounds = [e["M"] for e in prefill]
        self.prefill_configs = [PrefillConfig(**e["config"]) for e in prefill]

    def route(self, M):
        return "grouped" if self.window and self.window[0] <= M <= self.window[1] else "prefill"

    def grouped_config(self, M):
        i = bisect.bisect_left(self.grouped_bounds, M)  # the entry of the smallest M at or above
        if i < len(self.grouped_configs):
            chosen = self.grouped_configs[i]
        else:
            chosen = GroupedConfig(w13_over_groups=M >= config.OVER_GROUPS_FROM_TOKENS)
            chosen = chosen if self.family == "gluon" else chosen.as_tl()
        return chosen.fitted(self.hidden_size)

    def prefill_config(self, M):
        if self.batch_invariant:
            return PrefillConfig(token_blocks=1, w13_warps=4, w2_warps=4)
        if not self.prefill_configs:
            return PrefillConfig()
        i = min(bisect.bisect_left(self.prefill_bounds, M), len(self.prefill_configs) - 1)
        return self.prefill_configs[i]


# --------------------------------------------------------------------------- the same decisions at every M


def shapes_and_dtypes():
    """Every shipped table's (shape, dtype), the same shapes in the other dtype (a table-less dtype
    for the qwen3-30b shape), and a shape no GPU measured."""
    tabled = {(tuple(t["shape"]), t["dtype"]) for t in shipped_files()}
    others = {(shape, dtype) for shape, _ in tabled for dtype in DTYPES}
    return sorted(tabled | others | {(UNTABLED, "fp16"), (UNTABLED, "bf16")})


def token_counts(files) -> list:
    """Every M up to 512 (where the windows and the first entries lie), every M next to a table's
    entry or window edge, and a stride of primes above, to the engine's largest step."""
    edges = {int(e["M"]) for t in files for e in t["grouped"] + t["prefill"]}
    edges |= {int(m) for t in files for m in (t["route_table"].get("grouped_tokens") or ())}
    near = {m + d for m in edges for d in (-1, 0, 1)}
    counts = set(range(1, 513)) | near | set(range(513, LARGEST_STEP, 97)) | {LARGEST_STEP}
    return sorted(m for m in counts if 1 <= m <= LARGEST_STEP)


@pytest.mark.parametrize("switch", ["default", "gluon-off", "batch-invariant"])
@pytest.mark.parametrize("gpu", [H100, H200])
def test_the_lookup_follows_the_tables_at_every_token_count(monkeypatch, gpu, switch):
    """Route and config of both routes at the counts ``token_counts`` names, for every
    shipped table's shape and dtype and for table-less ones, on both GPUs the tables name: what
    the table files say (with the GPU's windows applied, as the vLLM plugin runs)."""
    files = shipped_files()
    assert {t["gpu"] for t in files} == {H100, H200}
    assert (QWEN3_30B, "bf16") not in {(tuple(t["shape"]), t["dtype"]) for t in files}  # a table-less dtype
    if switch == "gluon-off":
        monkeypatch.setenv(GLUON_W13_ENV, "0")
    if switch == "batch-invariant":
        monkeypatch.setenv(BATCH_INVARIANT_ENV, "1")
    family = "gluon" if gluon_helpers.AVAILABLE and switch != "gluon-off" else "tl"
    contract.apply_tables(gpu)
    device = DeviceFacts(gpu, HOPPER)
    checked, differences = 0, []
    counts = token_counts(files)
    for shape, dtype_name in shapes_and_dtypes():
        dtype = DTYPES[dtype_name]
        rules = TableRules(files, gpu, shape, dtype_name, family, switch == "batch-invariant")
        for M in counts:
            choice = lookup.launch_choice(device, shape, dtype, M)
            grouped = lookup.launch_choice(device, shape, dtype, M, route="grouped").config
            prefill = lookup.launch_choice(device, shape, dtype, M, route="prefill").config
            route = rules.route(M)
            want = {"route": route, "grouped": rules.grouped_config(M), "prefill": rules.prefill_config(M)}
            got = {"route": choice.route, "grouped": grouped, "prefill": prefill}
            if got != want or choice.config != want[route]:
                differences.append((shape, dtype_name, M, got, want))
            checked += 1
        # the rewrite's question over the whole range: the same window
        assert lookup.grouped_tokens(shape, dtype, (1, LARGEST_STEP)).tokens == rules.window, (shape, dtype_name)
    assert not differences, differences[:3]
    assert checked == len(shapes_and_dtypes()) * len(counts)


def test_the_rewrites_window_is_the_per_token_route():
    """``grouped_tokens`` over a range holds exactly the counts whose own route is grouped, as
    one window (the routed op's), and says why."""
    device = DeviceFacts(H200, HOPPER)
    for shape, dtype_name in shapes_and_dtypes():
        dtype = DTYPES[dtype_name]
        for tokens in ((1, 8), (2, 300), (100, 300), (113, 1024), (1, 1024)):
            found = lookup.grouped_tokens(shape, dtype, tokens)
            grouped = [m for m in range(tokens[0], tokens[1] + 1)
                       if lookup.launch_choice(device, shape, dtype, m).route == "grouped"]
            window = (grouped[0], grouped[-1]) if grouped else None
            assert found.tokens == window and found.reason, (shape, dtype_name, tokens)
            assert not grouped or grouped == list(range(window[0], window[1] + 1))


def test_two_contracts_on_one_shape_give_the_rewrite_their_joined_window():
    """Two hand-written contracts on one shape whose windows overlap: the per-M route is grouped
    in either window, and the rewrite's window over a wider range is the two joined."""
    device = DeviceFacts(H200, HOPPER)
    shape, dtype = (64, 4, 256, 128, 32), torch.float16
    first = contract.ShapeContract("first", *shape, 1, 8, measured=False)
    second = contract.ShapeContract("second", *shape, 4, 64, measured=False)
    with contract.contract_registered(first), contract.contract_registered(second):
        for tokens, window in (((1, 200), (1, 64)), ((1, 64), (1, 64)), ((10, 60), (10, 60)), ((65, 90), None)):
            grouped = [m for m in range(tokens[0], tokens[1] + 1)
                       if lookup.launch_choice(device, shape, dtype, m).route == "grouped"]
            assert grouped == (list(range(window[0], window[1] + 1)) if window else []), tokens
            found = lookup.grouped_tokens(shape, dtype, tokens)
            assert found.tokens == window, (tokens, found)
        assert "first" in lookup.grouped_tokens(shape, dtype, (1, 200)).reason
    # windows that neither overlap nor touch: the wider one
    apart = contract.ShapeContract("apart", *shape, 20, 64, measured=False)
    with contract.contract_registered(first), contract.contract_registered(apart):
        assert lookup.grouped_tokens(shape, dtype, (1, 200)).tokens == (20, 64)


# --------------------------------------------------------------------------- the device asked once


@pytest.fixture
def device_questions(monkeypatch):
    """The CPU device faked as an H200, each question of its name and capability counted."""
    asked = {"name": [], "capability": []}

    def name(device):
        asked["name"].append(device)
        return H200

    def capability(device):
        asked["capability"].append(device)
        return HOPPER

    monkeypatch.setattr(kernels, "query_device_name", name)
    monkeypatch.setattr(kernels, "query_capability", capability)
    return asked


@pytest.fixture
def planned_launches(monkeypatch):
    """The ops' CUDA implementations run on CPU tensors up to their launches: each plan they
    would launch is recorded instead."""
    plans = []
    monkeypatch.setattr(plan, "launch_plan", lambda grouped, *args, **kwargs: plans.append(grouped) or [])
    monkeypatch.setattr(plan, "launch_prefill", lambda prefill, *args, **kwargs: plans.append(prefill) or [])
    monkeypatch.setattr(torch.ops.moe_grouped_decode, "awq_moe_grouped_decode", cuda.awq_moe_grouped_decode_cuda)
    monkeypatch.setattr(torch.ops.moe_grouped_decode, "awq_moe_dense", cuda.awq_moe_dense_cuda)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    return plans


def test_a_warmup_asks_the_device_once(device_questions, planned_launches):
    """A warmup over a layer's grouped window and the prefill route's counts up to the largest
    step asks the device's name and capability once each, and plans every call with them."""
    E, k, K, N, G = shape = (8, 2, 64, 32, 32)
    window = contract.ShapeContract("lookup-warmup", *shape, min_tokens=1, max_tokens=8, dtypes=(torch.float16,))
    weights = synthetic_moe_weights(E, K, N, G, dtype=torch.float16, seed=3)
    device = weights.w13_qweight.device
    with contract.contract_registered(window):
        grouped = lookup.grouped_token_counts(device, shape, torch.float16, 16)
        prefill = cuda.prefill_warmup_counts(LARGEST_STEP)
        cuda.warmup(weights, k, grouped, dense_token_counts=prefill)
    assert grouped == list(range(1, 9))
    assert device_questions == {"name": [device], "capability": [device]}
    assert [p.num_tokens for p in planned_launches] == grouped + prefill
    assert [type(p).__name__ for p in planned_launches] == ["GroupedPlan"] * 8 + ["PrefillPlan"] * len(prefill)
    for p in planned_launches:
        route = "grouped" if isinstance(p, plan.GroupedPlan) else "prefill"
        choice = lookup.launch_choice(DeviceFacts(H200, HOPPER), shape, torch.float16, p.num_tokens, route=route)
        assert p == choice.plan(check_ids=False)
    assert len(device_questions["name"]) == len(device_questions["capability"]) == 1  # the checks above asked none


def test_devices_are_asked_once_each(device_questions):
    """Each device is asked once, however it is named; another device is asked again."""
    for device in ("cpu", torch.device("cpu"), torch.device("cpu"), "meta"):
        assert kernels.device_facts(device) == DeviceFacts(H200, HOPPER)
    assert kernels.device_name("cpu") == H200 and kernels.cuda_capability("meta") == HOPPER
    assert device_questions["name"] == device_questions["capability"] == [torch.device("cpu"), torch.device("meta")]


def test_facts_of_a_device_without_cuda():
    assert kernels.device_facts("cpu") == DeviceFacts("cpu", (0, 0))
    assert plan.kernel_family("cpu") == "tl"


# --------------------------------------------------------------------------- the cache follows what it read


def _with_launch_entries(table, grouped_config, prefill_config, window):
    """``table`` with one grouped entry per kernel family and one prefill entry, and ``window``."""
    grouped = tuple({"kernels": family, "M": 16, "config": dataclasses.asdict(grouped_config)}
                    for family in config.KERNEL_FAMILIES)
    routes = dataclasses.replace(table.routes, grouped_tokens=window)
    prefill = ({"M": 256, "config": dataclasses.asdict(prefill_config)},)
    return dataclasses.replace(table, grouped=grouped, prefill=prefill, routes=routes)


def test_registering_a_table_invalidates_the_lookup():
    """The lookup's answers follow a table registered over the shipped one (its launch tables at
    once, its window once the contracts are applied again), and return with the shipped one."""
    device = DeviceFacts(H200, HOPPER)
    shipped = tables.find_table(H200, QWEN38, "fp16")
    lo, hi = shipped.routes.grouped_tokens
    assert lo <= 3 and 6 <= hi < 300  # the counts below: two in the shipped window, one above it

    def choices():
        return {M: lookup.launch_choice(device, QWEN38, torch.float16, M) for M in (3, 6, 300)}

    before = choices()
    assert [before[M].route for M in (3, 6, 300)] == ["grouped", "grouped", "prefill"]
    measured_grouped = GroupedConfig(w13_kernel="tl", w13_block_k=128, w2_kernel="tl", w2_warps=8)
    measured_prefill = PrefillConfig(token_blocks=4, w13_warps=8, w2_warps=8)
    assert measured_grouped not in {c.config for c in before.values()}
    assert measured_prefill != lookup.launch_choice(device, QWEN38, torch.float16, 300, route="prefill").config
    with tables.table_registered(_with_launch_entries(shipped, measured_grouped, measured_prefill, (1, 4))):
        during = choices()
        assert during[3].config == during[6].config == measured_grouped.fitted(QWEN38[2])
        assert during[300].config == measured_prefill
        assert [during[M].route for M in (3, 6, 300)] == ["grouped", "grouped", "prefill"]  # windows: contracts'
        contract.apply_tables(H200)
        assert [lookup.launch_choice(device, QWEN38, torch.float16, M).route for M in (3, 6)] == ["grouped", "prefill"]
    contract.apply_tables(None)
    assert choices() == before


def test_a_tuned_config_invalidates_the_lookup(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_GROUPED_DECODE_CACHE", str(tmp_path))
    device = DeviceFacts(H200, HOPPER)
    table_config = lookup.launch_choice(device, QWEN38, torch.float16, 4).config
    tuned = GroupedConfig(w13_block_k=128, w2_kernel="gluon", w2_warps=8, w2_max_registers=0)
    assert tuned != table_config
    key = (QWEN38, H200, plan.kernel_family(device), "fp16", 4)
    config.store_tuned(config.cache_path(H200, "test"), key, tuned.fitted(QWEN38[2]))
    assert lookup.launch_choice(device, QWEN38, torch.float16, 4).config == tuned
    config.forget_tuned()
    assert lookup.launch_choice(device, QWEN38, torch.float16, 4).config == table_config


def test_a_choice_is_hashable_and_plans_its_route():
    device = DeviceFacts(H200, HOPPER)
    grouped = lookup.launch_choice(device, QWEN38, torch.float16, 8)
    prefill = lookup.launch_choice(device, QWEN38, torch.float16, 4096)
    assert len({grouped, prefill, lookup.launch_choice(device, QWEN38, torch.float16, 8)}) == 2
    assert isinstance(grouped.plan(check_ids=False), plan.GroupedPlan)
    assert isinstance(prefill.plan(check_ids=False), plan.PrefillPlan)
    other = PrefillConfig(token_blocks=2)
    assert prefill.with_config(other).plan(check_ids=False).config == other
    assert grouped.with_config(GroupedConfig(w13_block_k=96)).config == GroupedConfig(w13_block_k=96).fitted(QWEN38[2])
    with pytest.raises(ValueError, match="route must be one of"):
        lookup.launch_choice(device, QWEN38, torch.float16, 8, route="dense")


@pytest.mark.skipif(not gluon_helpers.AVAILABLE, reason="this Triton has no Gluon")
def test_the_gluon_switch_changes_a_prefill_plan_already_made(monkeypatch):
    """A wgmma config's plan follows MOE_GROUPED_DECODE_GLUON even after the same plan was made
    with the switch the other way (the plan cache's key holds it)."""
    device = DeviceFacts(H200, HOPPER)
    choice = lookup.launch_choice(device, QWEN38, torch.float16, 4096)
    assert choice.config.kernel == "wgmma"
    on = {launch.name for launch in choice.plan(check_ids=False).launches}
    monkeypatch.setenv(GLUON_W13_ENV, "0")
    off = {launch.name for launch in lookup.launch_choice(device, QWEN38, torch.float16, 4096).plan(
        check_ids=False).launches}
    assert "w13_prefill_wgmma" in on and not any("wgmma" in name for name in off), (on, off)
