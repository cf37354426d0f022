"""Evaluation with lm-evaluation-harness: the ``bitune`` model type (:mod:`.lm`), the paper's tasks read offline
(:mod:`.tasks`), evaluating a model (:mod:`.evaluate`), the report over seeds (:mod:`.report`, :mod:`.stats`).

The result file's name and schema live here, so that reading results (``bitune report``) needs neither lm-eval nor
torch."""

RESULT_FILE = "eval.json"
"""Name of the result file written into an output folder (and looked for by ``bitune report``)."""
SCHEMA = "bitune-eval/1"
"""The ``schema`` of a result record."""
