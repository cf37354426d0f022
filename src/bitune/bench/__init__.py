"""The benchmarks of ``bitune bench``: one module per sub-verb, the pieces they share in :mod:`.helpers`.

``train`` (optimizer steps on random batches), ``data`` (optimizer steps on a config's real data), ``generate``
(prefill and decode, paper section 3.4), ``decode`` (one decoding step against the model's own forward),
``prefill`` (the two ways of reading prompts), ``sharding`` (per-process memory under DDP vs FSDP2, in N
processes), ``serve`` (servers under load; its server processes, load client and table in ``serve_*.py``) and
``eval`` (multiple-choice scoring against lm-eval's ``hf``).
Each module imports torch and the rest it needs itself: :mod:`bitune.commands.bench` imports one only when its
benchmark runs, so ``import bitune`` and ``bitune --help`` stay light.
"""
