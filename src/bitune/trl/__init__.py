"""Training a Bitune model with TRL (optional extra ``trl``): :class:`BituneSFTTrainer`.

``from bitune.trl import BituneSFTTrainer`` imports TRL; nothing else in bitune does.
"""

from .trainer import BituneSFTTrainer, TrainerModel

__all__ = ["BituneSFTTrainer", "TrainerModel"]
