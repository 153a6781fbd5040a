"""Lightning's Trainer on a TorchIterator: stopped mid-epoch after a checkpoint, resumed with
``ckpt_path=``, the epoch's samples are trained on exactly once, and the next epoch is whole."""

from __future__ import annotations

from collections import Counter

import pytest

pytest.importorskip("torch")
pytest.importorskip("pytorch_lightning")

from test_torch_path import jpeg_samples  # noqa: E402

from dataferry.bench.train_lightning import fit  # noqa: E402
from dataferry.client import MemorySource  # noqa: E402

N, BATCH, STOP = 40, 4, 7

# Lightning 2.6 on torch 2.13: its pytree use is deprecated (not dataferry's)
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")


def test_trainer_checkpoint_resumes_the_epoch_exactly(tmp_path):
    samples = jpeg_samples(N)
    first = fit(MemorySource("pets", samples), "pets", str(tmp_path), batch_size=BATCH, stop_after=STOP)
    assert [e for e, _ in first.seen] == [0] * STOP
    assert (tmp_path / "last.ckpt").exists()
    again = fit(MemorySource("pets", samples), "pets", str(tmp_path), batch_size=BATCH)
    seen = first.seen + again.seen
    epoch0 = Counter(i for e, ids in seen if e == 0 for i in ids)
    epoch1 = Counter(i for e, ids in seen if e == 1 for i in ids)
    assert set(epoch0) == set(range(N)) and max(epoch0.values()) == 1, "epoch 0 once, across the restart"
    assert set(epoch1) == set(range(N)) and max(epoch1.values()) == 1
    assert len(again.seen) == 2 * N // BATCH - STOP


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_torchdata_stateful_dataloader_resumes_the_epoch_exactly():
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    from dataferry.client import EvalTransform, Loader, PlanOptions, TorchIterator

    samples = jpeg_samples(N)
    seen: list[tuple[int, int]] = []

    def run(state=None, take=None):
        with Loader(MemorySource("pets", samples), "pets", batch_size=BATCH, plan=PlanOptions(seed=1)) as loader, \
                TorchIterator(loader, EvalTransform(size=8, resize=8), workers=1) as it:
            dl = sdl.StatefulDataLoader(it, batch_size=None, num_workers=0)
            if state is not None:
                dl.load_state_dict(state)
            if take is not None:
                batches = iter(dl)
                seen.extend((b.epoch, i) for _ in range(take) for b in [next(batches)] for i in b.ids.tolist())
                return dl.state_dict()
            for _ in range(2):
                seen.extend((b.epoch, i) for b in dl for i in b.ids.tolist())

    run(state=run(take=STOP))
    for epoch in (0, 1):
        got = Counter(i for e, i in seen if e == epoch)
        assert set(got) == set(range(N)) and max(got.values()) == 1, f"epoch {epoch}"
