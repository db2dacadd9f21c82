"""A tiny deterministic Lightning job for tests/test_lightning.py (also run as a child that kills itself mid-run).

    python lightning_job.py REPO CKPT_DIR RUN MAX_EPOCHS [KILL_AT_EPOCH]
"""

from __future__ import annotations

import os
import pathlib
import signal
import sys
import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from luopan.lightning import LuopanCheckpointIO

warnings.filterwarnings("ignore")


class Net(L.LightningModule):
    def __init__(self, hidden: int = 8, lr: float = 0.05, data_dir: pathlib.Path = pathlib.Path("/data")) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

    def training_step(self, batch, i):  # noqa: ANN001, ANN201
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):  # noqa: ANN201
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 3)}


def data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


class KillAt(Callback):
    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_start(self, trainer, module) -> None:  # noqa: ANN001
        if trainer.current_epoch == self.epoch:
            os.kill(os.getpid(), signal.SIGKILL)


def fit(repo: str, ckpt_dir: str, run: str, max_epochs: int, ckpt_path: str | None = None,
        kill_at: int | None = None, inputs: list[str] | None = None) -> Net:
    L.seed_everything(0, workers=True)
    model = Net(data_dir=pathlib.Path("/data/train"))
    callbacks: list[Callback] = [ModelCheckpoint(dirpath=ckpt_dir, monitor="loss", save_top_k=2, save_last=True)]
    if kill_at is not None:
        callbacks.append(KillAt(kill_at))
    trainer = L.Trainer(max_epochs=max_epochs, plugins=[LuopanCheckpointIO(repo, run, inputs=inputs)], callbacks=callbacks,
                        deterministic=True, logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, data(), ckpt_path=ckpt_path)
    return model


if __name__ == "__main__":
    args = sys.argv[1:]
    fit(args[0], args[1], args[2], int(args[3]), kill_at=int(args[4]) if len(args) > 4 else None)
