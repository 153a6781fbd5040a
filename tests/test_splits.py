"""make_splits: deterministic, disjoint, covering, close to the ratios."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataferry.schema import ConfigError, IdList
from dataferry.schema._splits import make_splits, parse_ratios, split_counts


def idlist(n: int, classes: int = 3, seed: int = 0) -> IdList:
    rng = np.random.default_rng(seed)
    ids = rng.choice(np.iinfo(np.int64).max, size=n, replace=False) - (1 << 62)
    return IdList(ids, rng.integers(0, classes, n))


ratio_sets = st.lists(st.integers(1, 20), min_size=1, max_size=4).map(
    lambda ws: {f"s{i}": w / sum(ws) for i, w in enumerate(ws)}
)


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 400), classes=st.integers(1, 12), ratios=ratio_sets, stratify=st.booleans(), seed=st.integers(0, 9))
def test_splits_are_disjoint_covering_and_close_to_the_ratios(n, classes, ratios, stratify, seed):
    ids = idlist(n, classes, seed)
    out = make_splits(ids, ratios, stratify=stratify, seed=seed)
    assert list(out) == list(ratios)
    everything = np.concatenate([s.ids for s in out.values()])
    assert sorted(everything.tolist()) == sorted(ids.ids.tolist())  # covering and disjoint
    label_of = dict(zip(ids.ids.tolist(), ids.labels.tolist()))
    for name, split in out.items():
        assert np.all(np.diff(split.ids) > 0)  # sorted, no duplicates
        assert all(label_of[i] == lab for i, lab in zip(split.ids.tolist(), split.labels.tolist()))
        assert abs(len(split) - n * ratios[name]) < (2 if stratify else 1)
        if stratify:
            for lab in np.unique(ids.labels):
                want = np.count_nonzero(ids.labels == lab) * ratios[name]
                assert abs(np.count_nonzero(split.labels == lab) - want) < 1


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 300), seed=st.integers(0, 5), stratify=st.booleans())
def test_splits_are_deterministic_whatever_the_input_order(n, seed, stratify):
    ids = idlist(n, 4, seed)
    perm = np.random.default_rng(seed + 1).permutation(n)
    shuffled = IdList(ids.ids[perm], ids.labels[perm])
    ratios = {"train": 0.7, "val": 0.2, "test": 0.1}
    a = make_splits(ids, ratios, stratify=stratify, seed=seed)
    assert a == make_splits(shuffled, ratios, stratify=stratify, seed=seed)
    assert a == make_splits(ids, ratios, stratify=stratify, seed=seed)


def test_a_different_seed_gives_different_splits():
    ids = idlist(1000)
    a = make_splits(ids, {"train": 0.5, "val": 0.5}, seed=1)
    b = make_splits(ids, {"train": 0.5, "val": 0.5}, seed=2)
    assert len(a["train"]) == len(b["train"]) == 500 and a["train"] != b["train"]


def test_rare_labels_do_not_all_land_in_the_first_split():
    ids = IdList(np.arange(300), np.repeat(np.arange(100), 3))
    out = make_splits(ids, {"train": 0.8, "val": 0.1, "test": 0.1}, stratify=True, seed=0)
    assert [len(s) for s in out.values()] == [240, 30, 30]


def test_split_counts_largest_remainder():
    assert split_counts(10, {"a": 0.5, "b": 0.5}) == {"a": 5, "b": 5}
    assert split_counts(7, {"a": 0.5, "b": 0.5}) == {"a": 4, "b": 3}  # tie to the first named
    assert split_counts(10, {"a": 0.66, "b": 0.17, "c": 0.17}) == {"a": 6, "b": 2, "c": 2}
    assert split_counts(10, {"a": 0.68, "b": 0.16, "c": 0.16}) == {"a": 7, "b": 2, "c": 1}
    assert split_counts(0, {"a": 1.0}) == {"a": 0}


def test_parse_ratios():
    assert parse_ratios("train=0.8, val=0.1,test=0.1") == {"train": 0.8, "val": 0.1, "test": 0.1}


@pytest.mark.parametrize(
    "text, match",
    [
        ("train=0.8,val=0.1", "must sum to 1, got 0.9"),
        ("train=0.8,val=0.3", "must sum to 1"),
        ("all=1", "reserved"),
        ("train=1.2,val=-0.2", "must be in"),
        ("train=x", "not a number"),
        ("train", "name=fraction"),
        ("train=0.5,train=0.5", "given twice"),
        ("bad name=1", "invalid split name"),
        ("train=nan", "must be in"),
    ],
)
def test_bad_ratios_are_config_errors(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_ratios(text)


def test_make_splits_checks_its_input():
    with pytest.raises(ConfigError, match="no splits"):
        make_splits(idlist(3), {})
    with pytest.raises(ConfigError, match="must sum to 1"):
        make_splits(idlist(3), {"a": 0.5})
    with pytest.raises(ConfigError, match="id 7 appears more than once"):
        make_splits(IdList(np.array([7, 7, 8]), np.zeros(3)), {"a": 1.0})
