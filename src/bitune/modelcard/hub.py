"""Uploading a checkpoint to the Hugging Face Hub with its card rendered for the repository."""

from __future__ import annotations

from pathlib import Path

from ..config import read_config
from ..records import RESULT_FILE as EVAL_FILE
from .evaluation import Evaluation, find_evaluation
from .files import CARD_FILE, is_ours
from .text import HUB_ID, render, training_of


def push_to_hub(folder: str | Path, repo_id: str, private: bool | None = None, token: str | None = None,
                commit_message: str = "Upload a Bitune checkpoint") -> str:
    """Upload the checkpoint ``folder`` to the Hub model repository ``repo_id`` (created if missing), in one commit.

    The uploaded card is rendered for the repository (its commands download ``repo_id``; a user's own README is
    uploaded as it is) and the run's ``eval.json`` (``folder/../eval.json`` of this checkpoint) goes with it as
    ``eval.json``, so every number in the card is in the repository. The local folder is not changed. Log in
    first (``hf auth login``) or pass ``token``.

    Args:
        folder: a checkpoint folder (:meth:`BituneModel.save_pretrained`, ``bitune train``'s ``final/``).
        repo_id: ``owner/name``.
        private: create the repository private (None: the Hub's default).
        token: a Hub token (default: the one ``hf auth login`` stored).
        commit_message: the commit's message.

    Returns:
        The URL of the commit.
    """
    from huggingface_hub import CommitOperationAdd, HfApi

    folder = Path(folder)
    if not HUB_ID.match(repo_id):
        raise ValueError(f"push_to_hub: repo_id {repo_id!r} is not a Hub id (owner/name)")
    config = read_config(folder)
    files = {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(path))
                  for name, path in files.items() if name not in (CARD_FILE, EVAL_FILE)]
    evaluation = find_evaluation(folder)
    if evaluation is not None:
        source = folder / evaluation.source
        operations.append(CommitOperationAdd(path_in_repo=EVAL_FILE, path_or_fileobj=str(source)))
        evaluation = Evaluation(EVAL_FILE, evaluation.scores, evaluation.limit, evaluation.created,
                                evaluation.template)
    card = folder / CARD_FILE
    if (card.exists() or card.is_symlink()) and not is_ours(card):
        text = card.read_bytes()
    else:
        head = card.read_text(encoding="utf-8") if card.is_file() else ""
        text = render(config, folder, training_of(head), evaluation, repo_id=repo_id).encode("utf-8")
    operations.append(CommitOperationAdd(path_in_repo=CARD_FILE, path_or_fileobj=text))
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    info = api.create_commit(repo_id, operations, commit_message=commit_message)
    return info.commit_url
