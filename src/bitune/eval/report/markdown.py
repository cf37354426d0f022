"""The report rendered: the full report as Markdown (:func:`build_markdown`), its short form for a README
(:func:`build_summary`), the table over seeds on the terminal (:func:`print_report`) and the files
``report.md``/``report.csv`` (:func:`write_report`)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from ...errors import BituneError
from ...files import write_text_atomic
from ...stats import BOOTSTRAP, bootstrap_mean, mcnemar_exact
from .analysis import Analysis, Comparison, Pooled, Report, analyse, comparisons, trivial_baselines
from .records import TaskRuns, task_title
from .settings import ReportSettings


def _limit_text(limit: int | None) -> str:
    return "none (full split)" if limit is None else str(limit)


def _seed_text(seed: int | None) -> str:
    return "-" if seed is None else str(seed)


def _points(ci) -> str:
    return f"{100 * ci.value:+.1f} [{100 * ci.low:+.1f}, {100 * ci.high:+.1f}]"


def _range(ci) -> str:
    return f"[{100 * ci.low:+.1f}, {100 * ci.high:+.1f}]"


def _pairs_text(pairs: int) -> str:
    """A comparison's number of seed pairs, marked where the seed-aware test cannot use them (one pair)."""
    return f"{pairs} (question-level only)" if pairs < 2 else str(pairs)


def _seed_p_text(test) -> str:
    return f"{test.p:.3g}"


def accuracy_rows(tasks: dict[str, TaskRuns]) -> list[list[str]]:
    """Rows: task, n, limit, method, runs, accuracy with 95% interval (%), each seed's accuracy (%), and the
    difference from the task's best trivial baseline (points; ``below`` marks a method under it)."""
    rows = []
    for task, tr in tasks.items():
        trivial = trivial_baselines(tr)
        for label, runs in tr.methods.items():
            ci = bootstrap_mean(runs.averaged)
            per_seed = ", ".join(f"{_seed_text(s)}: {100 * c.mean():.1f}" for s, c in zip(runs.seeds, runs.correct))
            versus = "-"
            if trivial is not None:
                gap = 100 * (ci.value - trivial.best[1])
                versus = f"{gap:+.1f}" + (" **below**" if gap < 0 else "")
            rows.append([task_title(task), str(len(tr.doc_ids)), _limit_text(tr.limit), label,
                         str(len(runs.seeds)), ci.text(), per_seed, versus])
    return rows


def trivial_rows(tasks: dict[str, TaskRuns]) -> list[list[str]]:
    """Rows: task, n, choices, each always-choice-k accuracy (%), the best k and its accuracy (%)."""
    rows = []
    for task, tr in tasks.items():
        trivial = trivial_baselines(tr)
        if trivial is None:
            continue
        counts = sorted(set(tr.choices))
        k, best = trivial.best
        rows.append([task_title(task), str(len(tr.doc_ids)),
                     "/".join(map(str, counts)), ", ".join(f"{j}: {100 * a:.2f}" for j, a in enumerate(trivial.always)),
                     f"always {k}: {100 * best:.2f}"])
    return rows


def comparison_row(c: Comparison) -> list[str]:
    """task, n, method, baseline, seed pairs, Δ with its question-level interval, the two-level and the seed-aware
    intervals, the sign-flip p over questions, per seed: Δ, discordant counts and McNemar p; the seed-aware p."""
    ci = bootstrap_mean(c.diff)
    per_seed, tests = [], []
    for seed, a, b in c.pairs:
        only_a, only_b, p = mcnemar_exact(a, b)
        per_seed.append(f"{_seed_text(seed)}: {100 * (a.mean() - b.mean()):+.1f}")
        tests.append(f"{only_a}/{only_b}, p={p:.3g}")
    return [c.where, str(c.n), c.method, c.baseline, _pairs_text(len(c.pairs)), _points(ci), _range(c.interval),
            _range(c.test.interval), f"{c.question_p:.3g}", "; ".join(per_seed), "; ".join(tests),
            _seed_p_text(c.test)]


def pooled_row(q: Pooled) -> list[str]:
    """tasks, method, baseline, seed pairs per task, the task-averaged Δ with the per-task Δs, its two-level and
    seed-aware intervals, the sign-flip p over questions, the seed-aware p."""
    each = "; ".join(f"{c.where} {100 * c.diff.mean():+.1f}" for c in q.parts)
    pairs = "/".join(str(len(c.pairs)) for c in q.parts) + (" (question-level only)" if q.test.pairs < 2 else "")
    return [" + ".join(c.where for c in q.parts), q.method, q.baseline, pairs, f"{100 * q.interval.value:+.1f}",
            each, _range(q.interval), _range(q.test.interval), f"{q.question_p:.3g}", _seed_p_text(q.test)]


def cost_text(a: Analysis) -> str:
    """What the seed-aware test costs in power at the report's most common number of seed pairs S (2 or more):
    how many standard errors a difference needs to be resolved at 5% alone and at Holm's smallest threshold over
    the report's family; empty when no comparison has 2 seed pairs."""
    from collections import Counter

    from scipy.stats import t

    counts = Counter(len(c.pairs) for c in a.found if len(c.pairs) >= 2)
    if not counts:
        return ""
    S, m = counts.most_common(1)[0][0], len(a.adjusted)
    alone, holm = float(t.ppf(0.975, S - 1)), float(t.ppf(1 - 0.025 / m, S - 1))
    return (f" What it costs: with {S} seed pairs the t has {S - 1} degrees of freedom, so a difference is resolved "
            f"at 5% alone only beyond {alone:.1f} standard errors (the seed-aware interval's half-width is the "
            f"smallest such difference) and at Holm's smallest threshold here (0.05/{m}) beyond {holm:.1f}.")


def few_seeds_warning(a: Analysis) -> str | None:
    """A plain warning naming the comparisons with one seed pair, where the seed-aware test cannot estimate the
    between-seed variance and falls back to the question-level t; None when there are none."""
    single = [c for c in a.found if len(c.pairs) < 2]
    if not single:
        return None
    named = "; ".join(f"{c.method} vs {c.baseline} on {c.where}" for c in single)
    return (f"**Warning: one seed pair** ({named}). The seed-aware test needs 2 or more seed pairs to estimate how "
            "much the difference varies between training seeds (a t over one pair is undefined), so for these "
            "the p-value and the seed-aware interval are the question-level t: they cover other questions, not "
            "other training runs, and a difference they resolve may not hold for another seed. Train more seeds "
            "to test the methods rather than these runs.")


def difference_rows(tasks: dict[str, TaskRuns], baselines: list[str],
                    methods: set[str] | None = None) -> list[list[str]]:
    """Rows (:func:`comparison_row`) of every method (or only ``methods``) against each baseline, per task."""
    return [comparison_row(c) for c in comparisons(tasks, baselines, methods)]


ACCURACY_HEADER = ["task", "n", "limit", "method", "seeds", "acc % [95% CI]", "per seed (%)",
                   "vs best trivial (points)"]
TRIVIAL_HEADER = ["task", "n", "choices", "always choice k: acc %", "best trivial (majority answer position)"]
DIFFERENCE_HEADER = ["task", "n", "method", "vs", "seed pairs", "Δ points [95% CI over questions]",
                     "two-level 95% CI", "seed-aware 95% CI", "sign-flip p (questions)", "Δ per seed",
                     "only method / only baseline right, McNemar p (per seed)", "seed-aware p", "Holm p"]
POOLED_HEADER = ["tasks", "method", "vs", "seed pairs per task", "Δ points, task mean", "Δ per task",
                 "two-level 95% CI", "seed-aware 95% CI", "sign-flip p (questions)", "seed-aware p", "Holm p"]


def markdown_table(header: list[str], rows: list[list[str]], left: int = 1) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * left + ["---:"] * (len(header) - left)) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def timing_rows(records: list[dict], settings: ReportSettings | None = None) -> list[list[str]]:
    """Rows: tasks, method, runs, mean training and evaluation wall time per run (minutes), total (minutes)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        tasks = "+".join(task_title(t) for t in r["tasks"])
        groups.setdefault((tasks, r["label"]), []).append(r.get("timing") or {})
    rows, key = [], (settings or ReportSettings()).method_key
    for (tasks, label), timings in sorted(groups.items(), key=lambda kv: (kv[0][0], key(kv[0][1]))):
        train = [t["train_s"] for t in timings if isinstance(t.get("train_s"), (int, float))]
        evals = [t["eval_s"] for t in timings if isinstance(t.get("eval_s"), (int, float))]
        total = sum(train) + sum(evals)
        rows.append([tasks, label, str(len(timings)), f"{sum(train) / len(train) / 60:.1f}" if train else "-",
                     f"{sum(evals) / len(evals) / 60:.1f}" if evals else "-", f"{total / 60:.1f}"])
    return rows


TIMING_HEADER = ["task", "method", "runs", "train min/run", "eval min/run", "total min"]


def title_of(tasks: list[str], metric: str, gsm8k_metric: str) -> str:
    names = ", ".join(task_title(t) for t in tasks)
    gsm = f"; GSM8K: {gsm8k_metric}" if "gsm8k" in tasks else ""
    return f"{names}: {metric}{gsm}"


def build_markdown(records: list[dict], metric: str = "acc", gsm8k_metric: str = "exact_match_strict",
                   baselines: tuple[str, ...] = ("lora", "pretrained"), analysis: Analysis | None = None,
                   settings: ReportSettings | None = None) -> tuple[Report, str, dict[str, TaskRuns]]:
    """The whole report as Markdown: the paper's table over seeds, accuracy intervals, trivial baselines, paired
    differences (per task and pooled over tasks, Holm-adjusted) and wall times.

    The accuracy intervals, trivial baselines, paired differences and pooled comparisons need the runs'
    per-question data (``samples``): runs without it appear in the table over seeds only, listed at the end.

    Args:
        records: the runs' evaluation records (:func:`load_records`): ``label``, ``tasks`` (metrics per task),
            ``config`` (``train_seed``, ``limit``, ``model``, ``template``) and optionally ``samples``.
        metric: the multiple-choice metric, ``acc`` or ``acc_norm``.
        gsm8k_metric: GSM8K's metric.
        baselines: methods every other method is compared with, question by question. Default LoRA and the
            pretrained model.
        analysis: :func:`analyse` of the same records, when already computed (then ``metric``, ``gsm8k_metric``,
            ``baselines`` and ``settings`` are not used for the statistics).
        settings: the study's method order and fair baselines (default: :class:`ReportSettings`).

    Returns:
        report: The table over seeds.
        markdown: The report as Markdown.
        tasks: The per-question runs per task (:func:`collect_runs`).

    Raises:
        BituneError: no records; the runs differ in base model, prompt template or ``--limit``; a run lacks
            the metric or it is not a number; runs of a task cover different questions or disagree on a correct
            answer; a method has two runs with one seed.
    """
    a = analysis or analyse(records, metric, gsm8k_metric, baselines, settings)
    report, tasks, skipped = a.report, a.tasks, a.skipped
    n_text = ", ".join(f"{task_title(t)} {len(tr.doc_ids)}" for t, tr in tasks.items())
    limits = sorted({_limit_text(r["config"].get("limit")) for r in records})
    parts = [f"# Report: {title_of(report.tasks, metric, gsm8k_metric)}\n",
             f"{len(records)} runs. Questions per task (n): {n_text or 'no per-question data'}; "
             f"--limit: {', '.join(limits)}.\n",
             f"## {metric} (%), mean ± sample std over seeds\n", report.markdown()]
    if tasks:
        parts += [f"\n## {metric} (%) with a 95% bootstrap interval over questions\n",
                  "Seed-averaged per-question correctness, resampled over questions "
                  f"({BOOTSTRAP} resamples, fixed seed); each seed's accuracy after it; the last column is the "
                  "accuracy minus the task's best trivial baseline (**below**: under it).\n",
                  markdown_table(ACCURACY_HEADER, accuracy_rows(tasks), left=5)]
        trivial = trivial_rows(tasks)
        if trivial:
            parts += ["\n## Trivial baselines\n",
                      "What a model that reads nothing scores on these questions: always the k-th choice (k from "
                      "0; wrong on a question with fewer choices). The best k is the majority answer position of the "
                      "split (chosen with the answers known, so an upper bound for a constant guess); a method "
                      "below it has learnt nothing usable about the task.\n",
                      markdown_table(TRIVIAL_HEADER, trivial, left=3)]
        found, pools, adjusted = a.found, a.pools, a.adjusted
        if found:
            parts += ["\n## Paired differences (percentage points)\n",
                      "Per question: the method's correctness averaged over seeds minus the baseline's (over the "
                      "same seeds; an untrained baseline has one run), mean with a 95% bootstrap interval over "
                      "questions (these trained models, other questions). Per seed: the difference, the questions "
                      "only the method / only the baseline gets right, and the exact McNemar p-value. Two-level: a "
                      "bootstrap that resamples seed pairs, then questions within them; at few seeds it "
                      "understates the variation between seeds (its seed-level variance is (S-1)/S of the "
                      "sample's: 2/3 at 3 seed pairs). Seed-aware, the test that decides: a t over the S seed pairs "
                      "with S - 1 degrees of freedom, its variance the per-seed-pair differences' over S plus the "
                      "question part a two-way (seed x question) analysis of variance finds beyond the residual. "
                      "In simulations calibrated to study part 4 its false-positive rate stays at or below "
                      "nominal at alpha 0.05, 0.01 and 0.0028, and its interval is meant for other training seeds "
                      "and other questions (docs/guides/evaluation.md). The question-level and two-level "
                      "intervals describe these runs; they do not decide. Sign-flip p: a permutation test over "
                      f"questions (the per-question differences' signs flipped at random, {BOOTSTRAP} draws; "
                      "these trained models). Holm p: the seed-aware p adjusted by Holm's method over the family "
                      f"of all {len(adjusted)} comparisons of this report (this table"
                      f"{' and the pooled one' if pools else ''}); a comparison is resolved at 5% when it is "
                      f"below 0.05.{cost_text(a)}\n",
                      markdown_table(DIFFERENCE_HEADER, [[*comparison_row(c), f"{p:.3g}"] for c, p in zip(found, adjusted)],
                                     left=5)]
        if pools:
            parts += ["\n## Pooled over tasks (percentage points)\n",
                      "A method against a baseline on every task where both ran: the mean over tasks of the "
                      "per-task paired differences (each task weighs the same). Two-level 95% interval: per "
                      "task, seed pairs then questions are resampled, and the tasks' means averaged. Seed-aware: "
                      "as per task, each task's variance divided by the tasks squared and summed, with "
                      "Satterthwaite's degrees of freedom over the tasks (between one task's S - 1 and their "
                      "sum). Sign-flip p: the per-question differences' signs "
                      "flipped at random, each question weighted by 1 / (tasks x its task's questions). Holm p: "
                      "the seed-aware p, over the same family as above.\n",
                      markdown_table(POOLED_HEADER, [[*pooled_row(q), f"{p:.3g}"]
                                                     for q, p in zip(pools, adjusted[len(found):])], left=4)]
    warning = few_seeds_warning(a) if tasks else None
    if warning:
        parts.append(f"\n{warning}\n")
    if a.unpaired:
        parts.append(f"\n{unpaired_text(a)}\n")
    timing = timing_rows(records, a.settings)
    if any(r[3] != "-" or r[4] != "-" for r in timing):
        total = sum(float(r[5]) for r in timing)
        parts += ["\n## Wall time\n", f"Training (train_runtime in each run's log.jsonl) and evaluation "
                  f"(lm-eval) per run, as recorded on the machine that ran them; {total / 60:.1f} h in all.\n",
                  markdown_table(TIMING_HEADER, timing, left=2)]
    if skipped:
        parts.append(f"\nNo per-question data (re-run 'bitune eval' to include them): {', '.join(skipped)}.\n")
    return report, "\n".join(parts), tasks


def unpaired_text(a: Analysis, unpaired: list | None = None) -> str:
    """The line that names the comparisons the report cannot make (:attr:`Analysis.unpaired`)."""
    listed = "; ".join(u.text() for u in (a.unpaired if unpaired is None else unpaired))
    return f"Not compared (no training seed in common, so no run pairs with a run of the other): {listed}."


def build_summary(a: Analysis, metric: str = "acc", gsm8k_metric: str = "exact_match_strict",
                  source: str | None = None) -> str:
    """A short form of the report for a README: per task each method's accuracy with its interval next to the best
    trivial baseline, then Bitune minus each baseline (two-level interval, Holm p over the whole report's family).

    Args:
        a: the analysis (:func:`analyse`).
        metric: the multiple-choice metric tabulated.
        gsm8k_metric: GSM8K's metric.
        source: where the full report is (a path or link), named under the tables.
    """
    if not a.tasks:
        raise BituneError("a summary needs per-question results; these runs have none")
    methods = sorted({m for tr in a.tasks.values() for m in tr.methods}, key=a.settings.method_key)
    seeds = sorted({len(r.seeds) for tr in a.tasks.values() for r in tr.methods.values() if r.seeds != [None]})
    header = ["task", "n", "best trivial", *methods]
    rows = []
    for task, tr in a.tasks.items():
        trivial = trivial_baselines(tr)
        best = "-" if trivial is None else f"{100 * trivial.best[1]:.1f}"
        cells = []
        for m in methods:
            if m not in tr.methods:
                cells.append("")
                continue
            ci = bootstrap_mean(tr.methods[m].averaged)
            cells.append(ci.text() + (" (below)" if trivial is not None and ci.value < trivial.best[1] else ""))
        rows.append([task_title(task), str(len(tr.doc_ids)), best, *cells])
    parts = [f"# Summary: {title_of(a.report.tasks, metric, gsm8k_metric)}\n",
             f"{metric} % with a 95% bootstrap interval over questions, seed-averaged "
             f"({'/'.join(map(str, seeds)) or '-'} seeds per trained method); best trivial: always the "
             "majority answer position; (below): under it.\n",
             markdown_table(header, rows, left=1)]
    mine = [(c, p) for c, p in zip(a.found, a.adjusted) if c.method == "bitune"]
    mine += [(q, p) for q, p in zip(a.pools, a.adjusted[len(a.found):]) if q.method == "bitune"]
    if mine:
        versus = sorted({c.baseline for c, _ in mine}, key=a.settings.method_key)
        table: dict[str, dict[str, str]] = {}
        for c, p in mine:
            single = [x.where for x in c.parts if len(x.pairs) == 1]
            mark = ""
            if single:  # one training run per method there: the interval does not cover training seeds
                mark = f" (1 seed pair on {', '.join(single)})" if len(c.parts) > 1 else " (1 seed pair)"
            table.setdefault(c.where, {})[c.baseline] = (f"{_points(c.test.interval)} (two-level "
                                                         f"{_range(c.interval)}), Holm p {p:.2g}{mark}")
        parts += ["\n# Bitune minus each baseline (points)\n",
                  "Per question, paired on the same questions and seeds; the seed-aware 95% interval (a t over "
                  "seed pairs with S - 1 degrees of freedom: the test that decides), the two-level bootstrap's "
                  "beside it (a description of these runs, shorter at few seeds); Holm p of the seed-aware test "
                  f"over all {len(a.adjusted)} comparisons of the full report (resolved at 5% below 0.05)."
                  f"{cost_text(a)} (1 seed pair): one training run per method, so interval and p are "
                  "question-level only (other questions, not other training seeds); read it as provisional.\n",
                  markdown_table(["", *(f"vs {b}" for b in versus)],
                                 [[w, *(cells.get(b, "") for b in versus)] for w, cells in table.items()])]
    mine_unpaired = [u for u in a.unpaired if u.method == "bitune"]
    if mine_unpaired:
        parts.append(f"\n{unpaired_text(a, mine_unpaired)}\n")
    if source:
        parts.append(f"\nThe full report (every comparison, per seed, McNemar, wall time): {source}.\n")
    return "\n".join(parts)


def print_report(report: Report, title: str) -> None:
    table = Table(title=title)
    for i, col in enumerate(report.header()):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in report.rows():
        table.add_row(*row)
    Console().print(table)


def write_report(report: Report, output: Path, markdown: str | None = None) -> tuple[Path, Path]:
    output.mkdir(parents=True, exist_ok=True)
    md, cs = output / "report.md", output / "report.csv"
    write_text_atomic(md, markdown if markdown is not None else report.markdown())
    write_text_atomic(cs, report.csv())
    return md, cs
