"""``bitune generate``: prompts read as in training, batching, streaming, stop strings, base models."""

from __future__ import annotations

import io
import json
import shutil

import pytest
import torch

from bitune.cli import main
from bitune.data.collate import tokenize_example
from bitune.data.templates import instruction_example
from bitune.errors import BituneError
from bitune.generation import encode, generate_texts, max_new_tokens_for, render
from helpers.gen import perturbed_bitune, save_checkpoint
from helpers.models import batch, perturb_adapters, tiny_bitune
from helpers.tokenizer import tiny_tokenizer

PROMPTS = ["what is 2+2?", "name a color.", "hi"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("gen"))


def test_paper_template_reads_the_prompt_exactly_as_training_tokenized_it():
    tok = tiny_tokenizer()
    text, special = render(tok, PROMPTS[0], "paper")
    ids, mask = encode(tok, [text], special)
    trained = tokenize_example(tok, instruction_example(PROMPTS[0], None, "x"))["prompt_ids"]
    assert ids[0].tolist() == trained and mask.all()
    assert text == f"Question: {PROMPTS[0]}\n\nAnswer:"


def test_single_answer_is_the_model_greedy_continuation():
    tok, model = tiny_tokenizer(), perturbed_bitune()
    answer = generate_texts(model, tok, [PROMPTS[0]], max_new_tokens=8)[0]
    ids, mask = encode(tok, [render(tok, PROMPTS[0])[0]], True)
    new = model.generate(ids, mask, max_new_tokens=8, pad_token_id=0)
    assert answer == tok.decode(new[0], skip_special_tokens=True).strip()


def test_jsonl_batched_equals_one_by_one(saved, tmp_path):
    ckpt, model = saved
    tok = tiny_tokenizer()
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    records = [{"prompt": PROMPTS[0], "id": 7}, {"instruction": "add", "input": "2+2"}, {"prompt": PROMPTS[2]}]
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["generate", "--checkpoint", str(ckpt), "--input", str(src), "--output", str(out),
                 "--batch-size", "3", "--max-new-tokens", "6", "--device", "cpu"]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    singles = [generate_texts(model, tok, [p], max_new_tokens=6)[0] for p in (PROMPTS[0], "add\n2+2", PROMPTS[2])]
    assert [line["output"] for line in lines] == singles
    assert lines[0]["id"] == 7 and lines[1]["input"] == "2+2"  # the input records come back whole


def test_single_prompt_is_streamed_and_stop_string_is_never_printed(saved, capsys):
    ckpt, model = saved
    tok = tiny_tokenizer()
    free = generate_texts(model, tok, [PROMPTS[1]], max_new_tokens=10)[0]
    stop = next(c for c in free[1:] if c.isalnum())  # a character of the free-running answer
    expected = free[:free.find(stop)].strip()
    assert generate_texts(model, tok, [PROMPTS[1]], max_new_tokens=10, stop=[stop])[0] == expected
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", PROMPTS[1], "--max-new-tokens", "10",
                 f"--stop={stop}", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert printed.strip() == expected and stop not in printed


def test_base_model_generation_equals_transformers_generate(saved, capsys):
    ckpt, _ = saved
    base_dir = ckpt.parent / "base"
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer()
    hf = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    ids, mask = encode(tok, [render(tok, PROMPTS[0])[0]], True)
    ref = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=0)
    expected = tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True).strip()
    assert main(["generate", "--model", str(base_dir), "--prompt", PROMPTS[0], "--max-new-tokens", "7",
                 "--device", "cpu"]) == 0
    assert capsys.readouterr().out.strip() == expected


def test_sampling_is_reproducible_with_a_seed_and_differs_from_greedy():
    tok, model = tiny_tokenizer(), perturbed_bitune()
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        runs.append(generate_texts(model, tok, PROMPTS, max_new_tokens=12, do_sample=True, temperature=1.5))
    assert runs[0] == runs[1]
    assert runs[0] != generate_texts(model, tok, PROMPTS, max_new_tokens=12)


def test_user_errors_exit_2_with_one_line(saved, tmp_path, capsys):
    ckpt, _ = saved
    cases = [["--prompt", "x", "--temperature", "0.5"],  # sampling option without --do-sample
             ["--input", str(tmp_path / "missing.jsonl")],
             ["--prompt", "x", "--template", "chat"],  # the tiny tokenizer has no chat template
             ["--prompt", "x", "--stop=--"],  # argparse reads '--' as the end of options: no stop text
             ["--prompt", "  "]]
    for bad in ('{"prompt": ""}', '{"prompt": 5}', '{"instruction": "   "}', '{"text": "x"}', "not json",
                '{"prompt": null, "instruction": "x"}', '{"instruction": "x", "input": 5}',
                '{"instruction": "x", "input": ["a"]}', '{"instruction": null}'):
        (tmp_path / "bad.jsonl").write_text('{"prompt": "fine"}\n' + bad + "\n")
        cases.append(["--input", str(tmp_path / "bad.jsonl"), "--output", str(tmp_path / "out.jsonl")])
    for extra in cases:
        assert main(["generate", "--checkpoint", str(ckpt), "--device", "cpu", *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("bitune generate: error:"), err
    assert not (tmp_path / "out.jsonl").exists()


def test_a_too_short_prompt_is_named_by_its_place_among_all_prompts():
    from bitune.generation import encode

    tok = tiny_tokenizer()
    one = next(t for t in ("a", "b", "x") if len(tok(t, add_special_tokens=False)["input_ids"]) == 1)
    with pytest.raises(BituneError, match="prompt 5 has 1 token"):  # the 2nd of a batch that starts at prompt 4
        encode(tok, ["hello there", one], add_special_tokens=False, first=3)


# --------------------------------------------------------------------------------------------------- the model's context
def _short_context(model, positions: int = 16):
    model.text_config.max_position_embeddings = positions  # the base model's config: what every path reads
    return model


def test_max_new_tokens_is_capped_at_the_models_positions():
    model = _short_context(perturbed_bitune())
    assert max_new_tokens_for(model, 5, 100) == 11 and max_new_tokens_for(model, 5, 3) == 3
    with pytest.raises(BituneError, match="the prompt has 16 tokens, the model reads at most 16 positions"):
        max_new_tokens_for(model, 16, 1)
    ids = torch.randint(3, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # a shorter second row: the longest row decides
    new = model.generate(ids, mask, max_new_tokens=100000, eos_token_id=None, pad_token_id=0)  # (2, N)
    assert new.shape == (2, 11)  # prompt + answer = 16 positions, never past them
    with pytest.raises(BituneError, match="the prompt has 16 tokens"):
        model.generate(torch.ones(1, 16, dtype=torch.long) + 2, torch.ones(1, 16, dtype=torch.long))


def test_a_conversation_is_capped_at_the_models_positions():
    model = _short_context(perturbed_bitune(), 20)
    p1, p2 = torch.full((1, 5), 7), torch.full((1, 4), 9)
    opts = dict(max_new_tokens=1000, eos_token_id=None, pad_token_id=0, return_state=True)
    new1, state = model.generate(p1, torch.ones_like(p1), **dict(opts, max_new_tokens=3))
    new2, _ = model.generate(p2, torch.ones_like(p2), past=state, **opts)
    assert 5 + 3 + 4 + new2.shape[1] == 20
    with pytest.raises(BituneError, match="the conversation has"):
        model.generate(torch.full((1, 12), 9), torch.ones(1, 12, dtype=torch.long), past=state, **opts)


def test_cli_generate_and_chat_cap_at_the_models_positions_and_say_so(tmp_path, monkeypatch, capsys):
    ckpt, _ = save_checkpoint(tmp_path)
    config = tmp_path / "base" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "max_position_embeddings": 40}))
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "hi", "--max-new-tokens", "100000"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "capped" in line]
    assert len(notes) == 1 and "capped at 18 new tokens (the model's maximum position is 40)" in notes[0], notes
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    assert main(["chat", "--checkpoint", str(ckpt), "--max-new-tokens", "100000"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "capped" in line]
    assert len(notes) == 1 and "the conversation (/reset clears it) has" in notes[0], notes


def test_render_messages_writes_conversations_as_chat_and_generate_do():
    from bitune.generation import render_messages

    tok = tiny_tokenizer()
    one = [{"role": "user", "content": PROMPTS[0]}]
    assert render_messages(tok, one, "paper") == render(tok, PROMPTS[0], "paper")
    turns = [{"role": "system", "content": "be brief."}, *one, {"role": "assistant", "content": "4."},
             {"role": "user", "content": PROMPTS[1]}]
    text, special = render_messages(tok, turns, "paper")
    assert special and text == (f"be brief.\n\nQuestion: {PROMPTS[0]}\n\nAnswer: 4.\n\nQuestion: {PROMPTS[1]}"
                                "\n\nAnswer:")
    with pytest.raises(Exception, match="assistant message must follow"):
        render_messages(tok, [{"role": "assistant", "content": "x"}, *one], "paper")


NEEDS_COMPILER = pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                                    reason="torch.compile on CPU (inductor) needs a C++ compiler: apt install g++")


@NEEDS_COMPILER
@pytest.mark.slow
def test_compiled_decoding_gives_the_eager_answers(saved, tmp_path):
    """``--compile`` (torch.compile, the prompt cache copied into a static cache) decodes the same greedy tokens as
    the eager path, for a batch of left-padded prompts of mixed lengths."""
    ckpt, _ = saved
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    outputs = {}
    for flags in ([], ["--compile"]):
        out = tmp_path / f"out{len(flags)}.jsonl"
        assert main(["generate", "--checkpoint", str(ckpt), "--input", str(src), "--output", str(out),
                     "--batch-size", "3", "--max-new-tokens", "6", "--device", "cpu", *flags]) == 0
        outputs[tuple(flags)] = [json.loads(line)["output"] for line in out.read_text().splitlines()]
    assert outputs[("--compile",)] == outputs[()] and any(outputs[()])


@NEEDS_COMPILER
@pytest.mark.slow
def test_compiled_decoding_keeps_a_sliding_window():
    """Gemma 3's sliding-window layers (window 4) over prompts longer than the window: the static cache keeps the
    window, and the compiled decode matches the eager one token for token."""
    model = perturb_adapters(tiny_bitune("gemma3"), scale=0.3).merge()
    ids, mask, _, _ = batch(prompt_lens=(9, 6))
    eager = model.generate(ids, mask, max_new_tokens=6, pad_token_id=0, eos_token_id=None)
    compiled = model.generate(ids, mask, max_new_tokens=6, pad_token_id=0, eos_token_id=None, compile=True)
    assert torch.equal(compiled, eager)


def test_compiled_decoding_returns_no_state():
    model = perturbed_bitune()
    ids, mask, _, _ = batch(prompt_lens=(5,))
    with pytest.raises(ValueError, match="return_state"):
        model.generate(ids, mask, max_new_tokens=2, compile=True, return_state=True)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_static_copy_of_the_prompt_cache_decodes_the_same_tokens(arch):
    """What ``compile=True`` decodes from, without the compilation: the mixed prompt cache copied into
    transformers' static cache (Gemma 3's sliding layers, window 4, over prompts longer than it) continues with the
    same greedy tokens as the cache itself."""
    from bitune import cache as kv

    model = perturb_adapters(tiny_bitune(arch), scale=0.3).merge()
    ids, mask, _, _ = batch(prompt_lens=(9, 6))
    with torch.no_grad():
        eager = model.generate(ids, mask, max_new_tokens=6, pad_token_id=0, eos_token_id=None)
        pre = model.prefill(ids, mask)
        input_ids = torch.cat([pre.ids, pre.last_token], 1)
        attention_mask = torch.cat([pre.mask, torch.ones_like(pre.last_token)], 1)
        static = kv.static_copy(pre.cache, model.text_config, input_ids.shape[1] + 6)
        out = model.weights.base.generate(input_ids=input_ids, attention_mask=attention_mask, cache=static,
                                          max_new_tokens=6, pad_token_id=0, eos_token_id=None, do_sample=False)
    assert torch.equal(out[:, input_ids.shape[1]:], eager)


def test_compiled_decoding_without_a_compiler_is_one_clear_error(monkeypatch):
    model = perturbed_bitune()
    ids, mask, _, _ = batch(prompt_lens=(5,))
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(BituneError, match="C\\+\\+ compiler"):
        model.generate(ids, mask, max_new_tokens=2, compile=True)
