"""``bitune generate``: prompts read as in training, batching, streaming, stop strings, base models."""

from __future__ import annotations

import json

import pytest
import torch
from eval_helpers import tiny_tokenizer
from gen_helpers import save_checkpoint, tiny_bitune

from bitune.cli import main
from bitune.data.collate import tokenize_example
from bitune.data.templates import instruction_example
from bitune.generation import encode, generate_texts, render

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
    tok, model = tiny_tokenizer(), tiny_bitune()
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
    tok, model = tiny_tokenizer(), tiny_bitune()
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
    for bad in ('{"prompt": ""}', '{"prompt": 5}', '{"instruction": "   "}', '{"text": "x"}', "not json"):
        (tmp_path / "bad.jsonl").write_text('{"prompt": "fine"}\n' + bad + "\n")
        cases.append(["--input", str(tmp_path / "bad.jsonl"), "--output", str(tmp_path / "out.jsonl")])
    for extra in cases:
        assert main(["generate", "--checkpoint", str(ckpt), "--device", "cpu", *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("bitune generate: error:"), err
    assert not (tmp_path / "out.jsonl").exists()
