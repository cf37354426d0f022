"""Tiny random models built in-process, one per supported architecture family, and tiny batches for them."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig, PhiConfig, Qwen2Config

from bitune import BituneConfig, BituneModel

VOCAB = 64
PAD, EOS, BOS = 0, 1, 2
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS,
              max_position_embeddings=128)
"""The config fields every tiny family shares."""

CONFIGS = {
    "llama": lambda: LlamaConfig(num_key_value_heads=2, **COMMON),
    "gemma3": lambda: Gemma3TextConfig(num_key_value_heads=2, head_dim=8, sliding_window=4,
                                       layer_types=["sliding_attention", "full_attention"], **COMMON),
    "qwen2": lambda: Qwen2Config(num_key_value_heads=2, **COMMON),
    "mistral": lambda: MistralConfig(num_key_value_heads=2, sliding_window=64, **COMMON),
    "phi": lambda: PhiConfig(**COMMON),
}


def tiny_model(arch: str = "llama", seed: int = 0, dtype=torch.float32, attn: str = "sdpa"):
    """A freshly initialised tiny causal LM of the given family."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[arch](), attn_implementation=attn, dtype=dtype)
    return model.eval()


def tiny_bitune(arch: str = "llama", config: BituneConfig | None = None, *, seed: int = 0, dtype=torch.float32,
                attn: str = "sdpa", prompt_passes: str = "auto", **config_fields) -> BituneModel:
    """``BituneModel.wrap`` of :func:`tiny_model` with ``config`` or ``BituneConfig(**config_fields)`` (not both;
    neither: the default config). The adapters are as initialised: see :func:`perturb_adapters`."""
    if config is not None and config_fields:
        raise TypeError("tiny_bitune: pass a BituneConfig or its fields, not both")
    model = tiny_model(arch, seed=seed, dtype=dtype, attn=attn)
    return BituneModel.wrap(model, config if config is not None else BituneConfig(**config_fields),
                            prompt_passes=prompt_passes)


def batch(seed: int = 0, prompt_lens=(6, 4, 5), answer_lens=(3, 4, 1)):
    """A left-padded prompt batch and a right-padded answer batch of mixed lengths."""
    g = torch.Generator().manual_seed(seed)
    B, P, A = len(prompt_lens), max(prompt_lens), max(answer_lens)
    prompt_ids = torch.full((B, P), PAD)
    prompt_mask = torch.zeros(B, P, dtype=torch.long)
    answer_ids = torch.full((B, A), PAD)
    answer_mask = torch.zeros(B, A, dtype=torch.long)
    for i, (p, a) in enumerate(zip(prompt_lens, answer_lens)):
        prompt_ids[i, P - p:] = torch.randint(3, VOCAB, (p,), generator=g)
        prompt_mask[i, P - p:] = 1
        answer_ids[i, :a] = torch.randint(3, VOCAB, (a,), generator=g)
        answer_ids[i, a - 1] = EOS
        answer_mask[i, :a] = 1
    return prompt_ids, prompt_mask, answer_ids, answer_mask


def row(tensors, i: int):
    """Example i alone, padding stripped."""
    p_ids, p_mask, a_ids, a_mask = tensors
    pm, am = p_mask[i].bool(), a_mask[i].bool()
    return p_ids[i][pm][None], p_mask[i][pm][None], a_ids[i][am][None], a_mask[i][am][None]


def perturb_adapters(model, scale: float = 0.05, seed: int = 1):
    """Give every trainable weight a random offset, so zero-initialised LoRA B matrices do something."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.trainable_parameters().values():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model
