"""The architecture matrix: a tiny random model of every decoder-only causal LM the pinned transformers ships, and
the five checks a user relies on, each a property that can fail (``tests/test_architectures.py`` runs them;
``scripts/architectures.py`` writes the committed results and the Supported models page).

The list is enumerated from transformers' own causal-LM mapping, not written by hand, so an upgrade shows what is
new. A type is out of scope when it is not a decoder-only text LM (an encoder-decoder, an encoder used as a
decoder, a multimodal wrapper whose text model is listed on its own); every other type is built tiny (hidden 64,
2 layers, 4 heads / 2 KV heads, vocab 96) with its config class's other defaults, plus the few fields some need
(:data:`FIELDS`).

The checks (each returns None when it holds, else what failed):

- ``wrap``: ``BituneModel.wrap(base, BituneConfig(variant="bitune", method="lora", rank=4))`` succeeds, or refuses
  with one line (a refusal is a status of its own, not a failure);
- ``train``: a batch of two left-padded prompts with right-padded answers gives a finite loss, and backward reaches
  every tensor of both adapter sets and every theta;
- ``correct``: at share 0 each row's answer logits equal a plain causal forward; every path (fused, batched,
  sequential) equals :func:`bitune.reference.reference_logits`; the bidirectional pass sees a later token in every
  layer and the causal one does not; a padded row equals the row alone; the ``lora`` variant equals plain PEFT;
- ``generate``: greedy generation equals the argmax of teacher forcing; at share 0 it equals the causal model's
  greedy tokens; the ``pretrained`` variant equals the untouched base model;
- ``merge``: ``merge()`` keeps logits within 1e-4 and greedy tokens identical.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import traceback
import warnings
from dataclasses import dataclass, field

import torch
import transformers
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, DynamicCache
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from bitune import BituneConfig, BituneModel
from bitune.cache import layer_kv
from bitune.reference import reference_logits

VOCAB = 96
PAD = 0
CHECKS = ("wrap", "train", "correct", "generate", "merge", "states")
ATOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
"""Agreement between paths of one model: float32 rounding, or bfloat16's (mixing itself runs in float32)."""
MERGE_ATOL = {torch.float32: 1e-4, torch.bfloat16: 6e-2}

TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
            # the same sizes under other names
            n_embd=64, n_layer=2, n_head=4, n_positions=128, d_model=64, ffn_dim=128, num_layers=2, n_layers=2,
            num_heads=4, n_heads=4, d_ff=128, n_inner=128, head_dim=16, kv_channels=16,
            # mixtures of experts: few and small
            num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2,
            moe_k=2, moe_topk=2, top_k=2, moe_intermediate_size=32, expert_intermediate_size=32,
            shared_expert_intermediate_size=32, n_shared_experts=1, num_shared_experts=1, n_group=1, topk_group=1,
            first_k_dense_replace=1, moe_layer_freq=1, decoder_sparse_step=1,
            # multi-head latent attention and sliding windows
            q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
            qk_head_dim=16, sliding_window=64, attention_window_size=64, rotary_dim=8,
            # linear-attention and SSM layers: few and small heads and states
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_num_heads=4, linear_head_dim=16,
            mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, ssm_state_size=16,
            mamba_head_dim=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16)
"""Fields every tiny config takes when its class knows them (names differ between architectures)."""

STATE_TYPES = {"linear_attention", "conv", "mamba", "hybrid", "mlp", "moe", "attention", "m", "*", "-", "E"}
"""Layer types of hybrids, whose tiny pattern keeps every kind twice."""

FIELDS: dict[str, dict] = {
    "lfm2": dict(layer_types=["conv", "full_attention"] * 2, num_hidden_layers=4),  # convolution and attention
    "zaya": dict(num_experts_per_tok=1),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"] * 2, num_hidden_layers=4),
    "bamba": dict(num_hidden_layers=4, attn_layer_indices=[1, 3]),
    "falcon_h1": dict(mamba_d_ssm=128),  # mamba_n_heads x mamba_d_head
    "lfm2_moe": dict(layer_types=["conv", "full_attention"] * 2, num_hidden_layers=4, num_dense_layers=1),
    "jamba": dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1),  # Mamba and attention layers, every kind twice
    "dbrx": dict(attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                 ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2}),
    "gemma3n_text": dict(num_hidden_layers=4, num_kv_shared_layers=2, hidden_size_per_layer_input=16,
                         vocab_size_per_layer_input=VOCAB, laurel_rank=8, altup_num_inputs=2,
                         layer_types=["sliding_attention", "full_attention"] * 2),  # its last layers share K/V
    "longcat_flash": dict(head_dim=8, expert_ffn_hidden_size=32, ffn_hidden_size=128),
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    **dict.fromkeys(("gemma4_text", "gemma4_unified_text"), dict(  # full-attention layers with their own head size
        per_layer_config={"01": {"head_dim": 32}}, hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB,
        num_experts=None)),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=3),  # a window the prompts exceed
    "llama4_text": dict(attention_chunk_size=4),  # chunks the prompts cross (the probe's 4 tokens fit in one)
    "xglm": dict(vocab_size=VOCAB),
    "reformer": dict(axial_pos_shape=[8, 16]),
    "mamba2": dict(num_heads=8, n_groups=1, state_size=16, chunk_size=16),  # heads x head_dim = hidden x expand
    "xlstm": dict(hidden_size=128),  # its layers' q/k width is hidden x 0.5, its cache's that rounded up to 64s
    "dory": dict(layer_types=["sliding_attention", "full_attention"] * 2, num_hidden_layers=4, n_input_layers=1,
                 n_recurrent_layers=2, n_output_layers=1),  # its to_dict lists an mlp block after every layer
    "blt": dict(encoder_hash_byte_group_vocab=64,  # the byte patcher, local encoder and decoder, global model: tiny
                patcher_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4),
                encoder_config=dict(vocab_size=VOCAB, hidden_size=64, hidden_size_global=128, intermediate_size=128,
                                    num_hidden_layers=1, num_attention_heads=4),
                decoder_config=dict(vocab_size=VOCAB, hidden_size=64, hidden_size_global=128, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4),
                global_config=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4)),
    "dots3_note_text": dict(  # its sliding layers' own MLA sizes, the sparse-attention indexer, the shared expert
        swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_q_lora_rank=32, swa_kv_lora_rank=16,
        swa_head_dim=16, swa_qk_nope_head_dim=8, swa_v_head_dim=16, index_n_heads=2, index_head_dim=16,
        shared_experts_intermediate_size=32),
    "qwen4_exp_text": dict(  # its indexed attention needs the indexer (None by default); budget 4 selects in a prompt
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=4, indexer_compress_ratio=2,
        hc_lowrank=16),
}
"""Per-type extra fields a tiny model needs to build (None: leave that field of :data:`TINY` at the class's
default)."""

OUT_OF_SCOPE: dict[str, str] = {
    "bert-generation": "an encoder used as a decoder (the BERT of an encoder-decoder pair)",
    "trocr": "the text decoder of an image-to-text encoder-decoder",
    "reformer": "an encoder used as a decoder with LSH attention (no transformers KV cache)",
    "git": "a vision-language model (image encoder + text decoder)",
    "moshi": "a speech model (audio codes)",
    "phi4_multimodal": "a multimodal model",
    "xlm": "a masked language model (XLM's LM head is not a causal LM)",
    "xlnet": "a permutation language model, not a causal decoder",
    "cpmant": "CPM-Ant keeps no transformers Cache (its own position-bias segments)",
}
"""Types that are not decoder-only text LMs, beyond those the config says are (encoder-decoders, encoders used as
decoders, multimodal wrappers)."""

NO_TINY: dict[str, str] = {
    "blt": "its own forward crashes (with use_cache, the default): AttributeError: 'BltConfig' object has no "
           "attribute 'num_hidden_layers' (BltModel builds DynamicCache(config=BltConfig); the layer counts are in "
           "its sub-configs)",
}
"""Why a type's tiny model, small enough, still does not run a padded forward in the pinned transformers (a bug of
its own): the reason its ``no_tiny`` row gives. The forward still decides; a type listed here that runs is tested."""


@dataclass
class Result:
    """One architecture's row of the matrix."""

    model_type: str
    model_class: str
    attn: str | None = None
    status: str = "pass"
    """``pass`` (every check holds), ``fail`` (some check fails), ``refused`` (wrap refuses it, with ``reason``),
    ``out_of_scope`` (not a decoder-only text LM), ``no_tiny`` (the plain tiny model does not build or run)."""
    checks: dict[str, str | None] = field(default_factory=dict)
    reason: str = ""
    path: str = ""
    """The forward path wrap picked (``fused``, ``batched`` or ``sequential``) and the prefill path."""
    note: str = ""
    """Why wrap switched a fast path off (:attr:`bitune.support.Support.note`)."""


def causal_lm_types() -> dict[str, str]:
    """Every causal-LM model type of the pinned transformers, with its model class name."""
    return dict(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()))


def scope(model_type: str) -> str | None:
    """Why ``model_type`` is out of the matrix's scope, or None if it is a decoder-only text LM."""
    if model_type in OUT_OF_SCOPE:
        return OUT_OF_SCOPE[model_type]
    try:
        config = CONFIG_MAPPING[model_type]()
    except Exception as e:  # noqa: BLE001 - a config class that does not build with its own defaults
        return f"its config does not build with its defaults ({type(e).__name__})"
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model (its causal LM is the decoder half)"
    if hasattr(config, "is_decoder") and hasattr(config, "type_vocab_size"):
        return "an encoder used as a decoder (BERT family: is_decoder, token types)"
    if config.get_text_config() is not config:
        return "a multimodal wrapper (its text model is listed on its own)"
    return None


def tiny_config(model_type: str):
    """The tiny config of ``model_type``: :data:`TINY` where its class has the field, :data:`FIELDS`, and a layer
    pattern that keeps one layer of each kind the default pattern has."""
    default = CONFIG_MAPPING[model_type]()
    def has(name: str) -> bool:
        try:
            return hasattr(default, name)
        except Exception:  # noqa: BLE001 - a per-layer attribute that refuses a global read: it exists
            return True

    fields = {k: v for k, v in TINY.items() if has(k) and not isinstance(getattr(type(default), k, None), property)}
    if has("kv_lora_rank"):  # multi-head latent attention: as many key/value heads as query heads
        fields["num_key_value_heads"] = fields["num_attention_heads"]
        fields.pop("head_dim", None)  # derived from the latent dimensions
    settable = lambda name: not isinstance(getattr(type(default), name, None), property)  # noqa: E731
    types = default.to_dict().get("layer_types")
    if isinstance(types, (list, tuple)) and types and settable("layer_types"):
        kinds = list(dict.fromkeys(types))
        # hybrids: every kind twice, so a recurrent layer reads an attention layer's bidirectional output
        pattern = kinds * 2 if set(kinds) & STATE_TYPES else (kinds * 2)[:max(2, len(kinds))]
        fields["layer_types"] = pattern
        for name in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
            if name in fields:
                fields[name] = len(pattern)
    for name in ("layers_block_type", "block_types"):
        value = default.to_dict().get(name)
        if isinstance(value, (list, tuple)) and value and settable(name):
            kinds = list(dict.fromkeys(value))
            fields[name] = kinds * 2 if set(kinds) & STATE_TYPES else (kinds * 2)[:max(2, len(kinds))]
            for count in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
                if count in fields:
                    fields[count] = len(fields[name])
    fields.update(FIELDS.get(model_type, {}))
    fields = {k: v for k, v in fields.items() if v is not None or k not in TINY}  # None: the class's default
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        return CONFIG_MAPPING[model_type](**fields)


def tiny_model(model_type: str, attn: str = "sdpa", dtype=torch.float32, seed: int = 0):
    """A freshly initialised tiny model of ``model_type``, in eval mode."""
    torch.manual_seed(seed)
    config = tiny_config(model_type)
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype).eval()


def _batch():
    """Two left-padded prompts and right-padded answers (row 0: 4 real prompt tokens of 6; row 1 a shorter answer)."""
    g = torch.Generator().manual_seed(0)
    p = torch.randint(3, VOCAB, (2, 6), generator=g)
    p[0, :2] = PAD
    pm = (torch.arange(6)[None] >= torch.tensor([[2], [0]])).long()
    a = torch.randint(3, VOCAB, (2, 3), generator=g)
    am = torch.tensor([[1, 1, 1], [1, 1, 0]])
    a[1, 2] = PAD
    return p, pm, a, am


def _row(tensors, i):
    p, pm, a, am = tensors
    keep_p, keep_a = pm[i].bool(), am[i].bool()
    return p[i][keep_p][None], pm[i][keep_p][None], a[i][keep_a][None], am[i][keep_a][None]


def _perturb(model: BituneModel, scale: float = 0.05, seed: int = 1) -> BituneModel:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.trainable_parameters().values():
            p.add_((torch.randn(p.shape, generator=g) * scale).to(p.dtype))
    return model


def _close(got: torch.Tensor, want: torch.Tensor, atol: float, what: str) -> str | None:
    """None if ``got`` is within ``atol`` of ``want``, relative to logits of size above 1 (rounding scales)."""
    diff = (got.float() - want.float()).abs().max().item() if got.shape == want.shape else math.inf
    if not diff <= atol * max(1.0, want.float().abs().max().item()):
        return f"{what}: differ by {diff:.2g} (shapes {tuple(got.shape)} vs {tuple(want.shape)})"
    return None


def _same_tokens(got: torch.Tensor, want: torch.Tensor, logits: torch.Tensor, atol: float) -> bool:
    """Greedy tokens ``got`` equal ``want`` (each (A,)) up to the first position where they differ, if there the
    logits that chose ``want`` (A, V) hold a near-tie (top two within ``2 * atol``, relative to their size: the
    rounding of the dtype may pick either; float32's ties are all but impossible). After a legitimate flip the
    continuations differ and are not compared."""
    differ = (got != want).nonzero()
    if not len(differ):
        return True
    j = int(differ[0])
    top = logits[j].float().topk(2).values
    return bool(top[0] - top[1] <= 2 * atol * max(1.0, top[0].abs().item()))


def _causal_logits(model: BituneModel, tensors, i: int) -> torch.Tensor:
    p, _, a, _ = _row(tensors, i)
    ids = torch.cat([p, a], 1)
    return model.weights.call("causal", input_ids=ids).logits[:, p.shape[1] - 1:-1]  # (1, A, V)


def wrapped(model_type: str, attn: str, dtype=torch.float32, variant: str = "bitune", prompt_passes: str = "auto",
            perturb: bool = True) -> BituneModel:
    """The tiny model of ``model_type`` wrapped (adapters and thetas perturbed, so every set does something)."""
    base = tiny_model(model_type, attn, dtype)
    model = BituneModel.wrap(base, BituneConfig(variant=variant, method="lora", rank=4), prompt_passes=prompt_passes)
    return _perturb(model) if perturb and variant != "pretrained" else model


def _reached(params: dict[str, torch.Tensor]) -> set[str]:
    return {k for k, p in params.items() if p.grad is not None and p.grad.abs().sum() > 0}


def check_train(model: BituneModel) -> str | None:
    """Finite loss; backward reaches every tensor of both sets that a plain LoRA forward of the causal set reaches,
    and the thetas of every layer whose keys that forward reads with a gradient (a model whose own forward leaves
    a layer without gradient, such as HRM's cycles run without one, is not Bitune's fault)."""
    tensors = _batch()
    params = model.trainable_parameters()
    model.train()
    p, pm, a, am = tensors
    cache = DynamicCache(config=model.text_config)
    plain = model.weights.call("causal", input_ids=torch.cat([p, a], 1), attention_mask=torch.cat([pm, am], 1),
                               cache=cache, use_cache=True)
    objective = plain.logits.float().logsumexp(-1).mean()
    keys = [getattr(layer, "keys", None) for layer in cache.layers]  # None: a layer without attention
    keys = [k if isinstance(k, torch.Tensor) else torch.zeros(0) for k in keys]
    graphed = [k for k in keys if k.requires_grad]
    grads = dict(zip(map(id, graphed), torch.autograd.grad(objective, graphed, retain_graph=True, allow_unused=True)))
    used = torch.tensor([grads.get(id(k)) is not None and bool(grads[id(k)].abs().sum() > 0)
                         for k in keys])  # (L,) layers whose keys the model reads with a gradient
    objective.backward()
    plain_reach = {k.split(":", 1)[1].replace(".causal.", ".{}.") for k in _reached(params) if k.startswith("causal:")}
    model.zero_grad(set_to_none=True)
    out = model(*tensors)
    model.eval()
    if not torch.isfinite(out.loss):
        return f"loss {out.loss.item()}"
    out.loss.backward()
    reached = _reached(params)
    if not any(k.startswith("bidir:") for k in params):
        return "no bidirectional adapter is trainable"
    expected = {k for k in params if not k.startswith("mixer:")
                and k.split(":", 1)[1].replace(f".{k.split(':')[0]}.", ".{}.") in plain_reach}
    missing = sorted(expected - reached)
    if missing:
        return f"no gradient reaches {len(missing)} of {len(expected)} adapter tensors (e.g. {missing[:2]})"
    thetas = [model.mixer.theta_k, model.mixer.theta_v]
    grads = torch.stack([p.grad if p.grad is not None else torch.zeros_like(p) for p in thetas])[:, used]
    if not (grads != 0).all():
        return f"{int((grads == 0).sum())} thetas get a zero gradient"
    with torch.no_grad():  # the states the two passes leave (equal where no adapter and no attention tells them apart)
        causal, bidir = model.prompt_caches(tensors[0][:, :-1], tensors[1][:, :-1])
    for i, kind in enumerate(model.layer_kinds.kinds):  # the state coefficients of every layer whose states differ
        for name, c in kind.mix:
            theta = getattr(model.mixer, f"theta_{c}")
            differ = any(not torch.equal(a, b) for a, b in zip(getattr(causal.layers[i], name, {}).values(),
                                                                  getattr(bidir.layers[i], name, {}).values())
                         if a is not None) if c in "sc" else False
            if differ and (theta.grad is None or theta.grad[i] == 0):
                return f"theta_{c} of layer {i} ({kind.name}) gets no gradient"
    return None


def _zero_shares(model: BituneModel) -> None:
    """Every mixing coefficient at share 0: the causal pass's keys, values and states."""
    for theta in model.mixer.parameters():
        theta.zero_()


@torch.no_grad()
def check_correct(model_type: str, attn: str, dtype) -> str | None:
    atol = ATOL[dtype]
    tensors = _batch()
    model = wrapped(model_type, attn, dtype)
    ref = reference_logits(model, *tensors)
    got = {}
    for passes in ("fused", "batched", "sequential"):
        model.prompt_passes = passes
        got[passes] = model(*tensors).logits
    model.prompt_passes = "auto"
    A = tensors[3]
    for name, logits in got.items():
        for i in range(2):
            n = int(A[i].sum())
            if err := _close(logits[i, :n], ref[i, :n], atol, f"{name} path vs the reference, row {i}"):
                return err
    for i in range(2):  # a padded row equals the row alone
        single = _row(tensors, i)
        n = single[2].shape[1]
        if err := _close(got["fused"][i, :n], model(*single).logits[0], atol, f"padded row {i} vs the row alone"):
            return err
    # the bidirectional pass sees a later token in every layer, the causal one does not (a later token of the first
    # position's chunk, in a model with chunked layers)
    p = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(3))
    changed = p.clone()
    at = min(p.shape[1], getattr(model.text_config, "attention_chunk_size", None) or p.shape[1]) - 1
    changed[0, at] = (changed[0, at] + 1 - 3) % (VOCAB - 3) + 3
    mask = torch.ones_like(p)
    for prompt_passes in ("sequential", "batched"):
        model.prompt_passes = prompt_passes
        before, after = model.prompt_caches(p, mask), model.prompt_caches(changed, mask)
        attention = [i for i, k in enumerate(model.layer_kinds.kinds) if "keys" in k.sequence]
        for layer in attention:  # a recurrent layer is causal by construction, checked through the attention above
            (kc, _), (kb, _) = (layer_kv(c, layer) for c in before)
            (kc2, _), (kb2, _) = (layer_kv(c, layer) for c in after)
            if (kc[..., 0, :] - kc2[..., 0, :]).abs().max() > atol:
                return f"{prompt_passes}: the causal pass's first key in layer {layer} changes with a later token"
            if layer > attention[0] and not (kb[..., 0, :] - kb2[..., 0, :]).abs().max() > 1e-6:
                return f"{prompt_passes}: the bidirectional pass's first key in layer {layer} ignores a later token"
    model.prompt_passes = "auto"
    # share 0: each row's answer logits equal a plain causal forward
    _zero_shares(model)
    logits = model(*tensors).logits
    for i in range(2):
        n = int(A[i].sum())
        if err := _close(logits[i, :n], _causal_logits(model, tensors, i)[0], atol, f"share 0 vs causal, row {i}"):
            return err
    # the lora variant equals plain PEFT's forward
    lora = wrapped(model_type, attn, dtype, variant="lora")
    logits = lora(*tensors).logits
    for i in range(2):
        n = int(A[i].sum())
        want = _causal_logits(lora, tensors, i)[0]
        if err := _close(logits[i, :n], want, atol, f"lora variant vs plain PEFT, row {i}"):
            return err
    return None


@torch.no_grad()
def check_generate(model_type: str, attn: str, dtype) -> str | None:
    p, pm, _, _ = _batch()
    model = wrapped(model_type, attn, dtype)
    kw = dict(max_new_tokens=5, eos_token_id=None, pad_token_id=PAD)
    atol = ATOL[dtype]
    gen = model.generate(p, pm, **kw)
    forced = model(p, pm, gen, torch.ones_like(gen)).logits  # (2, A, V)
    for i in range(2):  # position by position: teacher forcing reads the generated tokens
        for j in range(gen.shape[1]):
            if not _same_tokens(forced[i, j:j + 1].argmax(-1), gen[i, j:j + 1], forced[i, j:j + 1], atol):
                return "greedy generation differs from the argmax of teacher forcing"
    _zero_shares(model)
    gen = model.generate(p, pm, **kw)
    for i in range(2):
        single = _row((p, pm, p, pm), i)[0]
        causal = model.weights.model.generate(input_ids=single, attention_mask=torch.ones_like(single),
                                              do_sample=False, **kw)[:, single.shape[1]:]
        logits = model(p[i:i + 1], pm[i:i + 1], causal, torch.ones_like(causal)).logits[0]
        if not _same_tokens(gen[i], causal[0], logits, atol):
            return f"share 0: greedy tokens differ from the causal model's (row {i})"
    base = tiny_model(model_type, attn, dtype)
    pretrained = BituneModel.wrap(tiny_model(model_type, attn, dtype), BituneConfig(variant="pretrained"))
    gen = pretrained.generate(p, pm, **kw)
    for i in range(2):
        single = _row((p, pm, p, pm), i)[0]
        plain = base.generate(input_ids=single, attention_mask=torch.ones_like(single), do_sample=False,
                              **kw)[:, single.shape[1]:]
        logits = pretrained(p[i:i + 1], pm[i:i + 1], plain, torch.ones_like(plain)).logits[0]
        if not _same_tokens(gen[i], plain[0], logits, atol):
            return f"the pretrained variant's greedy tokens differ from the base model's (row {i})"
    return None


def check_states(model_type: str, attn: str, dtype) -> str | None:
    """For a model whose layers keep per-row states (recurrent, conv): at share 0 the mixed cache holds the causal
    pass's states exactly and the answer equals the causal model's; a left-padded row equals the same prompt alone
    on every prompt path; every state coefficient gets a gradient. Nothing to check for attention-only models."""
    model = wrapped(model_type, attn, dtype)
    if not model.layer_kinds.stateful:
        return None
    tensors, atol = _batch(), ATOL[dtype]
    with torch.no_grad():
        for passes in ("batched", "sequential"):
            model.prompt_passes = passes
            logits = model(*tensors).logits
            for i in range(2):
                single = _row(tensors, i)
                n = single[2].shape[1]
                if err := _close(logits[i, :n], model(*single).logits[0], atol, f"{passes}: padded row {i} vs alone"):
                    return err
        model.prompt_passes = "auto"
        _zero_shares(model)
        p, pm = tensors[0][:, :-1], tensors[1][:, :-1]
        causal = model.prompt_caches(p, pm)[0]
        mixed = model.prefill(*tensors[:2]).cache
        for i in range(model.num_layers):
            for a, b in zip(mixed_tensors(mixed, i), mixed_tensors(causal, i)):
                if not torch.equal(a, b):
                    return f"share 0: layer {i}'s mixed state is not the causal pass's"
    _perturb(model)
    return check_train(model)


def mixed_tensors(cache, layer: int) -> list[torch.Tensor]:
    from bitune.cache import layer_tensors
    return layer_tensors(cache, layer)


@torch.no_grad()
def check_merge(model_type: str, attn: str, dtype, notes: list[str] | None = None) -> str | None:
    tensors = _batch()
    plain, merged = wrapped(model_type, attn, dtype), wrapped(model_type, attn, dtype)
    merged.merge()
    if not merged.merged and merged.support.merge:
        return "merge() left the model unmerged without a reason"
    if not merged.merged and notes is not None:
        notes.append(merged.support.note)
    a, b = (m.answer_logits(m.prefill(*tensors[:2]), *tensors[2:]) for m in (plain, merged))
    A = tensors[3]
    for i in range(2):
        n = int(A[i].sum())
        if err := _close(b[i, :n], a[i, :n], MERGE_ATOL[dtype], f"merged vs unmerged logits, row {i}"):
            return err
    kw = dict(max_new_tokens=5, eos_token_id=None, pad_token_id=PAD)
    want, got = plain.generate(*tensors[:2], **kw), merged.generate(*tensors[:2], **kw)
    logits = plain(*tensors[:2], want, torch.ones_like(want)).logits
    for i in range(2):
        if not _same_tokens(got[i], want[i], logits[i], MERGE_ATOL[dtype] if dtype != torch.float32 else 0.0):
            return "merged greedy tokens differ"
    return None


def _one_line(e: BaseException) -> str:
    from bitune.support import INSTEAD

    text = f"{type(e).__name__}: {e}".splitlines()[0]  # whole: the page shows the reason as it is
    return text.replace(f" {INSTEAD}", "")  # what every refusal adds (the page says it once)


MAX_PARAMETERS = 20_000_000
"""A tiny model holds fewer parameters than this; one that keeps more is not tested (it would cost minutes)."""


def parameters_of(model_type: str) -> int:
    """The parameter count of ``model_type``'s tiny model, counted on the meta device (nothing allocated); 0 when
    it does not build there (the real build then decides)."""
    try:
        with torch.device("meta"), warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_config(tiny_config(model_type))
        return sum(p.numel() for p in model.parameters())
    except Exception:  # noqa: BLE001 - not on the meta device: unknown
        return 0


def attn_for(model_type: str) -> str | None:
    """sdpa where transformers allows it for ``model_type``, else eager; None if the tiny model does not build or
    run a forward."""
    for attn in ("sdpa", "eager"):
        try:
            model = tiny_model(model_type, attn)
            ids, mask = torch.tensor([[0, 4, 5], [3, 4, 5]]), torch.tensor([[0, 1, 1], [1, 1, 1]])
            model(input_ids=ids, attention_mask=mask)  # a padded batch, as any fine-tuning user runs
            return attn
        except Exception:  # noqa: BLE001, S112 - the next implementation, or none
            continue
    return None


def run(model_type: str, dtype=torch.float32, attn: str | None = None, verbose: bool = False) -> Result:
    """The matrix's row for ``model_type``."""
    result = Result(model_type, causal_lm_types().get(model_type, "?"))
    if (why := scope(model_type)) is not None:
        result.status, result.reason = "out_of_scope", why
        return result
    size = parameters_of(model_type)
    if size > MAX_PARAMETERS:
        result.status = "no_tiny"
        result.reason = (f"its tiny config still holds {size / 1e6:.0f}M parameters (sizes it does not take from the "
                         "common fields)")
        return result
    attn = attn or attn_for(model_type)
    if attn is None:
        result.status = "no_tiny"
        result.reason = NO_TINY.get(model_type, "the plain tiny model does not build or run a forward")
        return result
    result.attn = attn
    try:
        model = wrapped(model_type, attn, dtype)
    except (ValueError, TypeError) as e:
        result.status, result.reason = "refused", _one_line(e)
        result.checks = {"wrap": None}
        return result
    except Exception as e:  # noqa: BLE001
        result.status, result.reason = "fail", _one_line(e)
        result.checks = {"wrap": _one_line(e)}
        return result
    result.path = f"{model.forward_path()} / {model.prefill_path()}"
    result.note = model.support.note
    notes = [result.note] if result.note else []
    result.checks["wrap"] = None
    steps = {"train": lambda: check_train(model), "correct": lambda: check_correct(model_type, attn, dtype),
             "generate": lambda: check_generate(model_type, attn, dtype),
             "merge": lambda: check_merge(model_type, attn, dtype, notes),
             "states": lambda: check_states(model_type, attn, dtype)}
    for name, check in steps.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result.checks[name] = check()
        except Exception as e:  # noqa: BLE001 - a crash is a failed check
            if verbose:
                traceback.print_exc()
            result.checks[name] = _one_line(e)
    result.note = "; ".join(notes)
    if any(v is not None for v in result.checks.values()):
        result.status = "fail"
    return result


__all__ = ["CHECKS", "Result", "attn_for", "causal_lm_types", "check_correct", "check_generate", "check_merge",
           "check_states", "check_train", "run", "scope", "tiny_config", "tiny_model", "transformers", "copy"]
