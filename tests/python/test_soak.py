"""Soak (the short version of tools/soak.py): 100,000 calls of steady-state replay on the CPU, a mix
of 3 keys, outputs kept raw, cloned and dropped: every checked result equals eager, and RSS, pool
bytes, captures, cache entries and handed-out storages stay flat after warm-up."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
from soak import soak  # noqa: E402


@pytest.mark.parametrize("entry", ["capture", "compile"])
def test_soak_100k_calls_flat_memory(entry):
    threads = torch.get_num_threads()
    try:
        r = soak(calls=100_000, entry=entry, warmup=10_000, check_every=101)
    finally:
        torch.set_num_threads(threads)
    assert r["mismatches"] == 0, r
    assert r["errors"] == 0 and r["eager_fallbacks"] == 0, r
    assert r["replays"] >= 100_000 - 3, r
    for k in ("captures", "cache_entries", "pool_bytes"):
        assert r[k][0] == r[k][1], (k, r)
    assert r["captures"][1] == 3 and r["cache_entries"][1] == 3, r
    assert r["handed_out"][1] <= 1, r    # the latest replay's one buffer (y and y.t() share it)
    assert r["rss_growth_bytes"] < 1 << 20, r
