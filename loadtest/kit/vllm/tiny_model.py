"""A tiny randomly initialised Llama and a byte-level BPE tokenizer, built on disk with no hub.

Deterministic: the same seed gives the same weights, so two engine processes (or two test
runs) load the same model from the same directory.
"""

from __future__ import annotations

import os

SENTENCES = [
    "The sidecar keeps the attention pages of every engine on the node.",
    "A prefix computed once is loaded again instead of being recomputed.",
    "Pages move by slot through shared memory; only keys travel over HTTP.",
    "When a page is torn or corrupt the engine recomputes it and carries on.",
]


SIZES = {  # hidden, layers, heads, kv heads, head_dim, intermediate, max positions
    "tiny": (128, 2, 4, 2, 32, 256, 512),
    "small": (512, 8, 8, 4, 64, 1536, 4096),  # for time-to-first-token figures
    # make bench-engines: a cold 1k-token prompt takes over a second on this CPU
    "bench": (768, 12, 12, 4, 64, 2048, 16384),
    "share": (128, 2, 4, 2, 32, 256, 16384),  # several engines, long multi-turn prompts
}


def build(path: str, seed: int = 0, size: str = "tiny") -> str:
    """Write config, weights and tokenizer to `path` (once) and return it."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer(path)
    torch.manual_seed(seed)
    hidden, layers, heads, kv_heads, head_dim, inter, positions = SIZES[size]
    cfg = LlamaConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=positions,
        initializer_range=0.3,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def tokenizer(path: str) -> None:
    """A byte-level BPE tokenizer of 1,024 tokens, written to `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(SENTENCES * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
