"""Aggregating ``bitune eval`` results over seeds (what ``bitune report`` writes): the paper's table plus paired
statistics.

1. **The paper's table** (Table 1/2 shape): rows are methods (the ``label`` of each eval JSON), columns the tasks
   and their average. A cell is ``mean ± std`` in percent over the runs (seeds) of that method. The std is the
   sample standard deviation (ddof=1); with one run it is undefined and shown as ``-``. The average column
   averages the tasks within each run first, then takes the mean and std of those per-run averages over seeds.
2. **Accuracy with a 95% interval** per task and method: the per-question correctness averaged over the
   method's seeds, its mean, and a bootstrap interval over questions (:mod:`bitune.stats`); each seed's
   accuracy is listed next to it.
3. **Paired differences** against each baseline (``--baselines``, default LoRA and the pretrained model): per
   question, the method's correctness averaged over seeds minus the baseline's (over the same seeds when the
   baseline has them), its mean with a bootstrap interval over questions, and per seed the discordant counts and
   the exact McNemar p-value (seed s of the method against seed s of the baseline, or against its one run).
   Beside it a two-level bootstrap interval (seed pairs, then questions; short at few seeds) and the seed-aware
   t-test and interval (:func:`bitune.stats.seed_aware_test`: a t over seed pairs with S - 1 degrees of
   freedom whose variance adds the question part beyond the residual), the one that decides, meant for other
   training seeds as well as other questions and calibrated in the tails Holm reads
   (``scripts/stats_coverage.py``); a sign-flip permutation p-value over questions is shown for these trained
   models. The paper's
   ablations (``shared_weights``, ``naive_bidir``, ...) are also compared with ``bitune``, and ``bitune`` with
   the study's fair baselines (``report.yaml``: e.g. LoRA at its parameter count or its compute; default: every
   other method). Every comparison's seed-aware p-value is adjusted by Holm's method over the family of all
   comparisons the report shows ("resolved" means below 0.05 after it); a comparison with one seed pair falls
   back to the question-level t and the report warns about it; a comparison that cannot be made (two trained
   methods with no seed in common) is named in the report.
4. **Trivial baselines** per multiple-choice task: the accuracy of always answering the k-th choice, and the best
   such k (the split's majority answer position); the accuracy table marks a method below it.
5. **Pooled over tasks**: each comparison made on 2 or more tasks, as the mean over tasks of the per-task paired
   differences, with a two-level interval (seed pairs, then questions, resampled within each task), the pooled
   seed-aware test (in the Holm family too) and a weighted sign-flip p-value.

Sections 2-5 need the per-question results that ``bitune eval`` stores (``samples``). Every table states the
number of questions ``n`` and the ``--limit`` the runs were evaluated with. A figure (``report.png``: per task,
accuracy per method with its interval and the seeds as points) is written when matplotlib is installed.

The modules: :mod:`.settings` (a study's ``report.yaml``: method order, fair baselines), :mod:`.records` (finding,
loading and checking eval.json files; per-question runs), :mod:`.analysis` (the table over seeds, comparisons,
intervals, Holm), :mod:`.markdown` (the report and its summary as Markdown, the terminal table, report.md/.csv),
:mod:`.figure` (report.png), :mod:`.embed` (a report between marker lines of a README).
"""

from .analysis import (
    ABLATIONS,
    AVERAGE,
    Analysis,
    Cell,
    Comparison,
    Pooled,
    Report,
    Trivial,
    Unpaired,
    aggregate,
    analyse,
    compare,
    comparisons,
    planned,
    pooled,
    trivial_baselines,
)
from .embed import EMBED_BEGIN, EMBED_END, SUMMARY_BEGIN, SUMMARY_END, check_embed, embed_report, embedded
from .figure import plot_accuracy
from .markdown import (
    build_markdown,
    build_summary,
    difference_rows,
    few_seeds_warning,
    markdown_table,
    print_report,
    title_of,
    unpaired_text,
    write_report,
)
from .records import (
    TASK_ORDER,
    TASK_TITLES,
    Runs,
    TaskRuns,
    check_comparable,
    check_splits,
    collect_runs,
    find_results,
    load_records,
    metric_of,
    results_below,
    task_title,
)
from .settings import SETTINGS_FILE, ReportSettings, find_settings, read_settings

__all__ = [
    "ABLATIONS", "AVERAGE", "EMBED_BEGIN", "EMBED_END", "SETTINGS_FILE", "SUMMARY_BEGIN", "SUMMARY_END", "TASK_ORDER",
    "TASK_TITLES", "Analysis", "Cell", "Comparison", "Pooled", "Report", "ReportSettings", "Runs", "TaskRuns",
    "Trivial", "Unpaired", "aggregate", "analyse", "build_markdown", "build_summary", "check_comparable",
    "check_embed", "check_splits", "collect_runs", "compare", "comparisons", "difference_rows", "embed_report",
    "few_seeds_warning", "embedded", "find_results", "find_settings", "load_records", "markdown_table", "metric_of",
    "planned", "plot_accuracy", "pooled", "print_report", "read_settings", "results_below", "task_title", "title_of",
    "trivial_baselines", "unpaired_text", "write_report",
]
