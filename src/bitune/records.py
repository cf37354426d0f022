"""The names and schema of the files an evaluation leaves (``eval.json``), read by ``bitune report``, the model
card and the sweep without importing lm-eval, torch or the evaluation code (:mod:`bitune.eval` re-exports them)."""

RESULT_FILE = "eval.json"
"""Name of the result file written into an output folder (and looked for by ``bitune report``)."""
SCHEMA = "bitune-eval/1"
"""The ``schema`` of a result record."""

__all__ = ["RESULT_FILE", "SCHEMA"]
