"""A tiny random Llama checkpoint made locally (no model hub): real-engine tests and demo.

``make_tiny_model(dir)`` writes ``config.json`` (transformers' own ``LlamaConfig``) and
``model.safetensors`` with bf16 weights drawn by numpy (seed 0): normal(0, 0.02) for
embeddings and projections, ones for the RMS norms, as transformers initialises a
Llama. No torch here (``kvevents`` never imports it): the weights are rounded to bf16
with integer ops and the safetensors file (an 8-byte header length, a JSON header, the
raw little-endian tensors) is written directly. Deterministic: the same seed gives the
same bytes, so two engines given the directory compute the same thing. An existing
``config.json`` in ``path`` is taken as a finished model and left alone.

Without a tokenizer, prompts are token ids (the engine runs with ``skip_tokenizer_init``).
``make_tiny_tokenizer(dir)`` (or ``make_tiny_model(dir, tokenizer=True)``) adds one, so
``vllm serve DIR`` takes text and chat and ``kvevents serve --tokenizer M=DIR`` computes
the same ids: a byte-level BPE (GPT-2 style) trained with ``tokenizers`` on a fixed
built-in text to exactly :data:`VOCAB` ids (every id the model can emit decodes), Llama's
special ids (``<unk>`` 0, ``<s>`` 1 = BOS added by the post-processor, ``</s>`` 2 = EOS,
as ``LlamaConfig`` says) plus the chat markers ``<|im_start|>`` / ``<|im_end|>``, saved
by ``transformers`` as a Hugging Face tokenizer directory (``tokenizer.json``,
``tokenizer_config.json`` with a ChatML-like ``chat_template``). Training is
deterministic: the same files every time. An existing ``tokenizer_config.json`` is
taken as a finished tokenizer (it is written last) and left alone.

``make_tiny_vlm(dir)`` writes a vision-language model the same way: a tiny random
Idefics3 (these Llama weights as its text model, a one-layer vision tower) with its
processor and this tokenizer plus the image tokens, for real-engine image tests.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 1024, 256, 512, 2, 4, 2
INIT_STD = 0.02
# Model shapes by name: (hidden, intermediate, layers, heads, kv_heads); the vocabulary is
# the tokenizer's. "tiny" (the default, 1.7M parameters) is the tests' model; "small"
# (13.6M parameters) makes prefill dominate a request's time on CPU, for benchmarks
# (benchmarks/bench_gateway.py). Each size needs its own directory.
SIZES = {"tiny": (HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS), "small": (512, 1536, 4, 8, 4)}


def _bf16_bytes(x: np.ndarray) -> bytes:
    """float32 -> bfloat16 (round to nearest even), little-endian bytes."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return rounded.astype("<u2").tobytes()


def _tensors(seed: int, size: str = "tiny") -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = SIZES[size]  # noqa: N806 (shadows the defaults)
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


def make_tiny_lora(path: str | Path, model: str | Path, seed: int, rank: int = 8) -> Path:
    """A LoRA adapter of the model in ``model`` (made by :func:`make_tiny_model`), in
    PEFT's layout (``adapter_config.json``, ``adapter_model.safetensors``): ``rank`` on
    ``q_proj`` / ``v_proj``, random weights normal(0, 0.02), bf16. For ``vllm serve
    --enable-lora --lora-modules NAME=PATH``. Deterministic for a seed; an existing
    adapter in ``path`` is left alone."""
    path, model = Path(path), Path(model)
    if (path / "adapter_config.json").is_file():
        return path
    cfg = json.loads((model / "config.json").read_text())
    hidden, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for proj, dim in (("q_proj", hidden), ("v_proj", hidden // heads * kv)):
            pre = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{pre}.lora_A.weight"] = rng.normal(0.0, INIT_STD, (rank, hidden)).astype(np.float32)
            tensors[f"{pre}.lora_B.weight"] = rng.normal(0.0, INIT_STD, (dim, rank)).astype(np.float32)
    path.mkdir(parents=True, exist_ok=True)
    _write_safetensors(path / "adapter_model.safetensors", tensors)
    (path / "adapter_config.json").write_text(json.dumps({  # written last: the adapter is whole
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "lora_dropout": 0.0, "bias": "none", "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": str(model)}))
    return path


def make_tiny_model(path: str | Path, seed: int = 0, tokenizer: bool = False, size: str = "tiny") -> Path:
    """The model in ``path`` (made if missing); ``tokenizer``: with its tokenizer too;
    ``size``: a key of :data:`SIZES` (an existing model in ``path`` is kept whatever its size)."""
    from transformers import LlamaConfig

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; known: {', '.join(SIZES)}")
    hidden, intermediate, layers, heads, kv_heads = SIZES[size]
    path = Path(path)
    if tokenizer:
        make_tiny_tokenizer(path)
    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    _write_safetensors(path / "model.safetensors", _tensors(seed, size))
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
        initializer_range=INIT_STD, tie_word_embeddings=False,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(path)  # config.json last: its presence marks a finished model
    return path


SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]  # ids 0..4, Llama's first three
# ChatML-like: BOS, each turn between <|im_start|>ROLE and <|im_end|>, the generation prompt;
# list contents give their text parts; an unknown role is refused.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is not none %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_TEXT = """\
The cache holds key and value tensors for every token the model has already seen.
When two requests share a prefix, the engine can reuse those blocks instead of
recomputing them. A router that knows where each prefix lives sends a conversation
back to the engine that still holds it: the answer starts sooner and costs less.
You are a helpful assistant. Hello! How are you today? Tell me a story about a cat.
def add(a, b):
    return a + b  # 0 1 2 3 4 5 6 7 8 9 10 100 1000
"""
_SYLLABLES = ["ka", "ve", "ti", "lo", "ru", "sen", "dor", "mi", "pa", "qua",
              "zel", "no", "bri", "fu", "gat", "he", "jo", "lix", "mur", "ost"]


def _corpus() -> list[str]:
    """The fixed training text: prose, then made-up words and numbers enough for
    :data:`VOCAB` ids."""
    words = [a + b for a in _SYLLABLES for b in _SYLLABLES]
    lines = [" ".join(words[i:i + 20]) + ".\n" for i in range(0, len(words), 20)]
    return [_TEXT, *lines, " ".join(str(n) for n in range(0, 1000, 7))] * 4


def make_tiny_tokenizer(path: str | Path, extra_specials: tuple[str, ...] = (),
                        chat_template: str = CHAT_TEMPLATE) -> Path:
    """Write the tiny model's tokenizer into ``path`` (see the module docstring);
    ``extra_specials``: more special tokens, after the five (still :data:`VOCAB` ids)."""
    import shutil
    import tempfile

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    if (path / "tokenizer_config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [*SPECIALS, *extra_specials]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if tok.get_vocab_size() != VOCAB:
        raise RuntimeError(f"tiny tokenizer has {tok.get_vocab_size()} ids, not {VOCAB}")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", SPECIALS.index("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", additional_special_tokens=specials[3:])
    with tempfile.TemporaryDirectory(dir=path) as tmp:
        fast.save_pretrained(tmp)
        (Path(tmp) / "chat_template.jinja").unlink(missing_ok=True)  # the template goes in the config
        config_path = Path(tmp) / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["chat_template"] = chat_template
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for f in sorted(Path(tmp).iterdir(), key=lambda f: f.name == "tokenizer_config.json"):
            shutil.move(str(f), path / f.name)  # tokenizer_config.json last: it marks a finished one
    return path


# The tiny vision-language model: Idefics3 (SmolVLM's architecture). Its image processor
# has a PIL backend, so vLLM 0.32 serves it without torchvision, which its LLaVA-style and
# Qwen2-VL models need at start. One 32x32 tile per image (no splitting), 8x8 patches,
# pixel shuffle by 2: an image is 4 <image> tokens, 7 with its markers.
VLM_SPECIALS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
                *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)))
VLM_TEMPLATE = CHAT_TEMPLATE.replace(  # an image part is its <image> token, where it sits
    "{{ part['text'] }}{% endif %}", "{{ part['text'] }}{% elif part['type'] in ['image', 'image_url'] %}"
    "<image>{% endif %}")
VISION, IMAGE_SIZE, PATCH, SCALE = (64, 128, 1), 32, 8, 2  # (hidden, intermediate, layers), pixels


def _vision_tensors(seed: int) -> dict[str, np.ndarray]:
    """The vision tower (SigLIP-like) and the connector, initialised as :func:`_tensors`."""
    rng = np.random.default_rng(seed)
    hid, inter, layers = VISION
    ones, zeros = (lambda n: np.ones(n, np.float32)), (lambda n: np.zeros(n, np.float32))

    def normal(*shape: int) -> np.ndarray:
        return rng.normal(0.0, INIT_STD, size=shape).astype(np.float32)

    v = "model.vision_model."
    out = {v + "embeddings.patch_embedding.weight": normal(hid, 3, PATCH, PATCH),
           v + "embeddings.patch_embedding.bias": zeros(hid),
           v + "embeddings.position_embedding.weight": normal((IMAGE_SIZE // PATCH) ** 2, hid)}
    for i in range(layers):
        p = f"{v}encoder.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            out[f"{p}self_attn.{name}.weight"], out[f"{p}self_attn.{name}.bias"] = normal(hid, hid), zeros(hid)
        out[p + "mlp.fc1.weight"], out[p + "mlp.fc1.bias"] = normal(inter, hid), zeros(inter)
        out[p + "mlp.fc2.weight"], out[p + "mlp.fc2.bias"] = normal(hid, inter), zeros(hid)
        for norm in ("layer_norm1", "layer_norm2"):
            out[f"{p}{norm}.weight"], out[f"{p}{norm}.bias"] = ones(hid), zeros(hid)
    out[v + "post_layernorm.weight"], out[v + "post_layernorm.bias"] = ones(hid), zeros(hid)
    out["model.connector.modality_projection.proj.weight"] = normal(HIDDEN, hid * SCALE ** 2)
    return out


def make_tiny_vlm(path: str | Path, seed: int = 0) -> Path:
    """A tiny random Idefics3 model in ``path`` (made if missing), for ``vllm serve``:
    the tiny Llama (:func:`make_tiny_model`'s weights for ``seed``) as its text model, a
    one-layer vision tower, and its processor (``processor_config.json``: Idefics3's
    image processor, no image splitting) with the tiny tokenizer trained with
    :data:`VLM_SPECIALS` and :data:`VLM_TEMPLATE`. No torch: weights by numpy, as
    :func:`make_tiny_model`. Deterministic; ``config.json`` (written last) marks it done."""
    import tempfile

    from transformers import Idefics3Config, Idefics3Processor, Idefics3VisionConfig, LlamaConfig
    from transformers import PreTrainedTokenizerFast
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    path = Path(path)
    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path) as tmp:
        tok = PreTrainedTokenizerFast.from_pretrained(make_tiny_tokenizer(tmp, VLM_SPECIALS, VLM_TEMPLATE))
    edge = {"longest_edge": IMAGE_SIZE}
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size=edge, max_image_size=edge)
    Idefics3Processor(images, tok, image_seq_len=(IMAGE_SIZE // PATCH) ** 2 // SCALE ** 2,
                      chat_template=VLM_TEMPLATE).save_pretrained(path)
    text = {("model.text_model." + k[len("model."):] if k.startswith("model.") else k): t
            for k, t in _tensors(seed).items()}
    _write_safetensors(path / "model.safetensors", {**text, **_vision_tensors(seed + 1)})
    cfg = Idefics3Config(
        text_config=LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                max_position_embeddings=4096, initializer_range=INIT_STD,
                                tie_word_embeddings=False).to_dict(),
        vision_config=Idefics3VisionConfig(hidden_size=VISION[0], intermediate_size=VISION[1],
                                           num_hidden_layers=VISION[2], num_attention_heads=2,
                                           image_size=IMAGE_SIZE, patch_size=PATCH).to_dict(),
        scale_factor=SCALE, image_token_id=tok.convert_tokens_to_ids("<image>"), pad_token_id=0,
        tie_word_embeddings=False)
    cfg.architectures = ["Idefics3ForConditionalGeneration"]
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(path)  # config.json last: its presence marks a finished model
    return path


if __name__ == "__main__":
    import sys

    size = next((a.split("=", 1)[1] for a in sys.argv[2:] if a.startswith("--size=")), "tiny")
    print(make_tiny_model(sys.argv[1], tokenizer="--tokenizer" in sys.argv[2:], size=size))
