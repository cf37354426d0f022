"""The ``bitune`` model type of lm-evaluation-harness.

lm-eval hands a :class:`~lm_eval.api.model.TemplateLM` its (context, continuation) requests already split into
token lists, which is exactly where a Bitune model differs from a plain causal LM: the context is the prompt
(read by the prompt passes and mixed), the continuation is the answer (scored by the causal answer pass).

Scoring: requests are grouped by context; each distinct context is prefilled ONCE (batched over contexts,
left-padded) and the continuations of one or several such chunks are packed into one sequence of the answer
pass, each context's last token once, then its choices (:mod:`bitune.scoring`): every choice of up to
``ANSWER_KEYS`` cached positions of contexts in one forward, no padding in the answer pass. For the baselines
(``pretrained``, ``lora``) this equals lm-eval's ``hf`` model on the same weights.

Edge cases, defined so that results stay sound:

* Context of one token (lm-eval uses the prefix token for an empty context; rolling windows use one token of
  context): the prompt passes have nothing to read (they see the prompt without its last token), so the prefill
  is empty and the answer pass, with the causal weights, is one plain causal forward over context +
  continuation. No token is invented (prepending BOS would change the baselines' scores against ``hf``).
* ``loglikelihood_rolling``: a document has no prompt, so it is scored with the causal weights alone, in lm-eval's
  disjoint rolling windows of ``max_length`` tokens with one token of context (the case above).
* Too long: like ``hf``, the context is truncated from the left so context + continuation fit ``max_length + 1``.

Use it from lm-eval's own CLI (lm-eval 0.4.13 does not load entry points for models, so the class has to be
imported before the model is looked up): ``python -m bitune.eval.harness --model bitune --model_args
checkpoint=DIR --tasks bitune_piqa --include_path $(python -m bitune.eval.tasks)``.
"""

from __future__ import annotations

import functools
from collections import defaultdict

import torch
import torch.distributed as dist
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from ..data.collate import pad_id, pad_rows
from ..errors import BituneError
from ..inputs import max_positions
from ..loading import load_bitune
from ..model import BituneModel
from ..outputs import token_logprobs
from ..passes import Prefill
from ..processes import world_size
from ..scoring import score_continuations

Request = tuple[tuple[str, str], list[int], list[int]]


DEFAULT_MAX_LENGTH = 2048
"""``max_length`` for a model whose config names no maximum position (lm-eval's own default for ``hf``)."""


@register_model("bitune")
class BituneLM(TemplateLM):
    """lm-eval model type ``bitune``.

    model_args: ``checkpoint=DIR`` (a Bitune checkpoint, any variant) or ``pretrained=NAME`` (a base model run as
    the ``pretrained`` variant); optional ``base=NAME``, ``batch_size`` (rows per forward, default 8),
    ``device`` (default cuda if available, else cpu), ``dtype`` (default float32), ``max_length`` (default: the model's
    ``max_position_embeddings``, or :data:`DEFAULT_MAX_LENGTH` where it names none), ``max_gen_toks`` (default
    256), ``prompt_passes`` (default auto). In Python, pass ``model=`` (a BituneModel) and ``tokenizer=`` instead.
    """

    def __init__(self, checkpoint: str | None = None, pretrained: str | None = None, base: str | None = None,
                 model: BituneModel | None = None, tokenizer=None, batch_size: int | str = 8,
                 device: str | None = None, dtype: str = "float32", max_length: int | None = None,
                 max_gen_toks: int = 256, prompt_passes: str = "auto", merge: bool = True, **unused):
        super().__init__()
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if model is None:
            model, tokenizer = load_bitune(checkpoint, pretrained, base, dtype, device, prompt_passes, merge=merge)
        elif tokenizer is None:
            raise BituneError("BituneLM(model=...) also needs tokenizer=")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self._device = next(model.parameters()).device
        if str(batch_size).startswith("auto"):
            raise BituneError("batch_size=auto is not supported by the bitune model type; give a number")
        self._batch_size = int(batch_size)
        if self._batch_size < 1:
            raise BituneError(f"batch_size must be >= 1, got {batch_size}")
        positions = max_positions(model.text_config)  # None: no limit in the config (ALiBi: Bloom)
        self._max_length = int(max_length) if max_length else positions or DEFAULT_MAX_LENGTH
        if positions is not None and self._max_length > positions:  # past them: positions the model never saw
            raise BituneError(f"max_length={self._max_length} exceeds the model's {positions} positions; "
                              f"use max_length <= {positions}")
        self._max_gen_toks = int(max_gen_toks)
        self._pad = pad_id(tokenizer)
        self._join_processes()

    # ------------------------------------------------------------------------------------------- processes
    def _join_processes(self) -> None:
        """Under a launcher of N processes (``bitune eval --num-processes N``, torchrun, accelerate launch:
        ``WORLD_SIZE`` > 1), join their process group (gloo on CPU, nccl on GPUs) and take this process's rank:
        lm-eval's evaluator then gives each process every N-th question and gathers the results on rank 0, as
        for its own ``hf`` model."""
        if world_size() <= 1:
            return
        if not dist.is_initialized():
            dist.init_process_group("nccl" if self._device.type == "cuda" else "gloo")
        self._rank, self._world_size = dist.get_rank(), dist.get_world_size()

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every process's ``tensor``, stacked (0-d) or concatenated along dim 0, on every process."""
        if self._world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self._world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj, dst: int = 0):
        """Every process's ``obj`` as a list on rank ``dst`` (None on the others)."""
        if self._world_size == 1:
            return [obj]
        out = [None] * self._world_size if self._rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        if self._world_size > 1:
            dist.barrier()

    # ------------------------------------------------------------------------------------------- lm-eval API
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """Like ``hf``: BOS if the tokenizer has one, else EOS."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> torch.device:
        return self._device

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """Tokenize as lm-eval's ``hf`` model does: special tokens by default, none if ``string`` starts with BOS."""
        kw = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and string.startswith(self.tokenizer.decode(self.prefix_token_id)):
            kw["add_special_tokens"] = False
        return self.tokenizer.encode(string, **kw)

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def get_model_info(self) -> dict:
        return {"bitune_config": self.model.config.to_dict()}

    @property
    def tokenizer_name(self) -> str:
        """lm-eval's request-cache fingerprint for chat-templated prompts."""
        return self.tokenizer.name_or_path.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The tokenizer's chat template (lm-eval calls this with ``apply_chat_template``)."""
        return getattr(self.tokenizer, "chat_template", None) if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """A task prompt as a user turn of the chat template (lm-eval's ``apply_chat_template=True``), rendered as
        ``bitune generate --template chat`` and chat-format training render it."""
        return self.tokenizer.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """As lm-eval's, except for a context that ends with the chat template's generation prompt: lm-eval would
        move its trailing whitespace (SmolLM2's ``"assistant\\n"``) into the continuation; here the context keeps
        it and each side is tokenized alone, as chat-format training and ``bitune generate`` split prompt and answer
        (the generation prompt's last token is the one Bitune moves into the answer pass)."""
        if self._generation_prompt and context.endswith(self._generation_prompt):
            return self.tok_encode(context), self.tok_encode(continuation, add_special_tokens=False)
        return super()._encode_pair(context, continuation)

    @functools.cached_property
    def _generation_prompt(self) -> str | None:
        """What the chat template appends for an answer (``"<|im_start|>assistant\\n"``); None without a template."""
        if not getattr(self.tokenizer, "chat_template", None):
            return None
        turn = [{"role": "user", "content": "x"}]
        bare = self.tokenizer.apply_chat_template(turn, add_generation_prompt=False, tokenize=False)
        with_prompt = self.tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
        return with_prompt[len(bare):] if with_prompt.startswith(bare) and len(with_prompt) > len(bare) else None

    # ------------------------------------------------------------------------------------------- scoring
    @torch.no_grad()
    def _loglikelihood_tokens(self, requests: list[Request], disable_tqdm: bool = False,
                              **kwargs) -> list[tuple[float, bool]]:
        """(sum of log-probabilities, is-greedy) of every continuation, in request order."""
        groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
        conts: list[list[int]] = []
        for i, (_, ctx, cont) in enumerate(requests):
            ctx, cont = self._fit(ctx, cont)
            groups[tuple(ctx)].append(i)
            conts.append(cont)
        contexts = sorted(groups, key=len, reverse=True)  # similar lengths share a batch: less padding
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        pbar = tqdm(total=len(requests), disable=disable_tqdm, desc="bitune loglikelihood")
        pending: list[tuple[Prefill, list[tuple[int, ...]]]] = []  # prefills whose choices are not scored yet
        for start in range(0, len(contexts), self.batch_size):
            chunk = contexts[start:start + self.batch_size]
            long_ = [ctx for ctx in chunk if len(ctx) >= 2]
            if long_:
                prefill = self.model.prefill(*self._left_pad([list(ctx) for ctx in long_]))
                if pending and self._keys(pending + [(prefill, long_)]) > self.ANSWER_KEYS:
                    self._score_pending(pending, groups, conts, results)
                pending.append((prefill, long_))
            short = [(ctx, i) for ctx in chunk if len(ctx) < 2 for i in groups[ctx]]
            for part in range(0, len(short), self.batch_size):
                self._score_causal(results, short[part:part + self.batch_size], conts)
            pbar.update(sum(len(groups[ctx]) for ctx in chunk))
        if pending:
            self._score_pending(pending, groups, conts, results)
        pbar.close()
        return results

    ANSWER_TOKENS = 2048
    """Most positions in one packed answer pass: bounds its (S, V) logits (400 MB in float32 for a 49k
    vocabulary)."""

    ANSWER_KEYS = 4096
    """Most cached prompt positions (contexts x padded length) one packed answer pass reads: the prefills of
    several chunks are scored together up to this (a larger answer pass runs more efficiently); bounds its dense
    (S, keys + S) mask. A chunk with more gets passes of its own."""

    @staticmethod
    def _keys(pending) -> int:
        """Cached positions of pending prefills once concatenated (left padding to the longest)."""
        return sum(p.mask.shape[0] for p, _ in pending) * max(p.mask.shape[1] for p, _ in pending)

    def _score_pending(self, pending, groups, conts, results) -> None:
        """Score every choice of the pending prefills' contexts in few packed answer passes; empties ``pending``."""
        prefill = Prefill.concat([p for p, _ in pending]) if len(pending) > 1 else pending[0][0]
        requests = [groups[ctx] for _, ctxs in pending for ctx in ctxs]
        if self.model.layer_kinds.allows("packed") is not None:  # per-row states (bitune.kinds): no packing
            self._score_rows(prefill, requests, conts, results)
            pending.clear()
            return
        for part in self._answer_passes(requests, conts, prefill.mask.shape[1]):
            scores = score_continuations(self.model.weights, self.model.text_config, prefill,
                                         [[conts[i] for i in ids] for ids in part])
            for i, score in zip((i for ids in part for i in ids), scores):
                results[i] = score
        pending.clear()

    UNPACKED_ROWS = 64
    """Continuations per answer pass where they cannot be packed (each its own row on a copy of its prefill)."""

    def _score_rows(self, prefill, requests: list[list[int]], conts: list[list[int]], results) -> None:
        """Score every continuation as its own right-padded row on a copy of its context's prefill row: the answer
        pass :meth:`~bitune.model.BituneModel.answer_logits` runs, for models whose layers keep per-row states that
        a packed pass cannot flatten (:data:`bitune.kinds.PATHS`)."""
        slots = [slot for slot, ids in enumerate(requests) for _ in ids]
        order = [i for ids in requests for i in ids]
        for a in range(0, len(order), self.UNPACKED_ROWS):
            part = order[a:a + self.UNPACKED_ROWS]
            rows = prefill.select(torch.tensor(slots[a:a + self.UNPACKED_ROWS], device=self.device))
            ids, mask = self._right_pad([conts[i] for i in part])
            self._collect(results, part, self.model.answer_logits(rows, ids, mask), ids, mask)

    def _answer_passes(self, requests: list[list[int]], conts: list[list[int]],
                       cached: int) -> list[list[list[int]]]:
        """Split the continuations of the pending contexts (``requests[slot]``, request ids) into packed answer
        passes within ``ANSWER_TOKENS`` positions and ``ANSWER_KEYS`` cached keys (``cached`` per context); each
        pass is a list of request ids per slot. Contexts of ordinary length fit one pass (e.g. 64 ARC questions x
        4 choices: ~900 positions on 64 x ~60 keys)."""
        passes: list[list[list[int]]] = []
        tokens = keys = 0
        for slot, ids in enumerate(requests):
            for i in ids:
                new_slot = not passes or not passes[-1][slot]
                n = len(conts[i]) - 1 + new_slot  # its positions (x_P comes with the first one of a context)
                if not passes or tokens + n > self.ANSWER_TOKENS or (new_slot and keys + cached > self.ANSWER_KEYS):
                    passes.append([[] for _ in requests])
                    tokens, keys, n = 0, 0, len(conts[i])
                    new_slot = True
                passes[-1][slot].append(i)
                tokens += n
                keys += cached if new_slot else 0
        return passes

    def _score_causal(self, results, items, conts) -> None:
        """One-token contexts: the prefill is empty, so the answer pass is a plain causal forward (causal weights)."""
        ctx_ids = torch.tensor([list(ctx) for ctx, _ in items], device=self.device)  # (b, 1)
        ids, mask = self._right_pad([conts[i] for _, i in items])
        logits = self.model.causal_logits(ctx_ids, torch.ones_like(ctx_ids), ids, mask)  # (b, A, V)
        self._collect(results, [i for _, i in items], logits, ids, mask)

    @staticmethod
    def _collect(results, request_ids, logits, ids, mask) -> None:
        token_logp = token_logprobs(logits, ids, mask)  # (b, A)
        greedy = ((logits.float().argmax(-1) == ids) | (mask == 0)).all(dim=1)  # (b,)
        for k, i in enumerate(request_ids):
            results[i] = (float(token_logp[k].sum()), bool(greedy[k]))

    def _fit(self, ctx: list[int], cont: list[int]) -> tuple[list[int], list[int]]:
        """Left-truncate the context like ``hf``: context + continuation keep at most ``max_length + 1`` tokens."""
        if not cont:
            raise BituneError("lm-eval sent an empty continuation; nothing to score")
        if len(cont) > self.max_length:
            raise BituneError(f"continuation of {len(cont)} tokens exceeds max_length={self.max_length}")
        whole = (ctx + cont)[-(self.max_length + 1):]
        return whole[:len(whole) - len(cont)], cont

    def _left_pad(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        return pad_rows(seqs, self._pad, "left", self.device)  # (B, T) ids and mask

    def _right_pad(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        return pad_rows(seqs, self._pad, "right", self.device)  # (B, T) ids and mask

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole documents with the causal weights (lm-eval's disjoint rolling windows)."""
        windows, owner = [], []
        for n, (string,) in enumerate(req.args for req in requests):
            for w in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, *w))
                owner.append(n)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for n, (logp, _) in zip(owner, scores):
            totals[n] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ------------------------------------------------------------------------------------------- generation
    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled) generation from the mixed prompt cache, cut at the first stop string."""
        by_kwargs: dict[str, list[int]] = defaultdict(list)
        args = [req.args for req in requests]
        for i, (_, gen_kwargs) in enumerate(args):
            by_kwargs[repr(sorted(gen_kwargs.items()))].append(i)
        out: list[str | None] = [None] * len(requests)
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        pbar = tqdm(total=len(requests), disable=disable_tqdm, desc="bitune generate_until")
        for idx in by_kwargs.values():
            kwargs = normalize_gen_kwargs(dict(args[idx[0]][1]), self._max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen = kwargs.pop("max_gen_toks")
            if not kwargs.get("do_sample"):
                kwargs.pop("temperature", None)
            max_ctx = self.max_length - max_gen
            if max_ctx < 2:
                raise BituneError(f"max_gen_toks={max_gen} leaves no room for a prompt in max_length={self.max_length}")
            encoded = {i: self.tok_encode(args[i][0])[-max_ctx:] for i in idx}
            idx = sorted(idx, key=lambda i: -len(encoded[i]))
            for start in range(0, len(idx), self.batch_size):
                part = idx[start:start + self.batch_size]
                tokens = self._generate([encoded[i] for i in part], until, max_gen, kwargs)
                for i, toks in zip(part, tokens):
                    text = postprocess_generated_text(self.tok_decode(toks), until, None)
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", args[i], text)
                pbar.update(len(part))
        pbar.close()
        return out

    def _generate(self, prompts: list[list[int]], until: list[str], max_gen: int, kwargs: dict) -> list[list[int]]:
        """New tokens per prompt; one-token prompts (nothing for the prompt passes) decode with the causal weights."""
        out: list[list[int]] = [[] for _ in prompts]
        long_ = [k for k, p in enumerate(prompts) if len(p) >= 2]
        short = [k for k, p in enumerate(prompts) if len(p) < 2]
        common = dict(max_new_tokens=max_gen, tokenizer=self.tokenizer, stop_strings=until,
                      eos_token_id=self.eot_token_id, pad_token_id=self._pad, **kwargs)
        if long_:
            ids, mask = self._left_pad([prompts[k] for k in long_])
            new = self.model.generate(ids, mask, **common)  # (b, N)
            for k, row in zip(long_, new.tolist()):
                out[k] = row
        for k in short:
            base = self.model.weights.base  # the causal weights are the active set outside a pass
            ids = torch.tensor([prompts[k]], device=self.device)
            new = base.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **common)
            out[k] = new[0, ids.shape[1]:].tolist()
        return out
