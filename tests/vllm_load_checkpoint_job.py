"""Run by tests/test_checkpoints.py in a fresh process (it initialises vLLM's distributed state):
load a generated checkpoint the way vLLM's default loader does, without an engine. vLLM builds
the model from ``config.json`` (with the plugin's quantization config, registered through
``load_general_plugins``) and loads every tensor by name; its loader raises where a parameter
gets no tensor, and the model's ``load_weights`` where a tensor has no parameter. Prints one JSON
line: the model class, what vLLM read from the config, every parameter's shape and dtype, and
the quantization method of each MoE and linear layer.

    python tests/vllm_load_checkpoint_job.py CHECKPOINT_DIR
"""

from __future__ import annotations

import json
import sys

RESULT_PREFIX = "LOAD_CHECKPOINT_JOB "


def main(model_dir: str) -> int:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins
    from vllm.utils.network_utils import get_open_port

    load_general_plugins()
    config = EngineArgs(model=model_dir, skip_tokenizer_init=True, max_model_len=128,
                        enforce_eager=True).create_engine_config()
    model_config = config.model_config
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}")
        initialize_model_parallel(1, 1)
        loader = get_model_loader(config.load_config)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(model_config.dtype)
        try:
            model = loader.create_model(vllm_config=config, model_config=model_config)
            loader.load_weights(model, model_config)  # raises on a parameter no tensor initialised
        finally:
            torch.set_default_dtype(previous)
    hf = model_config.hf_config
    methods = {}
    for name, module in model.named_modules():
        if isinstance(module, (RoutedExperts, LinearBase)):
            methods[name] = type(module.quant_method).__name__
    result = {
        "model_class": type(model).__name__,
        "architecture": model_config.architecture,
        "quantization": model_config.quantization,
        "use_mla": bool(model_config.use_mla),
        "hf_config": {key: getattr(hf, key, None) for key in (
            "model_type", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
            "first_k_dense_replace", "moe_layer_freq", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "num_experts", "hidden_size", "num_hidden_layers")},
        "params": {name: [list(p.shape), str(p.dtype).removeprefix("torch.")] for name, p in model.named_parameters()},
        "methods": methods,
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
