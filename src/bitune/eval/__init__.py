"""Evaluation: the ``bitune`` model type of lm-evaluation-harness, offline tasks, the eval/report/sweep verbs."""
