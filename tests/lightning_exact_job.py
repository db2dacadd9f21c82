"""A tiny Lightning job with dropout, a shuffled DataLoader and a validation loss, for tests/test_lightning_exact.py
and benchmarks/stacks_lightning.py (also run as a child that SIGKILLs itself at the start of an epoch).

    python lightning_exact_job.py REPO CKPT_DIR RUN MAX_EPOCHS EXACT(0|1) [KILL_AT_EPOCH]

REPO "-" runs Lightning's own default (torch.save .ckpt files) instead of luopan.
"""

from __future__ import annotations

import os
import signal
import sys
import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from luopan.lightning import ExactResume, LuopanCheckpointIO

warnings.filterwarnings("ignore")
HIDDEN = 256


class DropNet(L.LightningModule):
    def __init__(self, hidden: int = HIDDEN, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                         torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                         torch.nn.Linear(hidden, 1))

    def training_step(self, batch, i):  # noqa: ANN001, ANN201
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, i):  # noqa: ANN001, ANN201
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def loaders() -> tuple[torch.utils.data.DataLoader, torch.utils.data.DataLoader]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 16, generator=g)
    y = x[:, :4].sum(1, keepdim=True) - x[:, 4:8].prod(1, keepdim=True)
    train = torch.utils.data.TensorDataset(x[:64], y[:64])
    val = torch.utils.data.TensorDataset(x[64:], y[64:])
    return (torch.utils.data.DataLoader(train, batch_size=8, shuffle=True),
            torch.utils.data.DataLoader(val, batch_size=16))


class KillAt(Callback):
    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_start(self, trainer, module) -> None:  # noqa: ANN001
        if trainer.current_epoch == self.epoch:
            os.kill(os.getpid(), signal.SIGKILL)


def trainer(repo: str | None, ckpt_dir: str, run: str, max_epochs: int, *, exact: bool = True,
            kill_at: int | None = None, extra: list[Callback] | None = None) -> L.Trainer:
    callbacks: list[Callback] = [ModelCheckpoint(dirpath=ckpt_dir, monitor="val_loss", save_top_k=2, save_last=True)]
    if exact:
        callbacks.append(ExactResume())
    if kill_at is not None:
        callbacks.append(KillAt(kill_at))
    callbacks += extra or []
    plugins = [LuopanCheckpointIO(repo, run)] if repo is not None else []
    return L.Trainer(max_epochs=max_epochs, plugins=plugins, callbacks=callbacks, logger=False,
                     enable_progress_bar=False, enable_model_summary=False)


def fit(repo: str | None, ckpt_dir: str, run: str, max_epochs: int, *, exact: bool = True,
        ckpt_path: str | None = None, kill_at: int | None = None, extra: list[Callback] | None = None) -> DropNet:
    L.seed_everything(0)
    model = DropNet()
    train, val = loaders()
    trainer(repo, ckpt_dir, run, max_epochs, exact=exact, kill_at=kill_at, extra=extra).fit(
        model, train, val, ckpt_path=ckpt_path)
    return model


if __name__ == "__main__":
    args = sys.argv[1:]
    fit(None if args[0] == "-" else args[0], args[1], args[2], int(args[3]), exact=args[4] == "1",
        kill_at=int(args[5]) if len(args) > 5 else None)
