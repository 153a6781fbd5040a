"""The ``dataferry`` command line, run in-process (and once as a real process)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from oddfiles import build_odd_tree, noise_image

from dataferry.schema.cli import main


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    return build_odd_tree(tmp_path_factory.mktemp("odd") / "tree")


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_help_is_fast_and_imports_nothing_heavy():
    probe = (
        "import sys, contextlib, io\n"
        "from dataferry.schema.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['--help']) == 0\n"
        "heavy = [m for m in ('numpy', 'PIL', 'asyncio', 'sqlite3', 'cassandra', 'tqdm') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    subprocess.run([sys.executable, "-m", "dataferry.schema.cli", "--help"], capture_output=True, check=True)
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "dataferry.schema.cli", "--help"], capture_output=True, text=True)
    assert time.perf_counter() - t0 < 1.0
    assert done.returncode == 0 and "ingest" in done.stdout and "demo" in done.stdout


def test_ingest_reports_rejects_and_exit_codes(store_url, dataset_name, odd, capsys):
    code, out, err = cli(capsys, "ingest", odd.root, "--dataset", dataset_name, "--store", store_url, "--quiet",
                         "--workers", 2)
    assert code == 1, err
    assert f"ingested         {len(odd.valid)}" in out and f"rejected         {len(odd.bad)}" in out
    for rel, reason in odd.bad.items():
        assert f"rejected: {rel}: {reason}" in out
    assert f"skipped          {len(odd.junk)} non-image files" in out
    code, out, err = cli(capsys, "ingest", odd.root, "--dataset", dataset_name, "--store", store_url, "-q",
                         "--allow-rejects")
    assert code == 0, err
    assert "ingested         0" in out and f"already present  {len(odd.valid)}" in out


def test_ingest_clean_tree_exits_zero(store_url, dataset_name, tmp_path, capsys):
    (tmp_path / "only").mkdir()
    noise_image(20, 20).save(tmp_path / "only" / "a.png")
    code, out, _ = cli(capsys, "ingest", tmp_path, "--dataset", dataset_name, "--store", store_url, "-q",
                       "--format", "jpeg", "--max-side", 10)
    assert code == 0 and "ingested         1" in out


def test_split_and_ls(store_url, dataset_name, tmp_path, capsys):
    for cls in ("a", "b"):
        (tmp_path / cls).mkdir()
        for k in range(10):
            noise_image(8, 8, seed=k).save(tmp_path / cls / f"{k}.png")
    assert cli(capsys, "ingest", tmp_path, "--dataset", dataset_name, "--store", store_url, "-q")[0] == 0
    code, out, err = cli(capsys, "split", "--dataset", dataset_name, "--ratios", "train=0.8,val=0.2", "--stratify",
                         "--store", store_url)
    assert code == 0, err
    assert "train       16  80.0%" in out and "val          4  20.0%" in out
    code, out, _ = cli(capsys, "ls", "--store", store_url)
    assert code == 0 and "DATASET" in out
    line = next(ln for ln in out.splitlines() if ln.startswith(dataset_name))
    assert line.split()[1:5] == ["20", "2", "all=20", "train=16"]
    code, out, _ = cli(capsys, "ls", dataset_name, "--store", store_url)
    assert code == 0 and "classes: a, b" in out
    assert [ln.split() for ln in out.splitlines()[-3:]] == [["all", "20"], ["train", "16"], ["val", "4"]]
    code, out, _ = cli(capsys, "split", "--dataset", dataset_name, "--ratios", "train=0.5,test=0.5", "--store", store_url)
    assert code == 0 and "note: other splits left as they were and may overlap these: val" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["ls", "nope"], "unknown dataset 'nope'"),
        (["split", "--dataset", "nope", "--ratios", "a=1"], "unknown dataset 'nope' in "),
        (["split", "--dataset", "x", "--ratios", "a=0.5"], "must sum to 1"),
        (["ingest", "--dataset", "x"], "give SRC or --synthetic N"),
        (["ingest", "/no/such/dir", "--dataset", "x"], "source '/no/such/dir' does not exist"),
        (["ingest", ".", "--dataset", "bad name"], "invalid dataset name"),
        (["ingest", ".", "--dataset", "x", "--seed", "3"], "go with --synthetic"),
        (["ingest", ".", "--dataset", "x", "--max-side", "9"], "needs a format"),
    ],
)
def test_errors_are_one_clean_line(store_url, tmp_path, capsys, argv, message):
    if store_url.startswith("sqlite"):
        _touch_sqlite(store_url)  # ls and split do not create a missing store
    code, out, err = cli(capsys, *argv, "--store", store_url)
    assert code == 2
    assert err.startswith("dataferry: error: ") and message in err and err.count("\n") == 1, err
    assert "Traceback" not in err


def _touch_sqlite(url):
    import asyncio

    from dataferry.schema import open_store

    async def go():
        store = await open_store(url)
        await store.close()

    asyncio.run(go())


def test_usage_errors_exit_2(capsys):
    assert main([]) == 2
    assert main(["ingest", ".", "--dataset", "x", "--format", "bmp"]) == 2
    assert main(["frobnicate"]) == 2
    assert "invalid choice" in capsys.readouterr().err
    assert main(["--help"]) == 0


def test_missing_sqlite_store_is_not_created_by_ls(tmp_path, capsys):
    code, _, err = cli(capsys, "ls", "--store", f"sqlite:{tmp_path / 'none.db'}")
    assert code == 2 and "does not exist" in err and not (tmp_path / "none.db").exists()


def test_ingest_synthetic_keep_dir(store_url, dataset_name, tmp_path, capsys):
    code, out, err = cli(capsys, "ingest", "--synthetic", 24, "--classes", 3, "--seed", 4, "--dataset", dataset_name,
                         "--store", store_url, "--keep-dir", tmp_path / "syn", "-q")
    assert code == 0, err
    assert "generated 24 images in 3 classes" in out and "ingested         24" in out
    assert len(list((tmp_path / "syn").rglob("*.jpg"))) == 24


def test_demo_streams_exactly_once_and_is_idempotent(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = ("demo", "--images", 30, "-q", "--rtt", 20, "--epochs", 2, "--naive-seconds", 0.3)
    code, out, err = cli(capsys, *args)
    assert code == 0, err
    assert "30 ingested, 0 already present" in out
    assert "each sample exactly once, checksums verified" in out
    assert out.count("(partly prefetched)") == 2 and "naive (1 request in flight, 1 sample each)" in out
    # the headline is total samples over total wall time, within 2% (issue 12)
    row = next(line for line in out.splitlines() if "dataferry (completion order" in line)
    samples, rate, _mb, seconds = (float(c.replace(",", "")) for c in row.strip("| ").split(" | ")[1:])
    rounding = samples * 0.0005 / seconds**2 + 0.5  # seconds printed to 3 decimals, the rate to 0
    assert samples == 60 and abs(rate - samples / seconds) <= 0.02 * rate + rounding
    headline = next(line for line in out.splitlines() if line.startswith("headline:"))
    assert f"dataferry {rate:,.0f} samples/s" in headline and "naive" in headline
    assert (tmp_path / "dataferry-demo.db").exists()
    code, out, err = cli(capsys, *args)
    assert code == 0, err
    assert "0 ingested, 30 already present" in out


def test_schema_show_and_apply_needs_cassandra(capsys):
    code, out, _ = cli(capsys, "schema", "show", "--store", "cassandra://db1/myks", "--replication", "SimpleStrategy:3")
    assert code == 0 and "CREATE KEYSPACE myks" in out and "'replication_factor': '3'" in out
    assert "CREATE TABLE myks.samples" in out
    code, _, err = cli(capsys, "schema", "apply", "--store", "sqlite:x.db")
    assert code == 2 and "is for cassandra:// stores" in err
    code, _, err = cli(capsys, "schema", "show", "--replication", "Bogus:1")
    assert code == 2 and "invalid replication 'Bogus:1'" in err


@pytest.mark.cassandra
def test_schema_apply_on_a_real_server(cassandra_server, capsys):
    host, port = cassandra_server
    url = f"cassandra://{host}:{port}/dft_cli_{int(time.time() * 1000) % 10**9}"
    for _ in range(2):  # idempotent
        code, out, err = cli(capsys, "schema", "apply", "--store", url)
        assert code == 0, err
        assert "schema applied to keyspace" in out
    code, out, err = cli(capsys, "ls", "--store", url)
    assert code == 0 and "no datasets" in out, err


@pytest.mark.parametrize("name, option", [("serve", "--port"), ("latency-proxy", "--upstream")])
def test_subcommands_of_other_packages_are_wired_lazily(name, option, capsys):
    assert main([name, "--help"]) == 0
    assert option in capsys.readouterr().out


def test_a_config_error_from_another_package_is_one_line(capsys):
    code, _, err = cli(capsys, "latency-proxy", "--upstream", "nohost")
    assert code == 2 and err.startswith("dataferry: error: bad --upstream address") and err.count("\n") == 1
