"""Helpers shared by the test modules (imported as ``helpers.<module>``; ``tests/`` is on ``sys.path`` under
pytest): tiny models and batches (``models``), weight comparisons (``compare``), token-id training samples
(``data``), a tiny tokenizer and chat tokenizers (``tokenizer``), a tiny checkpoint on disk (``gen``), a test server
and the scheduler's test pieces (``serve``), a ``bitune train`` trainer and its log (``train``), and the training
jobs that multi-process tests launch (``dist`` under torchrun, ``sft`` under accelerate launch)."""
