"""The names and schema of the files an evaluation leaves (``eval.json``), read by ``bitune report``, the model
card and the sweep without importing lm-eval, torch or the evaluation code (:mod:`bitune.eval` re-exports them)."""

RESULT_FILE = "eval.json"
"""Name of the result file written into an output folder (and looked for by ``bitune report``)."""
SCHEMA = "bitune-eval/1"
"""The ``schema`` of a result record."""



def record_splits(record: dict) -> dict[str, str | None]:
    """``{task: split}`` of a result record: the splits it was evaluated on (``config.splits``); a record written
    before splits were recorded holds the reported splits, which is what every evaluation then used."""
    from .data.datasets import DATASETS

    recorded = (record.get("config") or {}).get("splits") or {}
    return {task: recorded.get(task) or (DATASETS[task].eval_split if task in DATASETS else None)
            for task in record["tasks"]}


__all__ = ["RESULT_FILE", "SCHEMA", "record_splits"]
