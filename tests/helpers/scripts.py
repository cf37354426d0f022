"""The repository's ``scripts/*.py`` as modules, for tests of the functions they define (the scripts are not a
package: each is run as ``python scripts/NAME.py``)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@functools.cache
def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` imported once, under the module name ``<name>``."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
