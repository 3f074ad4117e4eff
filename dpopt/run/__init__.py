"""What ``dpopt train`` runs: a config (``config.py``), the run built from it (``build.py``), the loop with its
checkpoints and resume (``loop.py``, ``state.py``) and what a run writes (``outputs.py``). The privacy setup it
asks for lives in the library (``dpopt.plan``)."""

from dpopt.run.build import Run, build_run, freeze_all_but
from dpopt.run.config import CALIBRATIONS, DEFAULT_BATCH, DEFAULT_PHYSICAL_BATCH, TrainConfig
from dpopt.run.loop import extended, resume, train
from dpopt.run.outputs import MODEL_DIR, bar_epsilon, chance_warning, export_model
from dpopt.run.state import saved_steps_per_epoch
from dpopt.run.task import accuracy, classification_loss, logits_of

__all__ = ["CALIBRATIONS", "DEFAULT_BATCH", "DEFAULT_PHYSICAL_BATCH", "MODEL_DIR", "Run", "TrainConfig", "accuracy",
           "bar_epsilon", "build_run", "chance_warning", "classification_loss", "export_model", "extended",
           "freeze_all_but", "logits_of", "resume", "saved_steps_per_epoch", "train"]
