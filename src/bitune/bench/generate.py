"""``bitune bench generate``: the paper's inference table (section 3.4) for the base model, LoRA and Bitune.

Prefill a long prompt, generate N tokens; a streamer timestamps every new token, so prefill time and decode rate
come from the same call. Also the memory each model holds (parameters, buffers, merged copies) against the base
model's. Bitune is timed merged (its bidir pass the low-rank difference on the merged weights), unmerged, and
with the bidir set merged into a copy too (``--merge-bidir``: each prompt pass at the base model's cost).
"""

from __future__ import annotations

import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from ..decoding import decode_compile_config
from ..hub import load_model
from .helpers import build, device_dtype, interleaved, random_prompts, shown, sync


class TokenClock:
    """A ``generate`` streamer that timestamps each new token: prefill = start to the first new token, decode
    rate = tokens after the first over the time since the first, all from the same call."""

    def __init__(self, device):
        self.device = device
        self.start = time.perf_counter()
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # generate first hands the streamer the prompt
            self._prompt_seen = True
            return
        sync(self.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct parameter and buffer a model holds, plus a merged Bitune model's bidir copies
    (DoRA, IA3)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    weights = getattr(model, "weights", None)
    if weights is not None:
        tensors.update({id(t): t for t in weights.merged_bidir_tensors()})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def bench_generate(args) -> dict:
    """``bitune bench generate``: measure (:func:`measure`), print (:func:`render`), return the record."""
    return shown(measure(args), render)


@torch.no_grad()
def measure(args) -> dict:
    """Prefill a prompt and decode ``new_tokens`` greedily, interleaved, for: the base model (transformers'
    ``generate`` on the plain model), LoRA merged and unmerged (PEFT's model, transformers' ``generate``), and
    Bitune merged (the default for inference; prompt read ``batched`` and ``sequential``) and unmerged. Ratios
    are against the base model."""
    if args.new_tokens < 2 or args.prompt_tokens < 2 or args.repeats < 1:
        raise ValueError("bench generate needs --prompt-tokens >= 2, --new-tokens >= 2 and --repeats >= 1")
    device, dtype = device_dtype(args.dtype)
    base_model, tokenizer = load_model(args.model, dtype=dtype)
    base_model = base_model.to(device).eval()
    base_copy = load_model(args.model, dtype=dtype)[0].to(device).eval()  # the control: same model, measured again
    bitune, _ = build(args.model, "bitune", device, dtype)
    bitune_unmerged, _ = build(args.model, "bitune", device, dtype)
    bitune_bidir, _ = build(args.model, "bitune", device, dtype)  # --merge-bidir: the bidir set merged too
    lora, _ = build(args.model, "lora", device, dtype)
    lora_unmerged, _ = build(args.model, "lora", device, dtype)
    for m in (bitune, bitune_unmerged, bitune_bidir, lora, lora_unmerged):
        m.eval()
    bitune.merge()
    bitune_bidir.merge(bidir_copy=True)
    lora.merge()
    prompt = random_prompts(bitune.text_config.vocab_size, 1, args.prompt_tokens, device)
    gen = dict(eos_token_id=None, pad_token_id=tokenizer.pad_token_id, do_sample=False)

    def bitune_generate(model, passes, compile=False):
        def run(n, streamer):
            model.prompt_passes = passes  # same weights, prompt read batched or sequentially
            return model.generate(*prompt, max_new_tokens=n, min_new_tokens=n, streamer=streamer, compile=compile,
                                  **gen)
        return run

    def hf_generate(model, **kwargs):  # transformers' own generate from scratch
        def run(n, streamer):
            return model.generate(input_ids=prompt[0], attention_mask=prompt[1], max_new_tokens=n,
                                  min_new_tokens=n, streamer=streamer, **gen, **kwargs)
        return run

    default = bitune.prefill_path(args.prompt_tokens - 1)  # what prompt_passes="auto" reads this prompt with
    other = "sequential" if default == "batched" else "batched"
    runners = {"base": hf_generate(base_model), "base_copy": hf_generate(base_copy),
               "lora": hf_generate(lora.weights.model),
               "lora_unmerged": hf_generate(lora_unmerged.weights.model),
               "bitune": bitune_generate(bitune, "auto"), f"bitune_{other}": bitune_generate(bitune, other),
               "bitune_unmerged": bitune_generate(bitune_unmerged, "auto"),
               "bitune_merged_bidir": bitune_generate(bitune_bidir, "auto")}
    if args.compile:
        # decoding compiled, from a static cache; the first call of a shape compiles
        runners.update(base_compiled=hf_generate(base_model, cache_implementation="static",
                                                 compile_config=decode_compile_config(device)),
                       bitune_compiled=bitune_generate(bitune, "auto", compile=True))
    for name, fn in runners.items():  # warm-up; a compiled one at the timed shape (a new shape recompiles)
        fn(args.new_tokens if name.endswith("_compiled") else 2, None)
    samples = {name: [] for name in runners}
    for i in range(args.repeats):
        for name, fn in interleaved(runners.items(), i):
            clock = TokenClock(device)
            out = fn(args.new_tokens, clock)
            assert out.shape[-1] >= args.new_tokens and len(clock.times) == args.new_tokens
            samples[name].append(clock)
    rows = {}
    for name, clocks in samples.items():
        rows[name] = {"prefill_s": statistics.median(c.times[0] - c.start for c in clocks),
                      "decode_tok_s": statistics.median((len(c.times) - 1) / (c.times[-1] - c.times[0])
                                                        for c in clocks),
                      "total_s": statistics.median(c.times[-1] - c.start for c in clocks)}
    memory = {"base": held_bytes(base_model), "lora": held_bytes(lora), "lora_unmerged": held_bytes(lora_unmerged),
              "bitune": held_bytes(bitune), "bitune_unmerged": held_bytes(bitune_unmerged),
              "bitune_merged_bidir": held_bytes(bitune_bidir)}
    summary = {"default": default, "memory_bytes": memory,
               "memory_ratio": {k: v / memory["base"] for k, v in memory.items() if k != "base"}}
    for name in runners:
        if name != "base":
            summary[name] = {"prefill_ratio": rows[name]["prefill_s"] / rows["base"]["prefill_s"],
                             "decode_ratio": rows[name]["decode_tok_s"] / rows["base"]["decode_tok_s"],
                             "total_ratio": rows[name]["total_s"] / rows["base"]["total_s"]}
    return {"device": str(device), "dtype": str(dtype), "model": args.model, "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens, "repeats": args.repeats, "threads": torch.get_num_threads(), "rows": rows,
            **summary}


def render(result: dict) -> None:
    """Print a :func:`measure` record: the table, memory held, the noise floor and the ratios to the base model
    (the targets they are judged against are stated in docs/benchmarks.md)."""
    table = Table(title=f"Generation, {result['model']}, {result['device']}, prompt {result['prompt_tokens']} "
                        f"tokens, {result['new_tokens']} new tokens, median of {result['repeats']}; ratios vs the "
                        "base model")
    for col in ("model", "prefill s", "decode tok/s", "total s", "prefill x", "decode x"):
        table.add_column(col, justify="right")
    for name, r in result["rows"].items():
        ratio = result.get(name, {"prefill_ratio": 1.0, "decode_ratio": 1.0})
        table.add_row(name, f"{r['prefill_s']:.3f}", f"{r['decode_tok_s']:.2f}", f"{r['total_s']:.2f}",
                      f"{ratio['prefill_ratio']:.2f}", f"{ratio['decode_ratio']:.3f}")
    console = Console()
    console.print(table)
    memory = result["memory_ratio"]
    console.print(f"Memory held (parameters, buffers, merged copies) / base model: Bitune merged "
                  f"{memory['bitune']:.3f}x, unmerged {memory['bitune_unmerged']:.3f}x, with the bidir set merged "
                  f"too (--merge-bidir) {memory['bitune_merged_bidir']:.3f}x, LoRA merged {memory['lora']:.3f}x.")
    console.print(f"Bitune with the bidir set merged too (--merge-bidir) / base: prefill "
                  f"{result['bitune_merged_bidir']['prefill_ratio']:.2f}x (the two prompt passes' floor: 2x).")
    console.print(f"Noise floor: a second copy of the base model measured the same way: prefill "
                  f"{result['base_copy']['prefill_ratio']:.2f}x, decode {result['base_copy']['decode_ratio']:.3f}x "
                  "(a ratio closer to 1 than this is not resolved by this run).")
    if "bitune_compiled" in result:
        console.print(f"Compiled decoding (torch.compile, static cache; opt-in --compile): base "
                      f"{result['base_compiled']['decode_ratio']:.3f}x, Bitune "
                      f"{result['bitune_compiled']['decode_ratio']:.3f}x the base model's eager decode tok/s.")
    console.print(f"Bitune (merged, {result['default']}) / base: prefill {result['bitune']['prefill_ratio']:.2f}x, "
                  f"decode tok/s {result['bitune']['decode_ratio']:.3f}x; LoRA (merged) decode "
                  f"{result['lora']['decode_ratio']:.3f}x. Unmerged: Bitune decode "
                  f"{result['bitune_unmerged']['decode_ratio']:.3f}x, LoRA {result['lora_unmerged']['decode_ratio']:.3f}x.")
