"""A torchrun job of 2 processes x 2 "nodes" (gloo on loopback) reads one service; killed at a
random point and restarted with 3 ranks from its last checkpoint, each epoch is every sample,
repeats bounded by the last checkpoint interval (bench/train_elastic.py)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter

import pytest

pytest.importorskip("torch")

from server_kit import ServerProcess, make_samples, seeded_db  # noqa: E402

N, BATCH, EVERY, EPOCHS = 160, 4, 2, 2


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(launch: list[str], url: str, tmp) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launch, "-m", "dataferry.bench.train_elastic",
            "--url", url, "--dataset", "d", "--ckpt", str(tmp / "loader.json"), "--epochs", str(EPOCHS),
            "--batch-size", str(BATCH), "--every", str(EVERY), "--step-time", "0.05", "--trace", str(tmp)]


def _lines(tmp) -> dict[int, list[dict]]:
    out = {}
    for rank in range(4):
        path = tmp / f"rank{rank}.jsonl"
        rows = path.read_text().splitlines() if path.exists() else []
        out[rank] = [json.loads(r) for r in rows if r.endswith("}")]  # a line cut by the kill is left out
    return out


def test_killed_two_node_job_resumes_with_three_ranks(tmp_path):
    samples = make_samples(N, size=100)
    ids = {s.id for s in samples}
    server = ServerProcess(seeded_db(tmp_path / "db.sqlite", "d", samples))
    try:
        port = _port()
        env = dict(os.environ, OMP_NUM_THREADS="1")
        errs = [tmp_path / f"node{node}.err" for node in (0, 1)]
        nodes = []
        for node, err in enumerate(errs):
            with open(err, "w") as f:
                nodes.append(subprocess.Popen(
                    _job(["--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node), "--master-addr",
                          "127.0.0.1", "--master-port", str(port)], server.url, tmp_path),
                    env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=f))
        per_rank_epoch = -(-N // 4 // BATCH)
        kill_at = random.Random().randint(EVERY + 1, per_rank_epoch + EVERY)  # steps of rank 0
        deadline = time.monotonic() + 120
        while len(_lines(tmp_path)[0]) < kill_at and all(p.poll() is None for p in nodes):
            assert time.monotonic() < deadline, "the job did not reach its kill point"
            time.sleep(0.02)
        assert all(p.poll() is None for p in nodes), [e.read_text()[-2000:] for e in errs]
        for rank in range(4):  # the workers first: torchrun starts them in sessions of their own
            with contextlib.suppress(ProcessLookupError):
                os.kill(int((tmp_path / f"rank{rank}.pid").read_text()), signal.SIGKILL)
        for p in nodes:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)
        time.sleep(0.2)
        first = _lines(tmp_path)
        assert (tmp_path / "loader.json").exists()
        # before the kill: each rank's shard of epoch 0 disjoint, none longer than its equal share
        shards = [{i for row in first[r] if row["epoch"] == 0 for i in row["ids"]} for r in range(4)]
        assert sum(map(len, shards)) == len(set().union(*shards)) and max(map(len, shards)) <= N // 4
        for rank in range(4):
            (tmp_path / f"rank{rank}.jsonl").rename(tmp_path / f"first{rank}.jsonl")

        again = subprocess.run(_job(["--standalone", "--nproc-per-node", "3"], server.url, tmp_path), env=env,
                               capture_output=True, text=True, timeout=120)
        assert again.returncode == 0, again.stderr[-3000:]
        second = _lines(tmp_path)
        assert not second[3]
        for epoch in range(EPOCHS):
            seen = Counter(i for rows in (*first.values(), *second.values()) for row in rows
                           if row["epoch"] == epoch for i in row["ids"])
            assert set(seen) == ids, f"epoch {epoch}: samples missing"
            repeats = sum(seen.values()) - N
            # what was trained on after the last checkpoint (< EVERY steps a rank) comes again, with the deal's padding
            assert repeats <= 4 * EVERY * BATCH + 2, f"epoch {epoch}: {repeats} repeats"
        last = Counter(i for rows in second.values() for row in rows if row["epoch"] == EPOCHS - 1 for i in row["ids"])
        if not any(row["epoch"] == EPOCHS - 1 for rows in first.values() for row in rows):
            assert set(last) == ids and sum(last.values()) == 3 * -(-N // 3), "the epoch after is a normal one"
    finally:
        server.kill()
