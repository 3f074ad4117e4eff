"""What ``dpopt train`` runs: a config (``config.py``), the run built from it (``build.py``), the loop with its
checkpoints and resume (``loop.py``, ``state.py``) and what a run writes (``outputs.py``). The privacy setup it
asks for, the task's loss and accuracy and the export of the trained model live in the library (``dpopt.plan``,
``dpopt.task``, ``dpopt.export``), which federated runs share."""

from dpopt.run.build import Run, build_run, freeze_all_but
from dpopt.run.config import CALIBRATIONS, DEFAULT_BATCH, DEFAULT_PHYSICAL_BATCH, TrainConfig
from dpopt.run.loop import extended, resume, train
from dpopt.export import MODEL_DIR, export_model
from dpopt.run.outputs import bar_epsilon, chance_warning
from dpopt.run.state import saved_steps_per_epoch
from dpopt.task import accuracy, classification_loss, logits_of

__all__ = ["CALIBRATIONS", "DEFAULT_BATCH", "DEFAULT_PHYSICAL_BATCH", "MODEL_DIR", "Run", "TrainConfig", "accuracy",
           "bar_epsilon", "build_run", "chance_warning", "classification_loss", "export_model", "extended",
           "freeze_all_but", "logits_of", "resume", "saved_steps_per_epoch", "train"]
