"""A tiny random Llama checkpoint made locally (no model hub): real-engine tests and demo.

``make_tiny_model(dir)`` writes ``config.json`` + safetensors weights (bf16, seed 0)
with transformers' own ``save_pretrained``; prompts are token ids, so no tokenizer is
needed (the engine runs with ``skip_tokenizer_init``). Deterministic: the same seed
gives the same weights, so two engines given the directory compute the same thing.
"""

from __future__ import annotations

from pathlib import Path


def make_tiny_model(path: str | Path, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
    )
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


if __name__ == "__main__":
    import sys

    print(make_tiny_model(sys.argv[1]))
