"""Every checkpoint carries a Hugging Face model card (``README.md``): after ``save_pretrained``, in ``bitune train``'s
``final/`` and ``checkpoint-N`` and in ``BituneSFTTrainer``'s saves; its metadata parses, its commands run, the
results of an ``eval.json`` beside it appear with n and the interval, and a user's own README is never touched.
The card is fit for the Hub: no absolute local path, no file outside the folder named, ``base_model`` the
upstream Hub id of a built-in model, a licence; ``push_to_hub`` uploads a card whose commands name the repository."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import re
import shlex
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml
from huggingface_hub import ModelCard

from bitune import BituneConfig, BituneModel
from bitune.cli import VERBS
from bitune.export import export_merged
from bitune.modelcard import (
    MARKER,
    UPSTREAM,
    Training,
    find_evaluation,
    hub_base,
    is_ours,
    push_to_hub,
    render,
    tags_for,
    write,
)
from bitune.stats import bootstrap_mean
from bitune.train.checkpoints import save_checkpoint as save_training_checkpoint
from bitune.train.checkpoints import verify_checkpoint
from bitune.train.run_folder import checkpoints
from bitune.train.trainer import run_training
from helpers.compare import assert_same_weights, trainable
from helpers.gen import save_checkpoint
from helpers.models import perturb_adapters, tiny_bitune, tiny_model
from helpers.sft import sft_trainer
from helpers.train import make_trainer

USER_README = b"# My model\r\n\nMine, not bitune's: \xff kept byte for byte.\n"
"""A user's own README (CRLF and a byte that is not UTF-8: a rewrite would not reproduce it)."""


def card_of(folder: Path) -> tuple[dict, str]:
    """The card's metadata (as ``huggingface_hub`` reads it) and its text."""
    card = ModelCard.load(folder / "README.md")
    return card.data.to_dict(), card.text


def block(text: str, language: str) -> str:
    """The first fenced code block of ``language``."""
    found = re.search(rf"```{language}\n(.*?)\n```", text, re.S)
    assert found, f"no {language} block in the card"
    return found.group(1)


def same_weights(a: BituneModel, b: BituneModel) -> None:
    assert_same_weights(trainable(a), trainable(b), atol=0)


# ------------------------------------------------------------------------------------------ save_pretrained
def test_save_pretrained_writes_a_card_whose_commands_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt, model = save_checkpoint(tmp_path)
    meta, text = card_of(ckpt)
    # a local base model is no Hub id: no base_model, and a licence bitune cannot know
    assert meta == {"library_name": "bitune", "license": "other", "license_name": "base-model-license",
                    "pipeline_tag": "text-generation", "tags": ["bitune", "peft", "lora"]}
    assert MARKER in text and is_ours(ckpt / "README.md")
    assert "| rank | 8 (lora_alpha 1, dropout 0) |" in text
    assert str(tmp_path) not in text and "local model folder `base`" in text  # no absolute local path
    # the Python block runs as written, on this checkpoint (the local base model filled in, as the card says),
    # and loads the saved weights
    assert 'load_bitune(checkpoint="ckpt", base="BASE_MODEL")' in text
    out = io.StringIO()
    scope: dict = {}
    with contextlib.redirect_stdout(out):
        exec(block(text, "python").replace("BASE_MODEL", str(tmp_path / "base")), scope)  # noqa: S102
    same_weights(scope["model"], model)
    assert isinstance(scope["model"], BituneModel) and scope["model"].merged
    # every command line parses with the verb's real options
    lines = [shlex.split(line, comments=True) for line in block(text, "bash").splitlines()]
    assert [argv[1] for argv in lines] == ["generate", "chat", "serve", "eval"]
    for argv in lines:
        parser = argparse.ArgumentParser(prog=f"bitune {argv[1]}", exit_on_error=False)
        importlib.import_module(VERBS[argv[1]][0]).configure(parser)
        args = parser.parse_args(argv[2:])
        assert Path(args.checkpoint).resolve() == ckpt and args.base == "BASE_MODEL"


@pytest.mark.parametrize("name", sorted(UPSTREAM))
def test_a_builtin_base_is_named_by_its_upstream_hub_id_with_its_licence(name):
    meta = ModelCard(render(BituneConfig(base_model=name))).data.to_dict()
    assert meta["base_model"] == UPSTREAM[name].hub_id and meta["license"] == UPSTREAM[name].license
    assert UPSTREAM[name].hub_id.count("/") == 1
    from bitune.hub import BUILTIN_MODELS

    assert set(UPSTREAM) == set(BUILTIN_MODELS)  # every built-in model has its upstream


def test_a_card_shows_no_absolute_local_path(tmp_path, monkeypatch):
    data = tmp_path / "home" / "me" / "my_chats.jsonl"
    settings = {"dataset": str(data), "output_dir": str(tmp_path / "runs" / "x"), "steps": 4,
                "model": str(tmp_path / "models" / "mine")}
    training = Training(settings=settings, datasets=(str(data),), step=4)
    monkeypatch.chdir(tmp_path)
    text = render(BituneConfig(base_model=str(tmp_path / "models" / "mine")), tmp_path / "runs" / "x" / "final",
                  training)
    assert str(tmp_path) not in text
    assert yaml.safe_load(block(text, "yaml")) == {"dataset": "my_chats.jsonl", "output_dir": "x", "steps": 4,
                                                  "model": "mine"}
    assert '--checkpoint runs/x/final' in text  # relative to where the user works
    elsewhere = render(BituneConfig(base_model="smollm2-135m"), "/somewhere/else/final")
    assert "/somewhere" not in elsewhere and "--checkpoint final " in elsewhere
    assert hub_base("org/model") == "org/model" and hub_base(str(tmp_path)) is None and hub_base(None) is None


def test_a_card_names_variant_method_and_rank():
    assert tags_for(BituneConfig(variant="lora", rank=16)) == ["bitune", "peft", "lora"]
    assert tags_for(BituneConfig(variant="no_mixing", method="dora"), ["trl"]) == ["bitune", "peft", "dora",
                                                                                  "no_mixing", "trl"]
    assert tags_for(BituneConfig(method="full")) == ["bitune", "full-fine-tuning"]
    text = render(BituneConfig(variant="shared_weights", method="dora", rank=4, base_model="smollm2-135m",
                               template="chat"))
    assert text.startswith("---\nbase_model: HuggingFaceTB/SmolLM2-135M-Instruct\n")
    assert "# shared_weights (dora r4) on smollm2-135m" in text and "| rank | 4 " in text
    assert "| prompt template | `chat`:" in text and 'template="chat"' in text
    ia3 = render(BituneConfig(method="ia3", base_model="smollm2-135m"))
    assert "# bitune (ia3) on smollm2-135m" in ia3 and "| rank |" not in ia3


def test_a_user_readme_is_kept_byte_for_byte_and_ours_is_rewritten(tmp_path):
    ckpt, model = save_checkpoint(tmp_path)
    (ckpt / "README.md").write_bytes(USER_README)
    model.save_pretrained(ckpt)  # the folder is replaced: the user's README comes along, untouched
    assert (ckpt / "README.md").read_bytes() == USER_README
    same_weights(BituneModel.from_pretrained(ckpt), model)  # loads with the README present
    # a card that says library_name: bitune but lacks the marker is the user's (an edited card)
    edited = (tmp_path / "edited.md")
    edited.write_text(render(model.config).replace(MARKER, "<!-- my edits -->"))
    (ckpt / "README.md").write_bytes(edited.read_bytes())
    model.save_pretrained(ckpt)
    assert (ckpt / "README.md").read_bytes() == edited.read_bytes()
    # our own card is rewritten: another config gives another card
    (ckpt / "README.md").unlink()
    model.save_pretrained(ckpt)
    assert "# bitune (lora r8)" in card_of(ckpt)[1]
    lora = tiny_bitune(variant="lora", rank=4, base_model=str(tmp_path / "base"))
    lora.save_pretrained(ckpt)
    assert "# lora (lora r4)" in card_of(ckpt)[1] and not (ckpt / "bidir").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "ckpt", "edited.md"]  # no temporary files


# ------------------------------------------------------------------------------------------ eval.json
def eval_record(checkpoint: Path, samples: bool) -> dict:
    """A ``bitune eval`` result for ``checkpoint``: arc_challenge with its per-question table (or without),
    piqa with the stderr only."""
    correct = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    record = {"schema": "bitune-eval/1", "label": "bitune",
              "tasks": {"arc_challenge": {"acc": 0.625, "acc_stderr": 0.17, "n": 8},
                        "piqa": {"acc": 0.7, "acc_stderr": 0.0145, "n": 1000}},
              "config": {"checkpoint": str(checkpoint.resolve()), "limit": 8, "template": "paper"},
              "created": "2026-01-02T03:04:05+00:00"}
    if samples:
        record["samples"] = {"arc_challenge": {"doc_id": list(range(8)), "acc": correct}}
    return record


def test_eval_results_appear_with_n_and_interval(tmp_path):
    ckpt, model = save_checkpoint(tmp_path / "run")
    final = ckpt.parent / "final"
    model.save_pretrained(final)
    assert "## Evaluation" not in card_of(final)[1]
    (final.parent / "eval.json").write_text(json.dumps(eval_record(final, samples=True)))  # where bitune eval puts it
    model.save_pretrained(final)
    text = card_of(final)[1]
    ci = bootstrap_mean(eval_record(final, True)["samples"]["arc_challenge"]["acc"])
    assert f"| arc_challenge | acc | 62.5 | [{100 * ci.low:.1f}, {100 * ci.high:.1f}] | 8 | bootstrap |" in text
    assert "| piqa | acc | 70.0 | [67.2, 72.8] | 1000 | normal |" in text  # 0.7 +- 1.96 * 0.0145
    assert "../eval.json" not in text and "the run's `eval.json`, not in this folder" in text  # no dangling link
    assert "2026-01-02T03:04:05+00:00" in text and "first 8 questions" in text
    # the run folder's eval.json is final/'s: another checkpoint of the run does not show it
    model.save_pretrained(ckpt.parent / "checkpoint-2")
    assert "## Evaluation" not in card_of(ckpt.parent / "checkpoint-2")[1]


def test_eval_json_inside_the_folder(tmp_path):
    ckpt, model = save_checkpoint(tmp_path)
    (ckpt / "eval.json").write_text(json.dumps(eval_record(ckpt, samples=False)))
    assert write(ckpt, model.config)  # a card refreshed in place (as TRL's saves write theirs)
    text = card_of(ckpt)[1]
    assert "| arc_challenge | acc | 62.5 | [29.2, 95.8] | 8 | normal |" in text and "this folder's `eval.json`" in text
    model.save_pretrained(ckpt)  # a new checkpoint replaces the folder, the old eval.json with it
    assert not (ckpt / "eval.json").exists() and "## Evaluation" not in card_of(ckpt)[1]
    (tmp_path / "eval.json").write_text("{not json")  # a broken file never stops a save
    assert find_evaluation(ckpt) is None
    model.save_pretrained(ckpt)


# ------------------------------------------------------------------------------------------ bitune train
def test_bitune_train_writes_cards_in_final_and_checkpoints(tmp_path):
    trainer, settings = make_trainer(tmp_path, steps=4, save_every=2, save_total_limit=None,
                                     bitune={"variant": "bitune", "base_model": "tiny"})  # as bitune train records it
    run_training(trainer, settings)
    run_dir = tmp_path / "run"
    assert [p.name for p in checkpoints(run_dir)] == ["checkpoint-2", "checkpoint-4"]
    assert not [p for p in run_dir.iterdir() if p.name.startswith(".")]  # no staging leftovers
    for folder, step in ((run_dir / "checkpoint-2", 2), (run_dir / "checkpoint-4", 4), (run_dir / "final", 4)):
        meta, text = card_of(folder)
        assert meta["library_name"] == "bitune" and "base_model" not in meta and meta["datasets"] == ["tiny"]
        assert meta["pipeline_tag"] == "text-generation" and meta["tags"] == ["bitune", "peft", "lora"]
        assert f"Trained with `bitune train`, saved at step {step}," in text
        # the run's settings.yaml, its absolute paths by their names
        assert yaml.safe_load(block(text, "yaml")) == {**settings.to_dict(), "output_dir": "run"}
        assert f'load_bitune(checkpoint="{folder.name}", base="BASE_MODEL")' in text and ".staging" not in text  # the final path's name
        assert str(tmp_path) not in text
    loaded = BituneModel.from_pretrained(run_dir / "final", base=tiny_model())
    same_weights(loaded, trainer.model)


def test_a_user_readme_in_a_checkpoint_folder_is_kept(tmp_path):
    trainer, settings = make_trainer(tmp_path, steps=2, save_every=2)
    run_training(trainer, settings)
    run_dir = tmp_path / "run"
    for name in ("checkpoint-2", "final"):
        (run_dir / name / "README.md").write_bytes(USER_README)
    trainer.save_weights(run_dir / "final")  # what bitune train saves final/ with
    save_training_checkpoint(run_dir, 2, trainer.model, trainer.optimizer, trainer.scheduler, asdict(trainer.state),
                             trainer.accelerator, None, training=trainer.training_record())  # through the staging
    for name in ("checkpoint-2", "final"):
        assert (run_dir / name / "README.md").read_bytes() == USER_README
    verify_checkpoint(run_dir / "checkpoint-2", tiny_bitune(config=trainer.model.config))


# ------------------------------------------------------------------------------------------ TRL
def test_trl_saves_write_bitune_cards_and_keep_a_user_readme(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_bytes(USER_README)
    model = perturb_adapters(tiny_bitune(base_model="tiny-base"))
    trainer = sft_trainer(str(out), model=model, max_steps=2, save_strategy="steps", save_steps=2)
    trainer.train()  # TRL writes a card into output_dir before each checkpoint: ours, and not over the user's
    trainer.save_model()
    assert (out / "README.md").read_bytes() == USER_README
    trainer.save_model(str(tmp_path / "final"))
    for folder in (out / "checkpoint-2", tmp_path / "final"):
        meta, text = card_of(folder)
        assert meta["library_name"] == "bitune" and meta["pipeline_tag"] == "text-generation"
        assert meta["tags"] == ["bitune", "peft", "lora", "trl", "sft"] and "base_model" not in meta  # a local name, no Hub id
        assert "Trained with `BituneSFTTrainer (TRL " in text and "saved at step 2" in text
        settings = yaml.safe_load(block(text, "yaml"))
        assert settings["learning_rate"] == 1e-2 and settings["max_steps"] == 2 and settings["processes"] == 1
        same_weights(BituneModel.from_pretrained(folder, base=tiny_model()), trainer.bitune_model)
    (out / "README.md").unlink()
    trainer.create_model_card(dataset_name="me/my-data", tags=["mine"])  # what push_to_hub calls
    meta, text = card_of(out)
    assert meta["datasets"] == ["me/my-data"] and meta["tags"][-1] == "mine" and MARKER in text
    assert "pipeline(" not in text  # not TRL's card, whose transformers pipeline cannot load a Bitune checkpoint


@pytest.mark.parametrize("readme", [None, "ours"])
def test_trl_save_rewrites_only_its_own_card(tmp_path, readme):
    trainer = sft_trainer(str(tmp_path / "out"), max_steps=1)
    final = tmp_path / "final"
    final.mkdir()
    if readme == "ours":
        (final / "README.md").write_text(render(BituneConfig(variant="lora")))
    trainer.save_model(str(final))
    assert is_ours(final / "README.md") and "# bitune (lora r8)" in card_of(final)[1]


def test_an_export_carries_the_card_of_its_checkpoint(tmp_path):
    _, model = save_checkpoint(tmp_path)
    export_merged(model, tmp_path / "export")  # built in a temporary folder, renamed into place
    meta, text = card_of(tmp_path / "export" / "bitune")
    assert meta["library_name"] == "bitune" and 'load_bitune(checkpoint="bitune", base="BASE_MODEL")' in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "ckpt", "export"]


def test_bitune_export_keeps_the_training_section_of_the_checkpoint_card(tmp_path):
    from bitune.cli import main

    ckpt, model = save_checkpoint(tmp_path)
    write(ckpt, model.config, Training(settings={"lr": 0.001, "steps": 4}, step=4))  # what a training run's save writes
    assert main(["export", "--checkpoint", str(ckpt), "--merged", str(tmp_path / "export")]) == 0
    _, text = card_of(tmp_path / "export" / "bitune")
    assert "## Training" in text and "Trained with `bitune train`, saved at step 4" in text and "lr: 0.001" in text


def test_a_merged_export_says_first_that_alone_it_is_not_the_trained_model(tmp_path):
    """transformers users load the export's top folder: its card says what it is before anything else, its config
    names no stale source folder, a re-export rewrites the card, and a user's own README is never written over."""
    _, model = save_checkpoint(tmp_path)
    out = export_merged(model, tmp_path / "export")
    meta, text = card_of(out)
    assert meta["library_name"] == "transformers" and "bitune-merged-export" in meta["tags"]
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip() and not p.strip().startswith("<!--")]
    assert paragraphs[0].startswith("# The decoding half of a Bitune model")
    assert paragraphs[1].startswith("**Loaded alone, this folder is not the trained model.**")
    config = json.loads((out / "config.json").read_text())
    assert not [v for k, v in config.items() if "name_or_path" in k and v]
    assert str(tmp_path / "base") not in (out / "config.json").read_text()
    assert is_ours(out / "README.md")
    (out / "README.md").write_text("# my notes\n")
    export_merged(model, out, keep=("README.md",))  # what bitune export passes for a user's own README
    assert (out / "README.md").read_text() == "# my notes\n"


# ------------------------------------------------------------------------------------------ the Hub
def test_push_to_hub_uploads_a_card_for_the_repository_with_its_eval(tmp_path, monkeypatch):
    """One commit: the checkpoint's files, the run's eval.json as ``eval.json``, and a card whose commands
    download the repository (the Hub is not reachable here: the commit is captured)."""
    from huggingface_hub import HfApi

    ckpt, model = save_checkpoint(tmp_path / "run")
    final = ckpt.parent / "final"
    model.save_pretrained(final)
    (final.parent / "eval.json").write_text(json.dumps(eval_record(final, samples=True)))
    model.save_pretrained(final)
    local_card = (final / "README.md").read_bytes()
    calls = {}
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: calls.setdefault("repo", (repo_id, kw)))

    def commit(self, repo_id, operations, **kw):
        calls["files"] = {op.path_in_repo: op.path_or_fileobj for op in operations}
        return type("Info", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/0"})()

    monkeypatch.setattr(HfApi, "create_commit", commit)
    url = push_to_hub(final, "me/my-bitune", private=True)
    assert url.startswith("https://huggingface.co/me/my-bitune") and calls["repo"] == ("me/my-bitune",
                                                                                     {"private": True,
                                                                                      "exist_ok": True})
    files = calls["files"]
    on_disk = {p.relative_to(final).as_posix() for p in final.rglob("*") if p.is_file()}
    assert set(files) == on_disk | {"eval.json"}
    assert Path(files["eval.json"]) == final.parent / "eval.json"
    card = files["README.md"].decode()
    assert 'snapshot_download("me/my-bitune")' in card and "hf download me/my-bitune --local-dir" in card
    assert "this folder's `eval.json`" in card and "| arc_challenge | acc | 62.5 |" in card
    assert str(tmp_path) not in card and ModelCard(card).data.library_name == "bitune"
    assert (final / "README.md").read_bytes() == local_card  # the local folder is unchanged
    with pytest.raises(ValueError, match="not a Hub id"):
        push_to_hub(final, "not a repo")
    (final / "README.md").write_bytes(USER_README)  # a user's own card goes up as it is
    push_to_hub(final, "me/my-bitune")
    assert calls["files"]["README.md"] == USER_README


# ------------------------------------------------------------------------------------------ the package
def test_the_card_is_rendered_apart_from_files_and_the_hub():
    """One job per module: rendering reads and writes no file and knows no Hub client (so a card can be rendered
    anywhere); every public name still imports from ``bitune.modelcard``."""
    import ast
    import importlib

    import bitune.modelcard as modelcard

    text = Path(importlib.import_module("bitune.modelcard.text").__file__).read_text(encoding="utf-8")
    imported = {n.module for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ImportFrom)}
    assert not imported & {"files", "hub", "..files"} and "HfApi" not in text and "write_text" not in text
    for name in ("CARD_FILE", "MARKER", "EXPORT_MARKER", "UPSTREAM", "Training", "Evaluation", "Score", "render",
                 "render_export", "find_evaluation", "is_ours", "write", "write_card", "refresh_evaluation",
                 "push_to_hub", "hub_base", "tags_for", "shown_path"):
        assert name in modelcard.__all__ and getattr(modelcard, name) is not None
