"""Training settings: YAML + overrides, validation messages that name the problem, the shipped configs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bitune.cli import main
from bitune.config_files import PACKAGED
from bitune.errors import BituneError
from bitune.train.settings import TrainSettings, field_docs, load_settings

CONFIGS = PACKAGED


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_yaml_and_dotted_overrides(tmp_path):
    cfg = write(tmp_path / "a.yaml", "dataset: piqa\nlr: 1e-3\nbitune:\n  variant: lora\n  rank: 4\n")
    s = load_settings(cfg, ["bitune.rank=16", "steps=5", "eval_split=null", "output_dir=out/{variant}-r{rank}"])
    assert s.lr == 1e-3 and isinstance(s.lr, float)  # YAML 1.1 reads "1e-3" as text: converted
    assert (s.bitune.variant, s.bitune.rank, s.steps, s.eval_split) == ("lora", 16, 5, None)
    assert s.output_dir == "out/lora-r16"


def test_prompt_passes_is_a_run_setting_also_read_from_the_old_bitune_section(tmp_path):
    assert load_settings(None, ["prompt_passes=sequential"]).prompt_passes == "sequential"
    old = write(tmp_path / "old.yaml", "bitune:\n  variant: bitune\n  prompt_passes: batched\n")
    s = load_settings(old)
    assert s.prompt_passes == "batched" and "prompt_passes" not in s.to_dict()["bitune"]
    assert TrainSettings.from_dict({"bitune": {"prompt_passes": "fused"}}).prompt_passes == "fused"
    with pytest.raises(BituneError, match="bitune.prompt_passes='batched' and prompt_passes='fused' disagree"):
        load_settings(old, ["prompt_passes=fused"])
    with pytest.raises(BituneError, match="prompt_passes='parallel' is not one of"):
        load_settings(None, ["prompt_passes=parallel"])


def test_gradient_checkpointing_is_read_as_recompute_with_a_deprecation_warning(tmp_path):
    old = write(tmp_path / "old.yaml", "gradient_checkpointing: true\n")
    with pytest.warns(DeprecationWarning, match="gradient_checkpointing is now called recompute"):
        s = load_settings(old)
    assert s.recompute is True and "gradient_checkpointing" not in s.to_dict()
    with pytest.warns(DeprecationWarning):
        assert load_settings(None, ["gradient_checkpointing=true", "recompute=true"]).recompute is True
    with pytest.raises(BituneError, match="gradient_checkpointing=True and recompute=False disagree"):
        load_settings(old, ["recompute=false"])
    assert load_settings(None, ["recompute=true"]).recompute is True


def test_extends_merges_sections(tmp_path):
    write(tmp_path / "base.yaml", "lr: 0.1\nsteps: 7\nbitune:\n  rank: 4\n  theta_init: 0.1\n")
    child = write(tmp_path / "child.yaml", "extends: base.yaml\nsteps: 9\nbitune:\n  rank: 2\n")
    s = load_settings(child)
    assert (s.lr, s.steps, s.bitune.rank, s.bitune.theta_init) == (0.1, 9, 2, 0.1)


def test_several_configs_merge_in_order():
    s = load_settings([CONFIGS / "tasks" / "piqa.yaml", CONFIGS / "methods" / "lora16.yaml"])
    assert (s.dataset, s.lr, s.bitune.variant, s.bitune.rank) == ("piqa", 1e-3, "lora", 16)
    assert s.output_dir == "runs/piqa/lora16-s42"


@pytest.mark.parametrize("override, names", [
    ("lrr=1", ["'lrr'", "did you mean 'lr'", "allowed: model"]),
    ("bitune.rnak=4", ["'bitune.rnak'", "did you mean 'bitune.rank'", "theta_init"]),
    ("bitune.variant=bidir", ["variant", "'bitune'", "'naive_bidir'"]),
    ("steps=ten", ["steps", "int"]),
    ("batch_size=0", ["batch_size"]),
    ("bf16=maybe", ["bf16", "'auto'"]),
    ("warmup_ratio=1.5", ["warmup_ratio"]),
    ("eval_every=10", ["eval_every", "eval_split"]),
    ("bitune.base_model=gemma3-270m", ["bitune.base_model", "model="]),
    ("output_dir=runs/{model}", ["output_dir", "{dataset}"]),
    ("lr", ["key=value"]),
    ("epochs=-1", ["epochs must be > 0", "-1"]),
    ("max_grad_norm=-0.5", ["max_grad_norm must be >= 0", "-0.5"]),
    ("weight_decay=nan", ["weight_decay"]),
    ("init_share=0.1", ["'init_share'", "did you mean 'bitune.init_share'"]),  # a model setting outside its section
])
def test_invalid_settings_are_named(override, names):
    with pytest.raises(BituneError) as e:
        load_settings(None, [override])
    for name in names:
        assert name in str(e.value)


def test_a_wrong_epochs_is_refused_also_when_steps_overrides_it():
    with pytest.raises(BituneError, match="epochs must be > 0, got 0"):
        load_settings(None, ["steps=10", "epochs=0"])


def test_bad_yaml_files(tmp_path):
    with pytest.raises(BituneError, match="not found"):
        load_settings(tmp_path / "missing.yaml")
    with pytest.raises(BituneError, match="not valid YAML"):
        load_settings(write(tmp_path / "bad.yaml", "lr: [1,\n"))
    with pytest.raises(BituneError, match="mapping"):
        load_settings(write(tmp_path / "list.yaml", "- 1\n- 2\n"))
    with pytest.raises(BituneError, match="holds no settings"):  # not "train on every default"
        load_settings(write(tmp_path / "empty.yaml", "# nothing yet\n"))
    with pytest.raises(BituneError, match="cycle"):
        load_settings(write(tmp_path / "loop.yaml", "extends: loop.yaml\n"))


def test_every_field_has_a_docstring():
    docs = field_docs(TrainSettings)
    assert set(docs) == {f for f in TrainSettings.__dataclass_fields__}
    assert all(docs.values())


@pytest.mark.parametrize("path", sorted(p for p in CONFIGS.rglob("*.yaml") if p.parent.name != "accelerate"),
                         ids=lambda p: str(p.relative_to(CONFIGS)))
def test_shipped_config_validates(path):
    s = load_settings(path)
    assert s.model and s.dataset and "{" not in s.output_dir


def test_paper_hyperparameters_in_configs():
    uf = load_settings(CONFIGS / "instruct" / "ultrafeedback.yaml")
    assert (uf.lr, uf.steps, uf.batch_size, uf.grad_accum, uf.warmup_ratio) == (3e-4, 3000, 1, 10, 0.1)
    assert (uf.bitune.rank, uf.bitune.lora_alpha, uf.bitune.theta_init) == (8, 1.0, 0.01)
    for task in ("piqa", "arc_challenge", "csqa", "siqa", "gsm8k"):
        s = load_settings(CONFIGS / "tasks" / f"{task}.yaml")
        assert (s.dataset, s.lr, s.max_length) == (task, 1e-3, 512)
    assert load_settings(CONFIGS / "tasks" / "gsm8k.yaml").steps == 747


def test_cli_typo_is_one_line_error(tmp_path, capsys):
    cfg = write(tmp_path / "typo.yaml", "dataset: piqa\nlearning_rate: 1e-3\n")
    assert main(["train", "--config", str(cfg), "--set", f"output_dir={tmp_path}/run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "learning_rate" in err
    assert not (tmp_path / "run").exists()


def test_cli_dry_run_prints_resolved_settings(capsys):
    assert main(["train", "--config", str(CONFIGS / "quickstart.yaml"), "--set", "seed=7", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "seed: 7" in out and "output_dir: runs/quickstart/bitune-s7" in out


def test_cli_dry_run_refuses_a_finished_run_folder_as_the_run_does(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "log.jsonl").write_text("{}\n")
    assert main(["train", "--set", f"output_dir={run}", "--dry-run"]) == 2
    assert "already holds a training run" in capsys.readouterr().err
    assert main(["train", "--set", f"output_dir={run}", "--dry-run", "--resume"]) == 2  # finished: not resumable
    assert "holds a finished run" in capsys.readouterr().err
    assert sorted(p.name for p in run.iterdir()) == ["final", "log.jsonl"]  # and nothing written


def test_a_config_is_a_local_file_first_else_the_packaged_one_of_that_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an empty folder, as after 'pip install bitune'
    named = [load_settings(n) for n in ("methods/lora16", "methods/lora16.yaml", "configs/methods/lora16.yaml")]
    assert all(s == named[0] for s in named) and named[0].bitune.rank == 16
    s = load_settings(["tasks/piqa", "methods/lora16"])  # tasks/piqa extends base.yaml inside the package
    assert (s.dataset, s.lr, s.max_length, s.bitune.rank) == ("piqa", 1e-3, 512, 16)
    (tmp_path / "methods").mkdir()
    write(tmp_path / "methods" / "lora16.yaml", "bitune:\n  variant: lora\n  rank: 3\n")
    assert load_settings("methods/lora16").bitune.rank == 3  # the local file wins
    with pytest.raises(BituneError, match="nor a packaged config .did you mean the packaged config methods/lora16"):
        load_settings("methods/lora61")


def test_configs_list_names_and_copy_edits_a_packaged_config(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["configs", "list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert {"methods/bitune", "tasks/piqa", "accelerate/fsdp", "study/part4/csqa", "quickstart"} <= set(listed)
    assert main(["configs", "copy", "tasks/piqa", "mine.yaml"]) == 0
    copy = tmp_path / "mine.yaml"
    assert load_settings(copy) == load_settings("tasks/piqa")  # its 'extends' still reaches the packaged base
    write(copy, copy.read_text() + "seed: 7\n")
    assert main(["configs", "copy", "tasks/piqa", "mine.yaml"]) == 2  # never replaces the edited copy
    assert "already exists" in capsys.readouterr().err and load_settings(copy).seed == 7
    assert main(["configs", "copy", "methods/bitune", "."]) == 0 and (tmp_path / "bitune.yaml").is_file()
    assert main(["configs", "copy", "methods/bitun", "x.yaml"]) == 2
    assert "did you mean methods/bitune" in capsys.readouterr().err and not (tmp_path / "x.yaml").exists()
    assert main(["configs", "copy", "methods/lora", "newdir/"]) == 2  # a folder that is not there: no file 'newdir'
    assert "no such folder" in capsys.readouterr().err and not (tmp_path / "newdir").exists()


def test_a_built_wheel_ships_the_configs_and_runs_the_documented_commands_from_an_empty_folder(tmp_path):
    """Build the wheel from a copy of the sources, install it (no dependencies: they are this venv's) into a fresh
    venv and run the guides' commands from an empty folder, as a user of a package index would (about 5 s)."""
    root, src = Path(__file__).resolve().parents[1], tmp_path / "src"
    shutil.copytree(root / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = subprocess.run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, capture_output=True, text=True).stdout.strip()
    deps = [p for p in sys.path if p.endswith("site-packages")]  # torch & co. from this venv, not bitune's source
    (Path(purelib) / "_deps.pth").write_text("\n".join(deps) + "\n")
    (wheel,) = (tmp_path / "dist").glob("bitune-*.whl")
    subprocess.run([*pip, "--python", str(venv / "bin" / "python"), "install", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True)
    empty = tmp_path / "empty"
    empty.mkdir()

    def bitune(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([venv / "bin" / "bitune", *argv], cwd=empty, capture_output=True, text=True,
                              env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)})

    where = bitune("configs", "copy", "methods/bitune", "where.yaml")
    assert where.returncode == 0, where.stderr
    for config in (["methods/bitune.yaml"], ["configs/tasks/piqa.yaml", "configs/methods/lora16.yaml"],
                   ["quickstart"], ["study/part4/csqa"], ["where.yaml"]):
        done = bitune("train", *(a for c in config for a in ("--config", c)), "--set", "output_dir=run", "--dry-run")
        assert done.returncode == 0, (config, done.stderr)
    assert "lora16" in bitune("configs", "list").stdout
    assert "site-packages/bitune/" in subprocess.run(
        [venv / "bin" / "python", "-c", "import bitune.config_files as c; print(c.PACKAGED)"], cwd=empty,
        capture_output=True, text=True).stdout  # the wheel's copy, not this checkout's


def test_cli_help_lists_every_setting(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for name in [*TrainSettings.__dataclass_fields__, "bitune.theta_init", "--resume", "--set"]:
        assert name in out


def test_cli_rejects_unknown_dataset_and_split_before_running(tmp_path, capsys):
    from bitune.cli import main

    for override, needle in (("dataset=nope", "dataset='nope'"), ("train_split=tset", "train_split='tset'")):
        rc = main(["train", "--config", "configs/quickstart.yaml", "--set", override,
                   "--set", f"output_dir={tmp_path}/run", "--dry-run"])
        assert rc == 2
        assert needle in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_cli_checks_a_local_data_file_row_by_row_before_running(tmp_path, capsys):
    from bitune.cli import main

    (tmp_path / "bad.jsonl").write_text('{"instruction": "a", "output": "b"}\n{"instruction": "c"}\n')
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "good.jsonl").write_text('{"instruction": "a", "output": "b"}\n')
    for name, needle in (("bad.jsonl", "row 2 field 'output' is missing"), ("empty.jsonl", "is empty"),
                         ("missing.jsonl", "does not exist")):
        rc = main(["train", "--config", "configs/quickstart.yaml", "--set", f"dataset={tmp_path / name}",
                   "--set", f"output_dir={tmp_path}/run", "--dry-run"])
        assert rc == 2
        assert needle in capsys.readouterr().err
    assert main(["train", "--config", "configs/quickstart.yaml", "--set", f"dataset={tmp_path / 'good.jsonl'}",
                 "--dry-run"]) == 0
    assert not (tmp_path / "run").exists()
