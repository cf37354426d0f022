"""The ``bitune`` verbs, one module each (argument parsing and orchestration; the work is done by the library):
``train``, ``eval``, ``report``, ``sweep``, ``generate``, ``chat``, ``plot``, ``bench``, ``quickstart``, plus the
options they share (:mod:`.options`). :mod:`bitune.cli` imports a verb's module only when that verb runs."""
