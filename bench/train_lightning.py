"""Lightning's Trainer on a ``TorchIterator``: mid-epoch checkpoints carry the loader's state.

    python -m dataferry.bench.train_lightning --url URL --dataset NAME --ckpt-dir DIR [--epochs 2]
        [--stop-after STEPS]   # then the same command again resumes from DIR/last.ckpt

The iterator goes to ``Trainer.fit`` as the train dataloader itself (it has ``__len__``,
so Lightning fetches no batch ahead and calls its ``state_dict()`` at each checkpoint);
``ckpt_path=`` restores it and the epoch goes on exactly. Recipe: deploy/TRAINING.md.
"""

from __future__ import annotations

import argparse
import os

__all__ = ["fit", "main"]


class Preempted(RuntimeError):
    """Raised by ``--stop-after``: the job is stopped as a preemption would stop it."""


def _module(classes: int, size: int):
    import pytorch_lightning as pl
    import torch

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(3 * size * size, classes)
            self.seen: list[tuple[int, list[int]]] = []  # (epoch, ids) of each batch trained on

        def training_step(self, batch, batch_idx):
            self.seen.append((batch.epoch, batch.ids.tolist()))
            return torch.nn.functional.cross_entropy(self.net(batch.images.flatten(1)), batch.labels % classes)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Tiny()


def _stopper(after: int):
    import pytorch_lightning as pl

    class Stop(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step >= after:  # the checkpoint of step `after` is written
                raise Preempted(f"stopped after {after} steps")

    return Stop()


def fit(source, dataset: str, ckpt_dir: str, *, epochs: int = 2, batch_size: int = 4, size: int = 16,
        classes: int = 5, stop_after: int | None = None, seed: int = 0):
    """Train ``epochs`` from ``source`` (a URL or a source), a checkpoint every step in
    ``ckpt_dir``, resuming from its ``last.ckpt`` if there; the module (``seen``: what it trained on)."""
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint

    from dataferry.client import EvalTransform, Loader, PlanOptions, TorchIterator

    last = os.path.join(ckpt_dir, "last.ckpt")
    model = _module(classes, size)
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=0, save_last=True)]
    if stop_after is not None:
        callbacks.append(_stopper(stop_after))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False, callbacks=callbacks,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    with Loader(source, dataset, batch_size=batch_size, plan=PlanOptions(seed=seed)) as loader, \
            TorchIterator(loader, EvalTransform(size=size, resize=size), workers=2) as it:
        try:
            trainer.fit(model, train_dataloaders=it, ckpt_path=last if os.path.exists(last) else None)
        except Preempted:
            pass
    return model


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--stop-after", type=int, default=None, help="stop after this many steps (a preemption)")
    a = ap.parse_args(argv)
    model = fit(a.url, a.dataset, a.ckpt_dir, epochs=a.epochs, batch_size=a.batch_size, stop_after=a.stop_after)
    print(f"trained on {sum(len(ids) for _, ids in model.seen)} samples in {len(model.seen)} steps")


if __name__ == "__main__":
    main()
