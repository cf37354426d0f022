"""Training: typed settings (:mod:`.settings`), the training loop (:mod:`.trainer`), its checkpoints
(:mod:`.checkpoints`) and log (:mod:`.logger`), run folders (:mod:`.run_folder`), the recipe (:mod:`.recipe`) and
the ``bitune train`` verb (:mod:`.cli`)."""

from .settings import TrainSettings, load_settings

__all__ = ["TrainSettings", "load_settings", "train"]


def train(settings: TrainSettings, resume: bool = False, overwrite: bool = False):
    """Run a training job end to end; see :func:`bitune.train.recipe.train`."""
    from .recipe import train as _train

    return _train(settings, resume=resume, overwrite=overwrite)
