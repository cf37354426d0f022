"""The prompt template a checkpoint was trained with is recorded, reused by generate / chat / eval / plot by
default and printed by each; an empty generation is reported; checkpoints are readable by others (umask)."""

from __future__ import annotations

import io
import json
import os
import stat

import pytest

from bitune.checkpoint import CONFIG_FILE
from bitune.cli import main
from bitune.generation import generate_texts, pick_template
from bitune.loading import load_bitune
from helpers.gen import CHAT_TEMPLATE, perturbed_bitune
from helpers.models import tiny_bitune, tiny_model
from helpers.tokenizer import tiny_tokenizer

CHAT_ROWS = [{"messages": [{"role": "user", "content": f"what is {i}+{i}?"},
                           {"role": "assistant", "content": f"it is {2 * i}."}]} for i in range(4)]
PAPER_ROWS = [{"instruction": f"what is {i}+{i}?", "output": f"it is {2 * i}."} for i in range(4)]
PROMPTS = ["what is 2+3?", "name a color."]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A tiny base model folder whose tokenizer has a chat template."""
    path = tmp_path_factory.mktemp("template") / "base"
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tiny_model().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def train(base_dir, tmp_path, rows, name) -> str:
    data = tmp_path / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / name
    assert main(["train", "--set", f"model={base_dir}", "--set", f"dataset={data}", "--set", f"output_dir={out}",
                 "--set", "steps=1", "--set", "grad_accum=1", "--set", "bf16=false",
                 "--set", "max_length=128"]) == 0
    return str(out / "final")


def generate_cli(args, tmp_path, capsys) -> tuple[list[str], str]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    capsys.readouterr()
    assert main(["generate", *args, "--input", str(prompts), "--max-new-tokens", "5", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    return [json.loads(line)["output"] for line in captured.out.splitlines()], captured.err


@pytest.mark.parametrize(("rows", "template"), [(CHAT_ROWS, "chat"), (PAPER_ROWS, "paper")])
def test_training_records_the_data_template_and_generate_reuses_it(base_dir, tmp_path, capsys, rows, template):
    final = train(base_dir, tmp_path, rows, template)
    assert f"bitune train: {template} template (the format of" in capsys.readouterr().out
    assert json.loads((tmp_path / template / "final" / CONFIG_FILE).read_text())["template"] == template
    answers, err = generate_cli(["--checkpoint", final], tmp_path, capsys)
    assert f"bitune generate: {template} template (the template the checkpoint was trained with)" in err
    model, tok = load_bitune(final, device="cpu")
    assert answers == generate_texts(model, tok, PROMPTS, template=template, max_new_tokens=5)
    other = "paper" if template == "chat" else "chat"
    assert answers != generate_texts(model, tok, PROMPTS, template=other, max_new_tokens=5)


def test_a_trained_checkpoint_carries_its_tokenizer_and_its_log_the_versions(base_dir, tmp_path):
    """final/ loads like a transformers folder (AutoTokenizer on it gives the training tokenizer, chat template
    included), and the run's first log record names the package versions that made it."""
    from transformers import AutoTokenizer

    final = train(base_dir, tmp_path, CHAT_ROWS, "tok")
    saved, base = AutoTokenizer.from_pretrained(final), AutoTokenizer.from_pretrained(base_dir)
    assert saved.get_vocab() == base.get_vocab() and saved.chat_template == base.chat_template
    first = json.loads((tmp_path / "tok" / "log.jsonl").read_text().splitlines()[0])
    assert first["event"] == "data" and {"torch", "transformers", "peft", "bitune"} <= set(first["versions"])


def test_old_checkpoint_without_template_reads_as_paper(base_dir, tmp_path, capsys):
    model = perturbed_bitune(str(base_dir))
    model.save_pretrained(tmp_path / "old")
    config = json.loads((tmp_path / "old" / CONFIG_FILE).read_text())
    del config["template"]  # as written before templates were recorded
    (tmp_path / "old" / CONFIG_FILE).write_text(json.dumps(config))
    _, err = generate_cli(["--checkpoint", str(tmp_path / "old")], tmp_path, capsys)
    assert "bitune generate: paper template (the template the checkpoint was trained with)" in err


def test_base_model_defaults_to_its_chat_template(base_dir, tmp_path, capsys):
    answers, err = generate_cli(["--model", str(base_dir)], tmp_path, capsys)
    assert "bitune generate: chat template (the base model has a chat template)" in err
    model, tok = load_bitune(model=str(base_dir), device="cpu")
    assert answers == generate_texts(model, tok, PROMPTS, template="chat", max_new_tokens=5)
    tok.chat_template = None
    assert pick_template(model, tok) == ("paper", "the base model has no chat template")
    assert pick_template(model, tok, "none") == ("none", "as requested")


def test_empty_answers_are_reported(base_dir, tmp_path, capsys):
    (first, _), _ = generate_cli(["--model", str(base_dir)], tmp_path, capsys)
    answers, err = generate_cli(["--model", str(base_dir), f"--stop={first[0]}"], tmp_path, capsys)
    assert answers[0] == ""
    assert "answers are empty (first: prompt 1)" in err or "2 of 2 answers are empty" in err
    capsys.readouterr()
    assert main(["generate", "--model", str(base_dir), "--prompt", PROMPTS[0], f"--stop={first[0]}",
                 "--max-new-tokens", "5", "--device", "cpu"]) == 0
    assert "bitune generate: the answer is empty" in capsys.readouterr().err


def test_chat_uses_and_prints_the_recorded_template(base_dir, tmp_path, monkeypatch, capsys):
    final = train(base_dir, tmp_path, PAPER_ROWS, "paper")  # the tokenizer has a chat template; paper was trained
    monkeypatch.setattr("sys.stdin", io.StringIO("what is 1+1?\n/exit\n"))
    capsys.readouterr()
    assert main(["chat", "--checkpoint", final, "--max-new-tokens", "3", "--device", "cpu",
                 "--save", str(tmp_path / "c.json")]) == 0
    assert "bitune chat: reread mode, paper template (the template the checkpoint was trained with)" in \
        capsys.readouterr().err
    assert json.loads((tmp_path / "c.json").read_text())["template"] == "paper"


def test_eval_scores_a_chat_checkpoint_through_its_chat_template(base_dir, tmp_path, monkeypatch, capsys):
    pytest.importorskip("lm_eval")
    from bitune.data import datasets as data
    from bitune.data.templates import arc_example
    from bitune.eval.evaluate import evaluate_run
    from bitune.eval.lm import BituneLM

    final = train(base_dir, tmp_path, CHAT_ROWS, "chat")
    monkeypatch.setattr(data, "load_examples", lambda name, split, limit=None: [
        arc_example(f"what is {i}+1?", [str(i), str(i + 1)], 1, id=str(i)) for i in range(3)])
    seen = []
    original = BituneLM._loglikelihood_tokens
    monkeypatch.setattr(BituneLM, "_loglikelihood_tokens",
                        lambda self, requests, **kw: seen.extend(requests) or original(self, requests))
    record = evaluate_run(checkpoint=final, tasks="arc_easy", device="cpu")
    assert record["config"]["template"] == "chat"
    assert "bitune eval: chat template (the template the checkpoint was trained with)" in capsys.readouterr().err
    tok = tiny_tokenizer()
    for (ctx, cont), ctx_ids, cont_ids in seen:  # the generation prompt's trailing space stays in the prompt
        assert ctx.startswith("user: Question: what is") and ctx.endswith("</s>\nassistant: ")
        assert ctx_ids == tok(ctx)["input_ids"] and ctx_ids[-1] == tok.convert_tokens_to_ids(" ")
        assert cont_ids == tok(cont, add_special_tokens=False)["input_ids"]
    assert {cont for (_, cont), _, _ in seen} == {str(i) for i in range(4)}  # chat answers: no leading space
    seen.clear()
    assert evaluate_run(checkpoint=final, tasks="arc_easy", device="cpu", template="paper")["config"]["template"] \
        == "paper"
    assert all(ctx.startswith("Question: ") and cont.startswith(" ") for (ctx, cont), _, _ in seen)


def test_checkpoints_follow_the_umask(tmp_path):
    model = tiny_bitune()
    before = os.umask(0o022)
    try:
        model.save_pretrained(tmp_path / "ckpt")
    finally:
        os.umask(before)
    paths = [tmp_path / "ckpt", *(tmp_path / "ckpt").rglob("*")]
    assert any(p.suffix == ".safetensors" for p in paths)
    for p in paths:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode == (0o755 if p.is_dir() else 0o644), (p, oct(mode))
