"""Training: typed settings (:mod:`.settings`), the training loop (:mod:`.trainer`), its gradient clipping
(:mod:`.gradients`), validation loss (:mod:`.evaluation`), checkpoints (:mod:`.checkpoints`) and log
(:mod:`.logger`), run folders (:mod:`.run_folder`) and the recipe (:mod:`.recipe`); ``bitune train`` is
:mod:`bitune.commands.train`."""

from .settings import TrainSettings, load_settings

__all__ = ["TrainSettings", "load_settings", "train"]


def train(settings: TrainSettings, resume: bool = False, overwrite: bool = False):
    """Run a training job end to end; see :func:`bitune.train.recipe.train`."""
    from .recipe import train as _train  # torch: imported on use, so that settings validation stays light

    return _train(settings, resume=resume, overwrite=overwrite)
