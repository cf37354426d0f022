"""Save a small randomly initialised model of any causal-LM type to a folder, with the tests' tiny tokenizer, so
that the CLI (``bitune train``, ``bench``, ``serve``, ...) can run on it: for benchmarks of one kind of layer
against another at equal width and depth, and for trying a family without downloading it.

The config is the architecture matrix's tiny one (``tests/helpers/architectures.py``) with ``--set`` fields on
top (values are JSON, else strings; a layer pattern is repeated to a new ``num_hidden_layers``). The weights are written as safetensors.

Usage (from the repository root)::

    python scripts/tiny_model.py qwen3 /tmp/dense --set hidden_size=256 --set intermediate_size=512 \\
        --set num_hidden_layers=8
    python scripts/tiny_model.py qwen3_5_text /tmp/hybrid --set hidden_size=256 --set intermediate_size=512 \\
        --set num_hidden_layers=8 --set 'layer_types=["linear_attention","linear_attention","linear_attention",
        "full_attention","linear_attention","linear_attention","linear_attention","full_attention"]'
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_type", help="a causal-LM model type of the pinned transformers (e.g. qwen3_5_text)")
    parser.add_argument("output", type=Path, help="the folder to write (must not exist)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a config field")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from transformers import AutoModelForCausalLM

    from helpers.architectures import causal_lm_types, tiny_config
    from helpers.tokenizer import tiny_tokenizer

    if args.model_type not in causal_lm_types():
        parser.error(f"{args.model_type!r} is not a causal-LM type of this transformers")
    if args.output.exists():
        parser.error(f"{args.output} exists; give a new folder")
    config = tiny_config(args.model_type)
    fields = config.to_dict()
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep or not hasattr(config, name):
            parser.error(f"--set {item!r}: expected FIELD=VALUE with a field of {type(config).__name__}")
        fields[name] = _value(value)
    layers, pattern = fields.get("num_hidden_layers"), fields.get("layer_types")
    if isinstance(pattern, list) and pattern and isinstance(layers, int) and len(pattern) != layers:
        fields["layer_types"] = [pattern[i % len(pattern)] for i in range(layers)]  # the tiny pattern, repeated
    config = type(config)(**fields)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config)
    tmp = args.output.with_name(args.output.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tiny_tokenizer().save_pretrained(tmp)
    tmp.rename(args.output)
    print(f"wrote {args.output}: {type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
          "parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
