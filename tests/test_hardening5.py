"""What the fifth set of unseen inputs broke (issue 65), one test per class: eager-only models from the CLI, dotted
config names, report.yaml names, sweep's resume checks, a declined merge at export, hints, PEFT's pattern noise on
MoE models, init_share's high end, and two eval processes writing one output."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, Gemma2Config, GPTNeoConfig

from bitune.cli import main
from helpers.tokenizer import tiny_tokenizer
from test_cli_errors import one_error_line

EAGER_ONLY = {  # model types that implement no sdpa attention: transformers' own default loads them with eager
    "gemma2": lambda: Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0,
                                   eos_token_id=1, bos_token_id=2),
    "gpt_neo": lambda: GPTNeoConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                                    attention_types=[[["global", "local"], 1]], max_position_embeddings=128,
                                    pad_token_id=0, eos_token_id=1, bos_token_id=2),
}


@pytest.fixture(scope="module")
def eager_only(tmp_path_factory):
    """A tiny model of each eager-only type saved to a folder with the tiny tokenizer, as a user's model is."""
    root = tmp_path_factory.mktemp("eager")
    for name, config in EAGER_ONLY.items():
        AutoModelForCausalLM.from_config(config()).save_pretrained(root / name)
        tiny_tokenizer().save_pretrained(root / name)
    return root


# ------------------------------------------------------------------------------- A. eager-only models from the CLI
def test_an_eager_only_model_the_page_lists_as_pass_runs_from_the_cli(eager_only, capsys):
    """gemma2 implements no sdpa: the CLI loaded it with sdpa and refused it as 'not a local folder with safetensors
    weights'; it loads with eager, as transformers' own default does, and the passes build eager masks for it."""
    assert main(["generate", "--model", str(eager_only / "gemma2"), "--prompt", "ab", "--template", "none",
                 "--max-new-tokens", "2"]) == 0, capsys.readouterr().err


def test_an_eager_only_refused_model_shows_its_real_reason(eager_only, tmp_path, capsys):
    """gpt_neo is refused by Bitune's wrap checks: that reason, not a loading error, is what the user reads."""
    out = tmp_path / "run"
    assert main(["train", "--set", f"model={eager_only / 'gpt_neo'}", "--set", "steps=1", "--set", "max_length=64",
                 "--set", f"output_dir={out}"]) == 2
    line = one_error_line(capsys, "train")
    assert "GPTNeoForCausalLM (gpt_neo) is not supported by Bitune" in line, line
    assert not out.exists()
