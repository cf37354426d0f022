"""Bitune (paper section 2): read the prompt twice, mix the two KV caches, answer causally on top.

Read :mod:`bitune.reference` first: the method in ~40 lines of plain Hugging Face forwards. This module computes
the same numbers (tests hold every path to the reference) with the prompt passes cut short after the last
layer's keys/values, both passes batched as one forward, or everything fused into one forward.

For a batch of left-padded prompts x_1..x_P and right-padded answers y_1..y_A:

1. prompt passes over x_1..x_{P-1}: pass A causal with the causal weights, pass B bidirectional with the bidir
   weights (eq. 1-5; the ablations change masks or weights, see ``BituneConfig.passes``);
2. per layer, K = K_c (1 - a_k) + K_b a_k and V likewise (eq. 6-7, :mod:`bitune.mixer`);
3. answer pass over x_P, y_1..y_{A-1}, causal, causal weights, on the mixed cache, positions continuing from
   the prompt; the loss is the cross-entropy of y_1..y_A (eos included), padding excluded.

Masks live in :mod:`bitune.masks`, caches in :mod:`bitune.cache`, weight sets in :mod:`bitune.adapters`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from . import attention
from . import cache as kv
from .adapters import WeightSets
from .config import PROMPT_PASSES, BituneConfig
from .files import apply_umask, replace_dir
from .masks import concat_masks, fused_mask, pass_mask, position_ids
from .mixer import Mixer

CONFIG_FILE = "bitune_config.json"
MIXER_FILE = "mixer.safetensors"
BIDIR_FULL_FILE = "model.safetensors"


@dataclass
class BituneOutput:
    """Result of a forward.

    Attributes:
        loss: the training loss (scalar): the mean over examples of each example's mean answer-token
            cross-entropy (``example_loss.mean()``; every example weighs the same, as in the paper's batch-1
            setup). This is what ``bitune train`` optimises.
        logits: (B, A, V) ``logits[:, t]`` predicts ``answer_ids[:, t]``.
        token_logprobs: (B, A) log-probability of each answer token (0 on padding).
        example_loss: (B,) mean cross-entropy per example.
    """

    loss: torch.Tensor
    logits: torch.Tensor
    token_logprobs: torch.Tensor
    example_loss: torch.Tensor


@dataclass
class Prefill:
    """A prompt read by the prompt passes, ready for an answer pass (or the state of a conversation).

    Attributes:
        cache: KV cache of the tokens read so far, mixed where the variant mixes.
        ids: (B, T) the token ids in the cache.
        mask: (B, T) attention mask of the cached tokens.
        last_token: (B, 1) the token that opens the next answer pass (not yet in the cache).
    """

    cache: object
    ids: torch.Tensor
    mask: torch.Tensor
    last_token: torch.Tensor

    def select(self, index: torch.Tensor) -> "Prefill":
        """Rows ``index`` of this prefill, as an independent copy (the original can be reused)."""
        return Prefill(kv.select_rows(self.cache, index), self.ids[index], self.mask[index], self.last_token[index])


class BituneModel(nn.Module):
    """A pretrained causal LM turned into a Bitune model. Build with :meth:`wrap` or :meth:`from_pretrained`."""

    def __init__(self, model: nn.Module, config: BituneConfig, prompt_passes: str = "auto"):
        super().__init__()
        _check_architecture(model)
        self.config = config
        self.prompt_passes = prompt_passes
        self.weights = WeightSets(model, config)
        self.text_config = model.config.get_text_config()
        self.num_layers = self.text_config.num_hidden_layers
        self.mixer = Mixer(self.num_layers, config.theta_init) if config.mixes else None
        self._probe()

    @classmethod
    def wrap(cls, model: nn.Module, config: BituneConfig | None = None, prompt_passes: str = "auto") -> "BituneModel":
        """Wrap a transformers causal LM (e.g. from ``AutoModelForCausalLM``); the default config is Bitune + LoRA r8.

        Args:
            prompt_passes: how the passes run, one of ``PROMPT_PASSES`` (a runtime choice: not saved, and every
                choice computes the same numbers).
        """
        return cls(model, config or BituneConfig(), prompt_passes)

    @property
    def prompt_passes(self) -> str:
        """How the passes run (one of ``PROMPT_PASSES``); may be changed at any time, see :meth:`execution`."""
        return self._prompt_passes

    @prompt_passes.setter
    def prompt_passes(self, value: str) -> None:
        if not isinstance(value, str) or value not in PROMPT_PASSES:
            raise ValueError(f"prompt_passes={value!r} is not one of {list(PROMPT_PASSES)}")
        self._prompt_passes = value

    def execution(self, answer: bool = True) -> str:
        """The path that runs, resolved from :attr:`prompt_passes`, the variant and the method.

        Args:
            answer: True for a forward (prompt passes and answer pass): ``"single"`` (the baselines' one causal
                pass), ``"fused"``, ``"batched"`` or ``"sequential"``; False for reading a prompt alone
                (:meth:`prefill`: generation, evaluation): ``"batched"`` or ``"sequential"``.
        """
        if answer and self.config.single_pass:
            return "single"
        names = [w for w, _ in self.config.passes]
        if answer and self.prompt_passes in ("auto", "fused") and self.weights.can_route_rows(names + ["causal"]):
            return "fused"
        if len(names) == 2 and self.prompt_passes != "sequential" and self.weights.can_route_rows(names):
            return "batched"
        return "sequential"

    # ----------------------------------------------------------------------------------------------- parameters
    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        """Every parameter this variant trains, by name: its weight sets and the mixing thetas."""
        params = {}
        for name in self.config.weight_sets:
            params.update({f"{name}:{k}": p for k, p in self.weights.parameters_of(name).items() if p.requires_grad})
        if self.mixer is not None:
            params.update({f"mixer:{k}": p for k, p in self.mixer.named_parameters()})
        return params

    def mixing_ratios(self) -> dict[str, torch.Tensor]:
        """Per-layer a_k and a_v, each (L,) float32; empty for variants without mixing."""
        return self.mixer.ratios() if self.mixer is not None else {}

    def _probe(self) -> None:
        """One tiny prompt pass that checks the architecture and freezes bidir weights that cannot get a gradient.

        Only the prompt passes' keys and values reach the answer, so in the last layer everything after K/V
        (q, o, MLP) is unused by the bidir weights: they are frozen, found by one backward from the last
        layer's K/V, which works for any architecture.
        """
        weights = "bidir" if "bidir" in self.config.weight_sets else "causal"
        device = next(self.weights.base.parameters()).device
        ids = torch.zeros(1, 2, dtype=torch.long, device=device)
        mask = torch.ones(1, 2, dtype=torch.long, device=device)
        with torch.enable_grad():
            try:
                cache = self._prompt_pass(ids, mask, weights, "bidirectional")
                k, v = kv.layer_kv(cache, self.num_layers - 1)
            except (AttributeError, IndexError, TypeError) as e:
                raise ValueError(f"{type(self.weights.base).__name__}: no per-layer attention KV cache "
                                 f"({e}); Bitune cannot mix its prompt features") from e
            if weights != "bidir":
                return
            params = self.weights.parameters_of("bidir")
            grads = torch.autograd.grad(k.sum() + v.sum(), list(params.values()), allow_unused=True)
        for p, g in zip(params.values(), grads):
            if g is None:
                p.requires_grad_(False)

    # ----------------------------------------------------------------------------------------------- passes
    @property
    def _dtype(self) -> torch.dtype:
        return next(self.weights.base.parameters()).dtype

    def _prompt_pass(self, ids: torch.Tensor, mask: torch.Tensor, weights, kind, past: Prefill | None = None):
        """One forward over prompt tokens; returns its KV cache (per layer (B, n_kv, T_past + T, hs)).

        ``weights`` and ``kind`` are one name each, or one per row group (a batched pass over several groups,
        each of ``B / groups`` rows). With ``past``, the new tokens also see every real token already cached
        (a copy of ``past.cache`` is extended; the original is untouched).
        """
        self._check_no_checkpointing()
        B = ids.shape[0]
        rows = torch.arange(B, device=ids.device) % (past.mask.shape[0] if past is not None else 1)
        cache = kv.extendable_copy(past.cache if past is not None else None, self.text_config, rows,
                                   stop_after_layer=self.num_layers - 1)
        past_mask = past.mask[rows] if past is not None else None
        impl = self.weights.base.config._attn_implementation
        kinds = [kind] if isinstance(kind, str) else kind
        group = B // len(kinds)
        attn = concat_masks([
            pass_mask(mask[g * group:(g + 1) * group], k, self._dtype, self.text_config, impl,
                      past_mask[g * group:(g + 1) * group] if past_mask is not None else None)
            for g, k in enumerate(kinds)])
        offset = past_mask.sum(1) if past_mask is not None else None
        call = self.weights.call if isinstance(weights, str) else self.weights.call_rows
        try:
            call(weights, input_ids=ids, attention_mask=attn, position_ids=position_ids(mask, offset),
                 cache=cache, use_cache=True, logits_to_keep=1)
        except kv.PassComplete:
            pass
        kv.detach_stop(cache)
        return cache

    def _check_ids(self, *ids: torch.Tensor) -> None:
        vocab = self.weights.base.get_input_embeddings().num_embeddings
        for t in ids:
            if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                raise ValueError(f"token ids must be integers, got {t.dtype}")
            if t.numel() and (t.min() < 0 or t.max() >= vocab):
                raise ValueError(f"token ids must be integers in [0, {vocab}) for this model; got ids in "
                                 f"[{t.min().item()}, {t.max().item()}]")

    def _check_no_checkpointing(self) -> None:
        if getattr(self.weights.base, "is_activation_checkpointing", False) and self.training:
            raise ValueError("gradient checkpointing drops the prompt cache in training; disable it for Bitune")

    def prompt_caches(self, ids: torch.Tensor, mask: torch.Tensor, past: Prefill | None = None) -> list:
        """The unmixed caches of this variant's prompt passes over ``ids`` (tokens the passes read)."""
        passes = self.config.passes
        B = ids.shape[0]
        names = [w for w, _ in passes for _ in range(B)]
        if self.execution(answer=False) == "sequential":
            return [self._prompt_pass(ids, mask, weights, kind, past) for weights, kind in passes]
        cache = self._prompt_pass(ids.repeat(2, 1), mask.repeat(2, 1), names, [k for _, k in passes], past)
        return kv.split_rows(cache, [B, B])  # (2B rows) -> pass A rows, pass B rows

    def prefill(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, past: Prefill | None = None) -> Prefill:
        """Read a batch of left-padded prompts: prompt passes over all but the last token, then mixing.

        Args:
            prompt_ids: (B, P) left-padded token ids, every prompt at least 2 tokens.
            prompt_mask: (B, P) 1 for real tokens.
            past: a conversation so far (from ``generate(..., return_state=True)``); the new prompt is read on
                top of it with both passes (the paper's "alternating" multi-turn mode, A.8) after the token
                that ended the previous answer.
        """
        _check_prompt(prompt_ids, prompt_mask)
        self._check_ids(prompt_ids)
        ids, mask = prompt_ids[:, :-1], prompt_mask[:, :-1]  # (B, P-1)
        start = 0
        if past is not None:
            if past.ids.shape[0] != prompt_ids.shape[0]:
                raise ValueError(f"past holds {past.ids.shape[0]} rows, the prompt batch {prompt_ids.shape[0]}")
            window = getattr(self.text_config, "sliding_window", None)
            if window and past.ids.shape[1] + prompt_ids.shape[1] >= window:
                raise ValueError(f"this model has sliding-window layers ({window} tokens); a history this long "
                                 "cannot be extended: re-read it whole (chat mode 'recompute')")
            ids = torch.cat([past.last_token, ids], dim=1)  # (B, P): the previous answer's last token first
            mask = torch.cat([torch.ones_like(past.last_token), mask], dim=1)
            start = past.ids.shape[1]
        caches = self.prompt_caches(ids, mask, past)
        if self.mixer is not None:
            kv.mix_into(caches[0], caches[1], self.mixer, start=start)
        if past is not None:
            ids, mask = torch.cat([past.ids, ids], dim=1), torch.cat([past.mask, mask], dim=1)
        return Prefill(caches[0], ids, mask, prompt_ids[:, -1:])

    def answer_logits(self, prefill: Prefill, answer_ids: torch.Tensor, answer_mask: torch.Tensor,
                      reuse: bool = True) -> torch.Tensor:
        """Causal answer pass on a prefill; returns (B, A, V) logits aligned with ``answer_ids``.

        Args:
            reuse: keep ``prefill`` intact (the pass extends a copy), so it can score more answers.
        """
        cache = kv.select_rows(prefill.cache, torch.arange(answer_ids.shape[0])) if reuse else prefill.cache
        ids = torch.cat([prefill.last_token, answer_ids[:, :-1]], dim=1)  # (B, A)
        step_mask = torch.cat([torch.ones_like(prefill.last_token), answer_mask[:, :-1]], dim=1)  # (B, A)
        full_mask = torch.cat([prefill.mask, step_mask], dim=1)  # (B, P-1+A)
        pos = position_ids(full_mask)[:, -ids.shape[1]:]  # (B, A)
        out = self.weights.call("causal", input_ids=ids, attention_mask=full_mask, position_ids=pos,
                                cache=cache, use_cache=True)
        return out.logits

    def forward(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, answer_ids: torch.Tensor,
                answer_mask: torch.Tensor) -> BituneOutput:
        """Loss and logits of the answers given the prompts.

        Args:
            prompt_ids: (B, P) left-padded prompt ids (at least 2 real tokens each).
            prompt_mask: (B, P) 1 for real prompt tokens.
            answer_ids: (B, A) right-padded answer ids, eos included (at least 1 real token each).
            answer_mask: (B, A) 1 for real answer tokens.
        """
        _check_prompt(prompt_ids, prompt_mask)
        _check_answer(prompt_ids, answer_ids, answer_mask)
        self._check_ids(prompt_ids, answer_ids)
        path = self.execution()
        if path == "single":
            logits = self.causal_logits(prompt_ids, prompt_mask, answer_ids, answer_mask)
        elif path == "fused":
            logits = self.fused_logits(prompt_ids, prompt_mask, answer_ids, answer_mask)
        else:
            logits = self.answer_logits(self.prefill(prompt_ids, prompt_mask), answer_ids, answer_mask, reuse=False)
        return _answer_loss(logits, answer_ids, answer_mask)

    def fused_logits(self, prompt_ids, prompt_mask, answer_ids, answer_mask) -> torch.Tensor:
        """Prompt passes, mixing and answer pass in one forward; (B, A, V) answer logits.

        The model reads ``[pass B | pass A | answer]`` (T, T and A positions, pass A's weights running on into
        the answer's) with one mask (:func:`bitune.masks.fused_mask`) and positions restarting for each pass;
        :class:`bitune.cache.FusedCache` appends each layer's mixed prompt keys/values for the answer to read.
        Computes what ``answer_logits(prefill(...))`` computes, in one forward of 2T + A tokens instead of three
        smaller ones: far fewer, larger matrix products. Attention computes only the blocks the mask allows
        (:mod:`bitune.attention`); the price is the last layer's q/o/MLP on prompt positions, which the
        sequential path skips.
        """
        self._check_no_checkpointing()
        ids, mask = prompt_ids[:, :-1], prompt_mask[:, :-1]  # (B, T)
        step_ids = torch.cat([prompt_ids[:, -1:], answer_ids[:, :-1]], dim=1)  # (B, A)
        step_mask = torch.cat([torch.ones_like(prompt_mask[:, -1:]), answer_mask[:, :-1]], dim=1)  # (B, A)
        T, A = ids.shape[1], step_ids.shape[1]
        passes = self.config.passes[::-1]  # pass B first, so pass A (causal weights) runs on into the answer
        S = len(passes) * T + A
        read = S if self.mixer is not None else 0  # the mixed block the cache appends, or the one pass's keys
        base = self.weights.base
        attn = fused_mask(mask, step_mask, [k for _, k in passes], read, self._dtype, self.text_config,
                          base.config._attn_implementation)
        positions = position_ids(mask)  # (B, T)
        answer_positions = position_ids(torch.cat([mask, step_mask], dim=1))[:, T:]  # (B, A)
        with attention.fused(base, T, len(passes), read):
            out = self.weights.call_segments(
                [(w, T) for w, _ in passes] + [("causal", A)],
                input_ids=torch.cat([ids] * len(passes) + [step_ids], dim=1),  # (B, S)
                attention_mask=attn, position_ids=torch.cat([positions] * len(passes) + [answer_positions], dim=1),
                cache=kv.FusedCache(self.text_config, T, self.mixer), use_cache=True, logits_to_keep=A)
        return out.logits

    def causal_logits(self, prompt_ids, prompt_mask, answer_ids, answer_mask) -> torch.Tensor:
        """One plain causal pass of the causal weights over prompt + answer; (B, A, V) answer logits.

        This is the baselines' forward, and the sound reading of any prompt too short for prompt passes.
        """
        ids = torch.cat([prompt_ids, answer_ids], dim=1)  # (B, P+A)
        mask = torch.cat([prompt_mask, answer_mask], dim=1)  # (B, P+A)
        A = answer_ids.shape[1]
        out = self.weights.call("causal", input_ids=ids, attention_mask=mask, position_ids=position_ids(mask),
                                use_cache=False, logits_to_keep=A + 1)
        return out.logits[:, :-1]  # (B, A, V)

    # ----------------------------------------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int = 128,
                 do_sample: bool = False, tokenizer=None, stop_strings: list[str] | None = None,
                 past: Prefill | None = None, return_state: bool = False, **generate_kwargs):
        """Decode answers from the mixed prompt cache with transformers' ``generate``.

        The prompt passes prefill the cache once; ``generate`` then feeds the prompt's last token and decodes
        token by token with the causal weights, exactly as a plain model does. Greedy by default; sampling
        options (``temperature``, ``top_p``, ``top_k``, ...), ``streamer`` and ``eos_token_id`` are passed on.

        Args:
            prompt_ids: (B, P) left-padded prompts.
            prompt_mask: (B, P) 1 for real tokens.
            max_new_tokens: upper bound on generated tokens.
            tokenizer: needed for ``stop_strings``.
            stop_strings: stop a row once its text ends with one of these.
            past: conversation state to continue (see :meth:`prefill`).
            return_state: also return the conversation state after this answer (answers stay causal in it).

        Returns:
            (B, N) the generated tokens only, padded with the pad token after a row stops; with
            ``return_state``, the pair (tokens, state).
        """
        if stop_strings and tokenizer is None:
            raise ValueError("generate(stop_strings=...) needs tokenizer=")
        pre = self.prefill(prompt_ids, prompt_mask, past)
        if stop_strings:
            generate_kwargs.update(stop_strings=stop_strings, tokenizer=tokenizer)
        if self.weights.peft:
            self.weights._use_adapter("causal")
        input_ids = torch.cat([pre.ids, pre.last_token], dim=1)  # (B, T+1); all but the last are cached
        attention_mask = torch.cat([pre.mask, torch.ones_like(pre.last_token)], dim=1)
        out = self.weights.base.generate(input_ids=input_ids, attention_mask=attention_mask, cache=pre.cache,
                                         max_new_tokens=max_new_tokens, do_sample=do_sample, **generate_kwargs)
        new = out[:, input_ids.shape[1]:]
        if not return_state:
            return new
        state = Prefill(pre.cache, out[:, :-1], torch.cat([attention_mask, torch.ones_like(new[:, :-1])], dim=1),
                        out[:, -1:])
        return new, state

    @torch.no_grad()
    def attention_maps(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Attention of each prompt pass, averaged over layers and heads (paper A.12).

        Returns:
            ``{"<weights>/<mask>": (B, T, T)}`` per pass over the prompt without its last token; row = query.
        """
        _check_prompt(prompt_ids, prompt_mask)
        ids, mask = prompt_ids[:, :-1], prompt_mask[:, :-1]
        base = self.weights.base
        impl = base.config._attn_implementation
        base.set_attn_implementation("eager")
        try:
            maps = {}
            for weights, kind in self.config.passes:
                attn = pass_mask(mask, kind, self._dtype, self.text_config, "eager")
                out = self.weights.call(weights, input_ids=ids, attention_mask=attn, output_attentions=True,
                                        position_ids=position_ids(mask), logits_to_keep=1)
                maps[f"{weights}/{kind}"] = torch.stack(out.attentions).float().mean(dim=(0, 2))  # (B, T, T)
            return maps
        finally:
            base.set_attn_implementation(impl)

    # ----------------------------------------------------------------------------------------------- persistence
    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """Save adapters (PEFT format, one folder per weight set), mixer (safetensors) and config (JSON).

        Written into a temporary folder next to ``directory`` and renamed into place, so an existing
        checkpoint is never left half-overwritten.
        """
        directory = Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
        try:
            (tmp / CONFIG_FILE).write_text(self.config.to_json())
            if self.mixer is not None:
                save_file({k: p.detach().cpu().contiguous() for k, p in self.mixer.state_dict().items()},
                          str(tmp / MIXER_FILE))
            if self.weights.peft:
                self.weights.model.save_pretrained(str(tmp), selected_adapters=list(self.config.weight_sets))
                (tmp / "README.md").unlink(missing_ok=True)  # PEFT's empty model-card template
            elif self.config.method == "full" and self.config.weight_sets:
                self.weights.model.save_pretrained(str(tmp / "causal"), max_shard_size="1000GB")
                if "bidir" in self.config.weight_sets:
                    (tmp / "bidir").mkdir()
                    save_file({k: p.detach().cpu().contiguous() for k, p in self.weights.bidir.items()},
                              str(tmp / "bidir" / BIDIR_FULL_FILE))
            apply_umask(tmp)  # mkdtemp made it 0700 and safetensors writes 0600: others may read a checkpoint
            replace_dir(tmp, directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, base: nn.Module | str | None = None,
                        prompt_passes: str = "auto", **load_kwargs) -> "BituneModel":
        """Load a checkpoint written by :meth:`save_pretrained`.

        Args:
            directory: the checkpoint folder.
            base: the base model instance, or its name/path; default: the ``base_model`` recorded in the config.
            prompt_passes: how the passes run (see :meth:`wrap`).
            load_kwargs: passed to :func:`bitune.hub.load_model` when ``base`` is a name.
        """
        directory = Path(directory)
        config = read_config(directory)
        if base is None or isinstance(base, str):
            from .hub import load_model
            name = base or config.base_model
            if not name:
                raise ValueError(f"{directory}: the checkpoint does not record its base model; pass base=")
            base, _ = load_model(name, **load_kwargs)
        model = cls(base, config, prompt_passes)
        model.load_weights(directory)
        return model

    def load_weights(self, directory: str | os.PathLike) -> None:
        """Load trained weights from a checkpoint folder into this model, strictly (every tensor must match)."""
        directory = Path(directory)
        if self.mixer is not None:
            _load_strict(self.mixer, _read_safetensors(directory / MIXER_FILE), directory / MIXER_FILE)
        for name in self.config.weight_sets:
            params = self.weights.parameters_of(name)
            if self.weights.peft:
                from peft.utils import set_peft_model_state_dict
                path = directory / name / "adapter_model.safetensors"
                state = _read_safetensors(path)
                try:
                    result = set_peft_model_state_dict(self.weights.model, state, adapter_name=name)
                except RuntimeError as e:
                    raise ValueError(f"{path} does not match this model/config: {str(e).splitlines()[-1]}") from e
                if result.unexpected_keys:
                    raise ValueError(f"{path}: unexpected tensors {result.unexpected_keys[:3]}: "
                                     "the checkpoint does not match this model/config")
                if len(state) != len(params):
                    raise ValueError(f"{path}: holds {len(state)} tensors, this model expects {len(params)}: "
                                     "the checkpoint does not match this model/config")
            elif name == "causal":
                path = directory / "causal" / BIDIR_FULL_FILE
                state = _read_safetensors(path)
                missing, unexpected = self.weights.model.load_state_dict(state, strict=False)
                if unexpected or [k for k in missing if k in params]:
                    raise ValueError(f"{path}: does not match this model (missing {missing[:3]}, "
                                     f"unexpected {unexpected[:3]})")
            else:
                path = directory / "bidir" / BIDIR_FULL_FILE
                _load_strict_dict(self.weights.bidir, _read_safetensors(path), path)


# --------------------------------------------------------------------------------------------------- helpers
def read_config(directory: Path) -> BituneConfig:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{directory} is not a Bitune checkpoint: {CONFIG_FILE} is missing")
    from .errors import BituneError
    from .files import read_text

    try:
        data = json.loads(read_text(path, "Bitune config"))
        if isinstance(data, dict):
            data.setdefault("template", "paper")  # written before templates were recorded: all trained with paper
            data.pop("prompt_passes", None)  # written while it was a saved setting; now a runtime argument
        return BituneConfig.from_dict(data)
    except BituneError:
        raise
    except (ValueError, TypeError) as e:  # bad JSON, not an object, unknown keys, a field of the wrong type or value
        raise ValueError(f"{path} is not a valid Bitune config: {e}") from e


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ValueError(f"checkpoint file missing: {path}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"corrupt checkpoint file {path}: {e}") from e


def _load_strict(module: nn.Module, state: dict, path: Path) -> None:
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{path} does not match this model: {e}") from e


def _load_strict_dict(params: nn.ParameterDict, state: dict, path: Path) -> None:
    if set(state) != set(params.keys()):
        raise ValueError(f"{path} does not match this model: different tensor names")
    with torch.no_grad():
        for k, p in params.items():
            if state[k].shape != p.shape:
                raise ValueError(f"{path}: tensor {k} has shape {tuple(state[k].shape)}, expected {tuple(p.shape)}")
            p.copy_(state[k])


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, A) float32 log-probability of each token ``ids[:, t]`` under ``logits[:, t]`` (B, A, V); 0 where ``mask``
    is 0."""
    logp = F.log_softmax(logits.float(), dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # (B, A)
    return logp * mask.to(torch.float32)


def _answer_loss(logits: torch.Tensor, answer_ids: torch.Tensor, answer_mask: torch.Tensor) -> BituneOutput:
    logp = token_logprobs(logits, answer_ids, answer_mask)  # (B, A)
    example_loss = -logp.sum(1) / answer_mask.to(torch.float32).sum(1)  # (B,)
    return BituneOutput(loss=example_loss.mean(), logits=logits, token_logprobs=logp, example_loss=example_loss)


def _check_architecture(model: nn.Module) -> None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "generate"):
        raise ValueError(f"{type(model).__name__} is not a transformers causal LM (no config / generate)")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{type(model).__name__} is an encoder-decoder model; Bitune needs a decoder-only LM")
    text = config.get_text_config()
    if not getattr(text, "num_hidden_layers", None):
        raise ValueError(f"{type(model).__name__}: config has no num_hidden_layers; unsupported architecture")


def _check_prompt(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> None:
    if prompt_ids.dim() != 2 or prompt_mask.shape != prompt_ids.shape:
        raise ValueError(f"prompt_ids {tuple(prompt_ids.shape)} and prompt_mask {tuple(prompt_mask.shape)} "
                         "must both be (batch, prompt_len)")
    if prompt_ids.shape[0] == 0 or prompt_ids.shape[1] < 2:
        raise ValueError(f"prompts must hold at least 2 tokens, got shape {tuple(prompt_ids.shape)}")
    if (prompt_mask.diff(dim=1) < 0).any() or not prompt_mask[:, -1].bool().all():
        raise ValueError("prompts must be left-padded: prompt_mask must be 0...0 1...1 in every row")
    if (prompt_mask.sum(1) < 2).any():
        rows = (prompt_mask.sum(1) < 2).nonzero().flatten().tolist()
        raise ValueError(f"prompt rows {rows} have fewer than 2 real tokens (the last one opens the answer)")


def _check_answer(prompt_ids: torch.Tensor, answer_ids: torch.Tensor, answer_mask: torch.Tensor) -> None:
    if answer_ids.dim() != 2 or answer_mask.shape != answer_ids.shape:
        raise ValueError(f"answer_ids {tuple(answer_ids.shape)} and answer_mask {tuple(answer_mask.shape)} "
                         "must both be (batch, answer_len)")
    if answer_ids.shape[0] != prompt_ids.shape[0]:
        raise ValueError(f"batch sizes differ: {prompt_ids.shape[0]} prompts, {answer_ids.shape[0]} answers")
    if answer_ids.shape[1] == 0 or not answer_mask[:, 0].bool().all():
        raise ValueError("every answer needs at least one real token (right-padded answer_mask)")
    if (answer_mask.diff(dim=1) > 0).any():
        raise ValueError("answers must be right-padded: answer_mask must be 1...1 0...0 in every row")
