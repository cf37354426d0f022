"""Committed studies: ``bitune report`` on the committed eval files reproduces the committed report exactly.

Tests that read a study's README prose (its sentences, not its generated blocks) carry the ``study`` marker and
stay out of the default run: ``pytest -m study tests/test_results.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from bitune.eval.report import (
    SETTINGS_FILE,
    build_markdown,
    find_results,
    find_settings,
    load_records,
    read_settings,
)
from helpers.scripts import load_script

RESULTS = Path(__file__).resolve().parents[1] / "results"
STUDIES = sorted(p.parent for p in RESULTS.glob("*/report.md"))


def test_the_committed_studies_are_all_reproduced():
    """The studies the README cites are the ones the tests below reproduce (a missing or renamed report would
    otherwise drop out of the parametrization silently)."""
    assert {"smollm2-arc-csqa", "gemma3-csqa"} <= {p.name for p in STUDIES}, f"reports under {RESULTS}: {STUDIES}"
    for study in STUDIES:  # its method order and fair baselines are the study's, not the library's defaults
        assert (study / SETTINGS_FILE).is_file(), f"{study} has no {SETTINGS_FILE}"


@pytest.mark.parametrize("study", STUDIES, ids=lambda p: p.name)
def test_report_reproduces_from_the_committed_eval_files(study):
    records = load_records(find_results([str(study)]))
    _, markdown, tasks = build_markdown(records, settings=find_settings([study])[0])
    assert markdown == (study / "report.md").read_text(encoding="utf-8")
    assert tasks, "the committed runs carry per-question results"
    for task in tasks.values():
        assert task.limit is None  # evaluated on the full split


@pytest.mark.parametrize("study", STUDIES, ids=lambda p: p.name)
def test_study_readme_shows_exactly_the_committed_report(study):
    from bitune.eval.report import EMBED_BEGIN, EMBED_END, embedded

    text = (study / "README.md").read_text(encoding="utf-8")
    block = text[text.index(EMBED_BEGIN) + len(EMBED_BEGIN):text.index(EMBED_END)]
    assert block == "\n" + embedded((study / "report.md").read_text(encoding="utf-8"))


README = RESULTS.parent / "README.md"
README_STUDY = RESULTS / "qwen2.5-arc-easy-csqa"
"""The study whose summary the README shows: part 4, the paper's protocol (``bitune report
results/qwen2.5-arc-easy-csqa --output results/qwen2.5-arc-easy-csqa --embed-summary README.md``)."""


def test_readme_summary_reproduces_from_its_study():
    """The README's evidence table is the summary of the committed runs, with the full report linked."""
    from bitune.eval.report import SUMMARY_BEGIN, SUMMARY_END, analyse, build_summary, embedded

    text = README.read_text(encoding="utf-8")
    block = text[text.index(SUMMARY_BEGIN) + len(SUMMARY_BEGIN):text.index(SUMMARY_END)]
    full = f"results/{README_STUDY.name}/report.md"
    records = load_records(find_results([str(README_STUDY)]))
    summary = build_summary(analyse(records, settings=find_settings([README_STUDY])[0]), source=f"[{full}]({full})")
    assert block == "\n" + embedded(summary)


PART3 = RESULTS / "smollm2-csqa-piqa-siqa"


def _log(path: Path) -> tuple[str | None, list[str]]:
    """A run's recorded source commit and its per-step batch digests."""
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    commit = next((r["commit"] for r in records if r.get("event") == "data"), None)
    return commit, [d for r in records for d in r.get("batches", [])]


def _pinned_runs(study: Path, pattern: str) -> dict[tuple[str, str], dict[str, list[str]]]:
    """Every finished run's batch digests under ``study`` (its ``log.jsonl`` files matching ``pattern``), by
    (dataset, seed) and then by the run's folder without its seed (``"csqa/lora"``), after checking that each run
    trained at the commit in the study's COMMIT and recorded a digest for every step; skips when none has
    finished."""
    pin = (study / "COMMIT").read_text().strip()
    logs = sorted(p for p in study.glob(pattern) if (p.parent / "eval.json").is_file())
    if not logs:
        pytest.skip(f"{study.name} has no finished training run yet")
    runs: dict[tuple[str, str], dict[str, list[str]]] = {}
    for path in logs:
        commit, batches = _log(path)
        assert commit == pin, f"{path}: trained at {commit}, not the pinned {pin}"
        settings = yaml.safe_load((path.parent / "settings.yaml").read_text())
        assert len(batches) == settings["steps"], f"{path}: {len(batches)} batch digests for {settings['steps']} steps"
        method, seed = path.parent.name.rsplit("-", 1)
        runs.setdefault((settings["dataset"], seed), {})[f"{path.parent.parent.relative_to(study)}/{method}"] = batches
    return runs


def test_study_part3_runs_come_from_the_pinned_commit_and_share_batches():
    """Part 3's promise: every trained run from the commit in COMMIT, and per task and seed LoRA r8, LoRA r16 and
    Bitune take the same batches step for step, lora_compute the same sequence continued, lora_repeat the first
    200 steps' batches again."""
    runs = _pinned_runs(PART3, "*/*-*/log.jsonl")
    for (task, seed), named in runs.items():
        methods = {name.rsplit("/", 1)[1]: batches for name, batches in named.items()}  # "csqa/lora" -> "lora"
        reference = methods.get("lora") or methods.get("bitune")
        for method, batches in methods.items():
            if method == "lora_repeat":
                expected = (reference * (len(batches) // len(reference) + 1))[:len(batches)]
            else:
                expected = reference[:len(batches)] + batches[len(reference):]  # a longer run continues it
            assert batches == expected, f"{task}/{method}-{seed} drew other batches than {task}/lora-{seed}"


AGREEMENT = Path(__file__).resolve().parents[1] / "scripts" / "study_agreement.py"


def _agreement(*args: str) -> str:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(AGREEMENT), *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_agreement_counts_questions_answered_differently(tmp_path):
    """scripts/study_agreement.py compares the highest-scoring choices question by question, wrong answers too."""
    def run(name, answers):
        (tmp_path / name).mkdir()
        loglik = [[0.0 if i == a else -1.0 for i in range(3)] for a in answers]
        record = {"samples": {"t": {"doc_id": list(range(len(answers))), "loglik": loglik}}}
        (tmp_path / name / "eval.json").write_text(json.dumps(record))

    run("a-1", [0, 1, 2, 0]), run("b-1", [0, 2, 1, 0]), run("a-2", [1, 1, 2, 0]), run("b-2", [1, 1, 2, 0])
    out = _agreement(str(tmp_path), "a", "b", "--seeds", "1", "2")
    assert "seed 1: a and b answer 2 of 4 questions differently" in out
    assert "seed 2: a and b answer 0 of 4 questions differently" in out
    assert "a seeds 1 and 2 answer 1 differently" in out


@pytest.mark.study
@pytest.mark.parametrize("task", ["csqa", "arc_easy"])
def test_part3_reading_cites_the_agreement_the_runs_show(task):
    """The reading's claim that LoRA r16 is in effect LoRA r8 rests on counts computed from the committed runs."""
    folder = PART3 / task
    if not all((folder / f"{m}-{s}" / "eval.json").is_file() for m in ("lora", "lora16") for s in (42, 43, 44)):
        pytest.skip(f"{task}'s lora and lora16 runs are not all in")
    out = _agreement(str(folder), "lora", "lora16")
    seeds = [line.split(" answer ")[1] for line in out.splitlines() if line.startswith("seed")]
    counts, n = [s.split(" of ")[0] for s in seeds], seeds[0].split(" of ")[1].split()[0]
    scale = out.splitlines()[-1].split(" answer ")[1].split()[0]
    reading = " ".join((PART3 / "README.md").read_text(encoding="utf-8").split())  # line breaks as spaces
    assert f"on only {counts[0]}, {counts[1]} and {counts[2]} of the {n} questions" in reading
    assert f"against {scale} between LoRA r8's seeds 42 and 43" in reading
    training = next(line for line in out.splitlines() if line.startswith("training"))
    loss, median = training.split("at most ")[1].split(" (median ")[0], training.split("(median ")[1].split(")")[0]
    ratios, ratio_median = training.split("lora's ")[1].split(" (median ")[0], training.split("(median ")[2].rstrip(")")
    assert f"differ by at most {loss} (median {median})" in reading
    low, high = ratios.split("-")
    assert f"gradient norm is {low}-{high}x r8's (median {ratio_median}" in reading


PART4 = RESULTS / "qwen2.5-arc-easy-csqa"


def test_study_part4_runs_come_from_the_pinned_commit_and_share_batches():
    """Part 4's promise, for every finished run so far: trained at the commit in COMMIT, every step's batches
    recorded, and runs of one task and seed (the lr sweep's, the grid's) drawing the same batches step for step (a
    longer run continuing the sequence); a run with ``data_steps: N`` (CSQA's ``lora_compute``) takes the first N
    steps' batches of that sequence, repeated in the same order, as part 3's ``lora_repeat`` does."""
    runs = _pinned_runs(PART4, "**/*-*/log.jsonl")
    for (task, seed), methods in runs.items():
        data_steps = {method: yaml.safe_load((PART4 / f"{method}-{seed}" / "settings.yaml").read_text())["data_steps"]
                      for method in methods}
        longest = max((b for m, b in methods.items() if data_steps[m] is None), key=len)
        for method, batches in methods.items():
            prefix = longest[:data_steps[method] or len(batches)]
            assert data_steps[method] is None or len(prefix) == data_steps[method], f"{task}/{method}-{seed}"
            expected = (prefix * (len(batches) // len(prefix) + 1))[:len(batches)]
            assert batches == expected, f"{task} seed {seed}: {method} drew other batches"


@pytest.mark.parametrize("folder", sorted(p.parent for p in PART4.glob("tuning/*/report.md")), ids=lambda p: p.name)
def test_study_part4_tuning_picks_reproduce_from_the_committed_runs(folder):
    """The tuning split's report reproduces from its eval files, every run was scored on the task's tuning split
    (never the reported one), and the learning rate written in ``lr`` is the one ``scripts/study_pick.py`` picks."""
    from bitune.data.datasets import DATASETS

    _assert_report_reproduces(folder)
    for path in folder.glob("*/eval.json"):
        assert json.loads(path.read_text())["config"]["splits"] == {folder.name: DATASETS[folder.name].dev_split}
    if (folder / "lr").is_file():
        _assert_pick(folder, ["lora_lr1e-4", "lora_lr3e-4", "lora_lr1e-3", "lora_lr3e-3"], "lora_lr")


def _assert_report_reproduces(folder: Path) -> None:
    """``bitune report`` on the folder's committed eval files writes exactly its committed report.md."""
    records = load_records(find_results([str(folder)]))
    _, markdown, _ = build_markdown(records, settings=find_settings([folder])[0])
    assert markdown == (folder / "report.md").read_text(encoding="utf-8")


def _assert_pick(folder: Path, labels: list[str], prefix: str) -> None:
    """The learning rate in the folder's ``lr`` file is the one scripts/study_pick.py picks from ``labels`` (each
    ``prefix`` + a learning rate, in the order its tie rule reads them)."""
    import subprocess
    import sys

    script = RESULTS.parent / "scripts" / "study_pick.py"
    done = subprocess.run([sys.executable, str(script), str(folder), *labels], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert prefix + (folder / "lr").read_text().strip() == done.stdout.strip()


def test_study_part4_reported_runs_use_the_tuned_picks():
    """The study's report reads the reported split's folders only (report.yaml's ``runs``; the generic tests above
    check it reproduces); every run there was scored on the task's reported split (never the tuning one), every
    trained run at the learning rate picked on the tuning split, ``bitune_warm`` from the start share picked there
    and ``bitune`` from the paper's."""
    from bitune.config import PAPER_INIT_SHARE
    from bitune.data.datasets import DATASETS

    runs = read_settings(PART4 / SETTINGS_FILE).runs
    assert runs and "tuning" not in runs
    evals = sorted(path for task in runs for path in (PART4 / task).glob("*/eval.json"))
    if not evals:
        pytest.skip("no reported-split run has finished yet")
    for path in evals:
        task = path.parent.parent.name
        assert json.loads(path.read_text())["config"]["splits"] == {task: DATASETS[task].eval_split}
        if path.parent.name == "pretrained":
            continue
        tuning = PART4 / "tuning" / task
        settings = yaml.safe_load((path.parent / "settings.yaml").read_text())
        lr = float((tuning / "lr").read_text())
        assert settings["lr"] == lr, f"{path.parent.name} trained at lr {settings['lr']}, not the tuned {lr}"
        if settings["bitune"]["variant"] == "bitune":
            warm = yaml.safe_load((tuning / "bitune_warm.yaml").read_text())["bitune"]["init_share"]
            share = warm if path.parent.name.startswith("bitune_warm-") else PAPER_INIT_SHARE
            assert settings["bitune"]["init_share"] == share, f"{path.parent.name} started at another share"


@pytest.mark.parametrize("folder", sorted(p.parent for p in PART4.glob("*/training.md")), ids=lambda p: p.name)
def test_study_part4_dynamics_table_reproduces_from_the_run_logs(folder):
    """The mechanism's numbers quoted in the texts (each run's loss against ``lora`` at its seed, the bidirectional
    share) are ``training.md``, which ``scripts/study_figures.py`` computes from the committed logs."""
    assert load_script("study_figures").dynamics(folder) == (folder / "training.md").read_text(encoding="utf-8")


CLIPPING = Path(__file__).resolve().parents[1] / "scripts" / "study_clipping.py"


def _clipping(folder: Path) -> str:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(CLIPPING), str(folder)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_clipping_counts_clipped_steps_and_the_mixers_share(tmp_path):
    """scripts/study_clipping.py counts the logged steps whose clipped norm (the global one, or the adapters' alone
    under ``clip: adapters``) exceeds max_grad_norm (the end-of-training summary not counted again), the factor the
    adapters were scaled by, each group's median norm, the mixer's share of the squared norm, a layer's lowest share
    and its largest move from the start share on; a run still training is left out."""
    def run(name, norms, mixer=None, a_k=None, finished=True, clip="all", adapters=None):
        (tmp_path / name).mkdir()
        settings = {"lr": 1e-3, "max_grad_norm": 1.0, "clip": clip, "bitune": {"init_share": 0.5}}
        (tmp_path / name / "settings.yaml").write_text(yaml.safe_dump(settings))
        records = []
        for i, norm in enumerate(norms):
            record = {"step": 5 * (i + 1), "loss": 1.0, "grad_norm": norm}
            if mixer:
                record |= {"grad_norm_mixer": mixer[i], "a_k": a_k[i], "a_v": [0.5, 0.5]}
            if adapters:
                record["grad_norm_adapters"] = adapters[i]
            records.append(record)
        if finished:
            records.append({**records[-1], "train_runtime": 1.0})
        (tmp_path / name / "log.jsonl").write_text("\n".join(json.dumps(r) for r in records))

    a_k = [[0.4, 0.1], [0.4, 0.0], [0.9, 0.0]]
    run("bitune-1", [2.0, 0.5, 3.0], mixer=[1.6, 0.3, 3.0], a_k=a_k, adapters=[1.2, 0.4, 0.1])
    run("bitune_clip-1", [2.0, 0.5, 3.0], mixer=[1.6, 0.3, 3.0], a_k=a_k, adapters=[1.25, 0.4, 0.1], clip="adapters")
    run("lora-1", [2.0, 0.5, 0.9])
    run("lora-2", [2.0], finished=False)
    out = _clipping(tmp_path)
    # all clipped: the global norms 2.0 and 3.0 exceed 1.0, scaling the adapters by 0.5, 1 and 1/3
    assert "bitune (lr 0.001, clip all, 1 runs): clipped at 2/3 logged steps; the adapters' gradient scaled by " \
           "median 0.50, lowest 0.33; median norm before clipping: adapters 0.40, mixer 1.60; mixer's share of the " \
           "squared norm: median 0.64, lowest 0.36; a layer's lowest share 0.00; a layer's largest move between " \
           "logged steps 0.50" in out
    # adapters clipped alone: only 1.25 exceeds 1.0 (scaled by 0.8); the mixer's norms do not count
    assert "bitune_clip (lr 0.001, clip adapters, 1 runs): clipped at 1/3 logged steps; the adapters' gradient " \
           "scaled by median 1.00, lowest 0.80" in out
    assert "lora (lr 0.001, clip all, 1 runs): clipped at 1/3 logged steps; the adapters' gradient scaled by median " \
           "1.00, lowest 0.50; median norm before clipping: adapters 0.90" in out
    assert "lora-2: has not finished training, left out" in out


@pytest.mark.study
def test_part4_reading_cites_the_clipping_the_logs_show():
    """The mechanism's clipping counts in part 4's reading are scripts/study_clipping.py's, from the committed logs."""
    reading = " ".join((PART4 / "README.md").read_text(encoding="utf-8").split())
    arc, csqa = _clipping(PART4 / "arc_easy"), _clipping(PART4 / "csqa")

    def counts(out, method):
        line = next(x for x in out.splitlines() if x.startswith(f"{method} ("))
        return [c.split("/")[0] for c in line.split("clipped at ")[1].split(" logged")[0].split(", ")]

    bitune = counts(arc, "bitune")
    assert f"at {bitune[0]}, {bitune[1]} and {bitune[2]} of the 45 logged steps of ARC-Easy's `bitune` runs" in reading
    assert {"45"} == set(counts(arc, "bitune_warm")) and {"40"} == set(counts(csqa, "bitune"))
    for out, method, total in ((arc, "lora", 45), (arc, "lora_compute", 82), (csqa, "lora", 40),
                               (csqa, "lora_compute", 90), (csqa, "lora_compute_newdata", 90)):
        low, high = min(map(int, counts(out, method))), max(map(int, counts(out, method)))
        assert f"{low}-{high} of {total} for `{method}`" in reading, method


PART5 = RESULTS / "qwen2.5-bitune-recipe"
PART5_LABELS = ["bitune_clip_lr3e-4", "bitune_clip_lr1e-3", "bitune_clip_lr3e-3"]
"""Part 5's tuning runs in the order the pick's tie rule reads them (scripts/study.sh PART=5)."""


def _own_runs(study: Path) -> list[Path]:
    """A study's own finished runs (folders holding eval.json), not the earlier study's runs linked into it."""
    return sorted(p.parent for p in study.glob("**/*-*/eval.json") if not p.parent.is_symlink())


def test_study_part5_shares_part4s_commit_and_batches():
    """Part 5's promise: its runs are trained at part 4's pinned commit, and each (tuning split and reported split
    alike) draws step for step the batches part 4's runs of the same task and seed drew, so that the new arm is
    paired with part 4's ``lora``, ``bitune`` and ``lora_compute`` on the same training data."""
    assert (PART5 / "COMMIT").read_text() == (PART4 / "COMMIT").read_text()
    part4 = _pinned_runs(PART4, "**/*-*/log.jsonl")
    own = {str(p) for p in _own_runs(PART5)}
    part5 = _pinned_runs(PART5, "**/*-*/log.jsonl")
    checked = 0
    for (task, seed), methods in part5.items():
        longest = max(part4[(task, seed)].values(), key=len)  # part 4's runs of it agree (the test above)
        for method, batches in methods.items():
            if str(PART5 / f"{method}-{seed}") not in own:
                continue  # a linked part-4 run
            assert batches == longest[:len(batches)], f"{task} seed {seed}: part 5's {method} drew other batches"
            checked += 1
    assert checked == len(own)


def test_study_part5_runs_are_the_arm_it_promises():
    """Every run of part 5 is Bitune r8 from the paper's start share with the adapters clipped alone; a tuning run
    was scored on the tuning split at the learning rate its name gives, a reported run on the reported split at the
    learning rate picked on the tuning split (never a reported-split number)."""
    from bitune.config import PAPER_INIT_SHARE
    from bitune.data.datasets import DATASETS

    runs = _own_runs(PART5)
    if not runs:
        pytest.skip("part 5 has no finished run yet")
    for run in runs:
        settings = yaml.safe_load((run / "settings.yaml").read_text())
        splits = json.loads((run / "eval.json").read_text())["config"]["splits"]
        assert (settings["clip"], settings["bitune"]["variant"], settings["bitune"]["rank"]) == ("adapters", "bitune", 8)
        assert settings["bitune"]["init_share"] == PAPER_INIT_SHARE, run
        method, task = run.name.rsplit("-", 1)[0], run.parent.name
        if run.parent.parent.name == "tuning":
            assert method in PART5_LABELS and settings["lr"] == float(method.removeprefix("bitune_clip_lr")), run
            assert splits == {task: DATASETS[task].dev_split}
        else:
            assert method == "bitune_recipe" and splits == {task: DATASETS[task].eval_split}, run
            assert settings["lr"] == float((PART5 / "tuning" / task / "lr").read_text()), f"{run}: not the picked lr"


@pytest.mark.parametrize("folder", sorted(p.parent for p in PART5.glob("tuning/*/lr")), ids=lambda p: p.name)
def test_study_part5_tuning_pick_reproduces_from_the_committed_runs(folder):
    """Part 5's tuning report reproduces from its eval files, and the learning rate in ``lr`` is the one
    scripts/study_pick.py picks from the three tuning runs (part 4's rule for LoRA)."""
    _assert_report_reproduces(folder)
    assert {p.parent.name.rsplit("-", 1)[0] for p in folder.glob("*/eval.json")} == set(PART5_LABELS)
    _assert_pick(folder, PART5_LABELS, "bitune_clip_lr")


def _pairs(report: Path) -> dict[tuple[str, str, str], list[str]]:
    """The paired-differences rows of a study's report.md, by (task, method, baseline): the cells after those
    three (seed pairs, Δ [CI], two-level, seed-aware, sign-flip p, Δ per seed, McNemar, seed-aware p, Holm p)."""
    rows = {}
    for line in report.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 13 and cells[4].isdigit():
            rows[(cells[0], cells[2], cells[3])] = cells[4:]
    return rows


@pytest.mark.study
def test_part5_reading_cites_its_report():
    """Part 5's reading quotes, for each comparison of the new arm on each task it reads, the report's difference,
    seed-aware interval, per-seed differences and Holm p (what decides), so that a regenerated report that moves
    them shows up here."""
    reading = " ".join((PART5 / "README.md").read_text(encoding="utf-8").split("## Report (")[0].split())
    rows = _pairs(PART5 / "report.md")
    tasks = {task for task, method, _ in rows if method == "bitune_recipe"}
    if not tasks:
        pytest.skip("part 5's report has no reported-split run of the new arm yet")
    for task in tasks:
        for baseline in ("lora", "bitune", "lora_compute"):
            _, delta, _, seed_aware, _, per_seed, _, _, holm = rows[(task, "bitune_recipe", baseline)]
            seeds = ", ".join(part.split(": ")[1] for part in per_seed.split("; "))
            assert delta.split(" [")[0] in reading and seed_aware in reading, (task, baseline)
            assert f"Holm p {holm}" in reading and f"({seeds})" in reading, (task, baseline, holm, seeds)
