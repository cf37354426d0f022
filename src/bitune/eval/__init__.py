"""Evaluation with lm-evaluation-harness: the ``bitune`` model type (:mod:`.lm`), the paper's tasks read offline
(:mod:`.tasks`), evaluating a model (:mod:`.evaluate`), the report over seeds (:mod:`.report`, :mod:`.stats`).

The result file's name and schema (:mod:`bitune.records`) are re-exported here; reading results (``bitune report``)
needs neither lm-eval nor torch."""

from ..records import RESULT_FILE, SCHEMA

__all__ = ["RESULT_FILE", "SCHEMA"]
