"""A tiny random Llama checkpoint made locally (no model hub): real-engine tests and demo.

``make_tiny_model(dir)`` writes ``config.json`` (transformers' own ``LlamaConfig``) and
``model.safetensors`` with bf16 weights drawn by numpy (seed 0): normal(0, 0.02) for
embeddings and projections, ones for the RMS norms, as transformers initialises a
Llama. No torch here (``kvevents`` never imports it): the weights are rounded to bf16
with integer ops and the safetensors file (an 8-byte header length, a JSON header, the
raw little-endian tensors) is written directly. Prompts are token ids, so no tokenizer is
needed (the engine runs with ``skip_tokenizer_init``). Deterministic: the same seed gives
the same bytes, so two engines given the directory compute the same thing. An existing
``config.json`` in ``path`` is taken as a finished model and left alone.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 1024, 256, 512, 2, 4, 2
INIT_STD = 0.02


def _bf16_bytes(x: np.ndarray) -> bytes:
    """float32 -> bfloat16 (round to nearest even), little-endian bytes."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return rounded.astype("<u2").tobytes()


def _tensors(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    head_dim = HIDDEN // HEADS

    def normal(*shape: int) -> np.ndarray:
        return rng.normal(0.0, INIT_STD, size=shape).astype(np.float32)

    out = {"model.embed_tokens.weight": normal(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = normal(HEADS * head_dim, HIDDEN)
        out[p + "self_attn.k_proj.weight"] = normal(KV_HEADS * head_dim, HIDDEN)
        out[p + "self_attn.v_proj.weight"] = normal(KV_HEADS * head_dim, HIDDEN)
        out[p + "self_attn.o_proj.weight"] = normal(HIDDEN, HEADS * head_dim)
        out[p + "mlp.gate_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        out[p + "mlp.up_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        out[p + "mlp.down_proj.weight"] = normal(HIDDEN, INTERMEDIATE)
        out[p + "input_layernorm.weight"] = np.ones(HIDDEN, np.float32)
        out[p + "post_attention_layernorm.weight"] = np.ones(HIDDEN, np.float32)
    out["model.norm.weight"] = np.ones(HIDDEN, np.float32)
    out["lm_head.weight"] = normal(VOCAB, HIDDEN)
    return out


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, t in tensors.items():
        data = _bf16_bytes(t)
        header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format aligns the data section to 8 bytes
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for data in blobs:
            f.write(data)
    os.replace(tmp, path)  # never leave a truncated weights file under the final name


def make_tiny_model(path: str | Path, seed: int = 0) -> Path:
    from transformers import LlamaConfig

    path = Path(path)
    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    _write_safetensors(path / "model.safetensors", _tensors(seed))
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=4096,
        initializer_range=INIT_STD, tie_word_embeddings=False,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(path)  # config.json last: its presence marks a finished model
    return path


if __name__ == "__main__":
    import sys

    print(make_tiny_model(sys.argv[1]))
