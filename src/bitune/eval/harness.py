"""lm-eval's own command line with the ``bitune`` model type and the offline tasks available.

lm-eval 0.4.13 looks models up in its registry and never reads the ``lm_eval.models`` entry points, so the
``bitune`` model type exists only once :mod:`bitune.eval.lm` is imported. This module imports it, adds
``--include_path`` for the ``bitune_*`` tasks unless one is given, and hands over to lm-eval's CLI, so every
lm-eval option works unchanged::

    python -m bitune.eval.harness --model bitune --model_args checkpoint=runs/x/final \\
        --tasks bitune_piqa,bitune_arc_challenge --limit 50 --batch_size 8
"""

from __future__ import annotations

import sys

from lm_eval.__main__ import cli_evaluate

from . import lm  # noqa: F401  (registers the "bitune" model type)
from .tasks import TASK_DIR


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--include_path" or a.startswith("--include_path=") for a in args):
        args += ["--include_path", str(TASK_DIR)]
    sys.argv = [sys.argv[0], *args]
    cli_evaluate()


if __name__ == "__main__":
    main()
