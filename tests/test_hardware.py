"""Decode defaults that follow the machine: cores, and the GPU's hardware JPEG decoder."""

from __future__ import annotations

import logging
import os

import pytest

from dataferry.client._hardware import DALI_HW_LOAD, FAST_HW_LOAD, decoder_defaults, usable_cores


def test_usable_cores_follow_affinity_and_split_among_local_ranks():
    cores = len(os.sched_getaffinity(0))
    assert usable_cores({}) == cores
    assert usable_cores({"LOCAL_WORLD_SIZE": "2"}) == max(1, cores // 2)
    assert usable_cores({"LOCAL_WORLD_SIZE": str(cores * 8)}) == 1  # never 0
    assert usable_cores({"LOCAL_WORLD_SIZE": "x"}) == cores  # a garbled variable is ignored


@pytest.mark.parametrize("capability, name, threads, load", [
    ((9, 0), "NVIDIA H100 80GB HBM3", 4, FAST_HW_LOAD),
    ((9, 0), "NVIDIA H200", 4, FAST_HW_LOAD),
    ((10, 0), "NVIDIA B200", 4, FAST_HW_LOAD),
    ((8, 0), "NVIDIA A100-SXM4-80GB", 8, DALI_HW_LOAD),
    ((8, 6), "NVIDIA A10", 8, DALI_HW_LOAD),
    ((12, 0), "NVIDIA GeForce RTX 5090", 8, DALI_HW_LOAD),
])
def test_gpu_defaults_follow_the_hardware_decoder(capability, name, threads, load):
    d = decoder_defaults("gpu", capability, name, cores=16)
    assert (d.threads, d.hw_decoder_load) == (threads, load)
    assert name in d.reason


def test_threads_never_exceed_the_usable_cores():
    assert decoder_defaults("gpu", (9, 0), "H100", cores=2).threads == 2
    assert decoder_defaults("gpu", (8, 0), "A100", cores=3).threads == 3
    assert decoder_defaults("cpu", None, "", cores=16).threads == 15  # one core stays for the loader's engine
    assert decoder_defaults("cpu", None, "", cores=1).threads == 1


def test_dali_options_default_to_the_machine_and_explicit_values_win(caplog):
    pytest.importorskip("nvidia.dali")
    from dataferry.client import DaliOptions

    cores = usable_cores()
    with caplog.at_level(logging.INFO, "dataferry.client"):
        assert DaliOptions(device="cpu").decoding("cpu", None, None) == (max(1, cores - 1), DALI_HW_LOAD)
    assert "DALI on cpu" in caplog.text and "override" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, "dataferry.client"):
        assert DaliOptions(device="cpu", num_threads=3).decoding("cpu", None, None) == (3, DALI_HW_LOAD)
    assert caplog.text == ""  # nothing chosen for the user, nothing logged
    assert DaliOptions(hw_decoder_load=0.5).hw_decoder_load == 0.5
