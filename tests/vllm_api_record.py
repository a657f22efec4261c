"""Record, from a vLLM source tree, the parts of vLLM's API the plugin depends on.

It reads the ``.py`` files (``ast``, nothing imported), so a release's wheel
can be recorded without installing it::

    pip download --no-deps vllm==0.26.0 -d /tmp/wheels
    unzip -q /tmp/wheels/vllm-0.26.0-*.whl 'vllm/*.py' -d /tmp/vllm-0.26.0
    python tests/vllm_api_record.py /tmp/vllm-0.26.0 0.26.0   # updates tests/vllm_api_record.json

``tests/test_vllm_compat.py`` checks the plugin's shims against every recorded
release and checks that recording the installed vLLM gives its stored entry.
When the recorder gains a key, re-record every release in the file (the test
wants the same keys in each entry).
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional

RECORD = Path(__file__).with_name("vllm_api_record.json")

QUANT_UTILS = "vllm/model_executor/layers/quantization/utils/quant_utils.py"
MOE_RUNNER = "vllm/model_executor/layers/fused_moe/runner/moe_runner.py"
FUSED_MOE_LAYER = "vllm/model_executor/layers/fused_moe/layer.py"
METHOD_BASE = "vllm/model_executor/layers/fused_moe/fused_moe_method_base.py"
AUTO_AWQ = "vllm/model_executor/layers/quantization/auto_awq.py"
ROUTED_EXPERTS = "vllm/model_executor/layers/fused_moe/routed_experts.py"
MOE_CONFIG = "vllm/model_executor/layers/fused_moe/config.py"
# the FusedMoEConfig fields the plugin reads (moe_method.py: layer_shape, unservable_reason, the workspace)
MOE_CONFIG_FIELDS = ("num_experts", "num_local_experts", "experts_per_token", "hidden_dim",
                     "intermediate_size_per_partition", "in_dtype", "activation", "has_bias", "is_lora_enabled",
                     "rocm_aiter_fmoe_enabled", "max_num_tokens")
PLATFORM = "vllm/platforms/interface.py"
ENVS = "vllm/envs.py"
INDUCTOR_PASS = "vllm/compilation/passes/inductor_pass.py"
CONFIG_UTILS = "vllm/config/utils.py"
COMPILATION_CONFIG = "vllm/config/compilation.py"
SCHEDULER_CONFIG = "vllm/config/scheduler.py"
# the module-level functions of the MoE runner the plugin imports (passes.py)
RUNNER_FUNCTIONS = ("_moe_forward", "_moe_forward_fake", "_moe_forward_shared", "_moe_forward_shared_fake",
                    "_resolve_layer_name", "get_layer_from_name")
# what the plugin reads of vLLM's MoE layer (moe_method.py: unservable_reason, apply, process_weights_after_loading)
ROUTED_EXPERTS_ATTRS = ("apply_router_weight_on_input", "swiglu_limit", "swiglu_alpha", "layer_name", "moe_config",
                        "quant_method", "expert_map")


def _parse(root: Path, relative: str) -> ast.Module:
    return ast.parse((root / relative).read_text())


def _params(function: Optional[ast.FunctionDef]) -> Optional[List[str]]:
    if function is None:
        return None  # recorded as null: the release has no such function
    a = function.args
    return [arg.arg for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs)]


def _function(tree: ast.AST, name: str, cls: Optional[str] = None) -> Optional[ast.FunctionDef]:
    scope = tree
    if cls is not None:
        scope = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
        if scope is None:
            return None
    return next((n for n in scope.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _registered_op_tags(tree: ast.Module) -> Dict[str, List[str]]:
    """op_name -> tag names of every ``direct_register_custom_op(...)`` call at module level."""
    tags = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "direct_register_custom_op":
            keywords = {k.arg: k.value for k in node.keywords}
            op_name = ast.literal_eval(keywords["op_name"])
            values = keywords.get("tags")
            tags[op_name] = [element.attr for element in values.elts] if values is not None else []
    return tags


def _returned_self_attributes(function: Optional[ast.FunctionDef]) -> List[str]:
    """The ``self.<name>`` attributes a property can return (either branch of a conditional)."""
    if function is None:
        return []
    names = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Return) and node.value is not None:
            values = [node.value]
            while values:
                value = values.pop()
                if isinstance(value, ast.IfExp):
                    values += [value.body, value.orelse]
                elif isinstance(value, ast.Attribute) and getattr(value.value, "id", None) == "self":
                    names.add(value.attr)
    return sorted(names)


def _class(tree: ast.Module, name: str) -> Optional[ast.ClassDef]:
    return next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)


def _class_fields(tree: ast.Module, cls: str, wanted) -> List[str]:
    """Which of ``wanted`` the (data)class ``cls`` declares as annotated fields."""
    scope = _class(tree, cls)
    if scope is None:
        return []
    declared = {n.target.id for n in scope.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    return [name for name in wanted if name in declared]


def _self_attributes(node: Optional[ast.AST], ctx) -> List[str]:
    """The ``self.<name>`` attributes ``node`` reads (``ast.Load``) or assigns (``ast.Store``)."""
    if node is None:
        return []
    return sorted({
        n.attr for n in ast.walk(node)
        if isinstance(n, ast.Attribute) and getattr(n.value, "id", None) == "self" and isinstance(n.ctx, ctx)
    })


def _class_attributes(tree: ast.Module, cls: str, wanted) -> List[str]:
    """Which of ``wanted`` the class ``cls`` has: a method or property, a class-level field, a ``self.`` assignment."""
    scope = _class(tree, cls)
    if scope is None:
        return []
    names = set(_self_attributes(scope, ast.Store))
    for node in scope.body:
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return [name for name in wanted if name in names]


def _returned_literals(function: Optional[ast.FunctionDef]) -> List:
    if function is None:
        return []
    values = []
    for node in ast.walk(function):
        if isinstance(node, ast.Return) and node.value is not None:
            try:
                values.append(ast.literal_eval(node.value))
            except ValueError:
                values.append(ast.unparse(node.value))  # not a literal: its source, so a change still shows
    return values


def _module_variables(tree: ast.Module, wanted) -> List[str]:
    """Which of ``wanted`` the module assigns at its top level."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return [name for name in wanted if name in names]


def _startswith_prefix(function: ast.FunctionDef) -> Optional[str]:
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "startswith" and node.args:
            return ast.literal_eval(node.args[0])
    return None


def record(root) -> dict:
    """What the plugin relies on, as this vLLM source tree spells it."""
    root = Path(root)
    quant_utils = _parse(root, QUANT_UTILS)
    runner = _parse(root, MOE_RUNNER)
    layer = _parse(root, FUSED_MOE_LAYER)
    platform = _parse(root, PLATFORM)
    envs = _parse(root, ENVS)
    validator = _function(platform, "validate_environ", cls="Platform")
    validator_owner = "Platform" if validator is not None else "vllm.envs"
    if validator is None:
        validator = _function(envs, "validate_environ")
    auto_awq = _parse(root, AUTO_AWQ)
    method_base = _parse(root, METHOD_BASE)
    inductor_pass = _parse(root, INDUCTOR_PASS)
    compilation = _parse(root, COMPILATION_CONFIG)
    factories = [
        n.name for n in layer.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in ("FusedMoE", "FusedMoEFactory")
    ]
    return {
        # differences the shims in compile_plugin/vllm_compat.py handle
        "is_layer_skipped": _params(_function(quant_utils, "is_layer_skipped")),
        "op_tags": _registered_op_tags(runner),
        "fused_moe_factory": factories,
        "validate_environ": validator_owner,
        "unknown_env_prefix": _startswith_prefix(validator),
        # spellings the plugin uses unshimmed: the same in every supported release
        "moe_forward": _params(_function(runner, "_moe_forward")),
        # one implementation (passes._forward_grouped) serves both replacement ops
        "moe_forward_shared": _params(_function(runner, "_moe_forward_shared")),
        "runner_functions": [name for name in RUNNER_FUNCTIONS if _function(runner, name) is not None],
        "forward_impl": _params(_function(runner, "_forward_impl", cls="MoERunner")),
        "method_apply": _params(_function(method_base, "apply", cls="FusedMoEMethodBase")),
        # the plugin's method calls FusedMoEMethodBase.__init__ and overrides these of AutoAWQMoEMethod
        "method_base_init": _params(_function(method_base, "__init__", cls="FusedMoEMethodBase")),
        "method_overrides": {
            name: _params(_function(auto_awq, name, cls="AutoAWQMoEMethod"))
            for name in ("process_weights_after_loading", "get_fused_moe_quant_config")
        },
        "override_quantization_method": _params(
            _function(auto_awq, "override_quantization_method", cls="AutoAWQConfig")
        ),
        "create_weights": _params(_function(auto_awq, "create_weights", cls="AutoAWQMoEMethod")),
        # the plugin's method skips AutoAWQMoEMethod.__init__ and sets what create_weights reads itself;
        # a release may read fewer (the test checks the plugin sets every one, not equality)
        "create_weights_reads": _self_attributes(
            _function(auto_awq, "create_weights", cls="AutoAWQMoEMethod"), ast.Load
        ),
        "routed_experts_attrs": _class_attributes(_parse(root, ROUTED_EXPERTS), "RoutedExperts", ROUTED_EXPERTS_ATTRS),
        # passes.py: the post-grad hook, the compile range of the graph being compiled, the compile-range split
        "compile_pass": {
            "pass_key": _returned_literals(_function(platform, "pass_key", cls="Platform")),
            "pass_context": _module_variables(inductor_pass, ("_pass_context",))
            + _class_attributes(inductor_pass, "PassContext", ("compile_range",)),
            "range": _class_fields(_parse(root, CONFIG_UTILS), "Range", ("start", "end")),
            "inductor_pass": _class_attributes(inductor_pass, "InductorPass", ("uuid", "hash_source", "hash_dict")),
            "compilation_config": _class_fields(compilation, "CompilationConfig",
                                                ("mode", "inductor_compile_config", "compile_ranges_endpoints")),
            "compilation_mode": _class_attributes(compilation, "CompilationMode", ("VLLM_COMPILE",)),
            "scheduler_config": _class_fields(_parse(root, SCHEDULER_CONFIG), "SchedulerConfig",
                                              ("max_num_batched_tokens",)),
        },
        # expert parallelism: apply maps the router's global ids through layer.expert_map, which is
        # the -1/local map except under ROCm AITER (a 0/1 mask: unservable_reason refuses that)
        "expert_map": _returned_self_attributes(_function(_parse(root, ROUTED_EXPERTS), "expert_map", cls="RoutedExperts")),
        "moe_config_fields": _class_fields(_parse(root, MOE_CONFIG), "FusedMoEConfig", MOE_CONFIG_FIELDS),
    }


def _dump(data: dict) -> str:
    """One line per recorded item, releases in order (a readable diff when a release is added)."""
    versions = []
    for version, entry in sorted(data.items(), key=lambda item: tuple(int(p) for p in item[0].split("."))):
        items = ",\n".join(f"  {json.dumps(key)}: {json.dumps(value)}" for key, value in entry.items())
        versions.append(f" {json.dumps(version)}: {{\n{items}\n }}")
    return "{\n" + ",\n".join(versions) + "\n}\n"


def main(argv) -> int:
    root, version = argv[1], argv[2]
    data = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    data[version] = record(root)
    RECORD.write_text(_dump(data))
    print(json.dumps(data[version], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
