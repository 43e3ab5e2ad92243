"""Behaviour kept byte for byte: the plan files of the bundled examples, along several option paths, hash to the
digests recorded below. A change that moves code without meaning to change an answer must keep them; one that
changes answers on purpose records the new digests (printed by a failure) and says why in its commit.

Recorded with every FASOP experiment (docs/cost-model.md) and the README's examples, on the cost model of the
recomputation fix of round 3 (each chunk recomputes its own first layers), with the plans on every node (--use-all:
plans that leave node types idle came later, and leave these unchanged) and without the memory headroom's ranking
(--memory-headroom 1: the headroom came later, reorders plans above it and changes no estimate; tests/test_headroom.py
checks its ranking)."""

from __future__ import annotations

import hashlib

import pytest

from fasop.cli import main

SEARCHES = {
    "gpt2-xl fasop-8xA10": [],
    "gpt2-xl fasop-1xA100-7xA10": [],
    "bert fasop-4xA10": [],
    "bert fasop-1xA100-3xA10": [],
    "t5 fasop-8xA10": [],
    "t5 fasop-1xA100-7xA10": [],
    "gpt2-xl fasop-1xA100-3xA10 csv": ["--no-overlap", "--no-distributed-optimizer", "--sort", "cost"],
    "bert fasop-1xA100-7xA10 csv": ["--recompute", "none,selective", "--no-sequence-parallel", "--train-tokens",
                                   "1e9", "--gbs", "128"],
    "llama2-7b pareto-h100-a100-a10g": ["--recompute", "full", "--gbs", "64"],
}
DIGESTS = {
    "gpt2-xl fasop-8xA10": "23d048095ca8916f06a9ff221a065ad502db52dcbb6fc10d3c06ffc79153981a",
    "gpt2-xl fasop-1xA100-7xA10": "c8732a9b4666c955c95c6ea221312c72bf684b9e11c050e7aee88a6cabb68cd2",
    "bert fasop-4xA10": "95167f45e4e64af73fc975fec94d08ad4f563aa3139b5b242655ac57a28721f2",
    "bert fasop-1xA100-3xA10": "287a3ee8d02cdea82c61b0473be18467cfbb1d96e20eeb64a6f0cb988a0dda7f",
    "t5 fasop-8xA10": "6bc77a7ad1c8ccc65590d0b6658abe39783b522da09ec32daf69c34970d81945",
    "t5 fasop-1xA100-7xA10": "3c2a9ca214b5492fcee3a18270ba25f95319a9aab0b080e72ef73a413579352f",
    "gpt2-xl fasop-1xA100-3xA10 csv": "6504abf57e9fc674229456544172ed0466b8c9a144d3f8f003ad05184ecbb658",
    "bert fasop-1xA100-7xA10 csv": "b05b7fa7121385a08369599054efe1844f600fb4e164bb4b6ce822b4895f99e6",
    "llama2-7b pareto-h100-a100-a10g": "f4a2b8c2868df2527a049bd75e7462af2f01513001878b88cede11f04038a36a",
}


@pytest.mark.parametrize("name", sorted(SEARCHES))
def test_bundled_examples_plan_as_recorded(runner, tmp_path, name):
    model, cluster, *fmt = name.split()
    output = tmp_path / f"plans.{fmt[0] if fmt else 'json'}"
    result = runner.invoke(main, ["search", "--model", model, "--cluster", cluster, "--use-all", "--memory-headroom", "1",
                                  *SEARCHES[name],
                                  "--output", str(output)])
    assert result.exit_code == 0, (result.output, result.exception)
    digest = hashlib.sha256(output.read_bytes()).hexdigest()
    assert digest == DIGESTS.get(name), f"{name}: plan file hashes to {digest}"
