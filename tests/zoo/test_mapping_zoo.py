"""Every (task, family) pair of transformers' six auto-model mappings, tiny, built from its config class on the CPU;
each family's representative pair planned by ``memopt.wrap`` and stepped once exactly (loss and updated parameters
equal an unwrapped step's). A pair that cannot be is in ``unbuildable.json`` with its reason; nothing in the
mappings is neither checked nor listed.

The per-technique exactness checks stay on the representative families of ``test_zoo.py``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.zoo.mapping_zoo import PARAM_LIMIT, build, check_pair, failure, listed, mapping_pairs, representatives

PAIRS = mapping_pairs()
LISTED = listed()
CHECKED = [p for p in PAIRS if p not in LISTED]
FULL = representatives()


def test_every_mapping_pair_is_checked_or_listed_with_a_reason():
    assert len(PAIRS) == len(set(PAIRS)) and len(PAIRS) > 500  # the six mappings were read, not an empty list
    stale = sorted(set(LISTED) - set(PAIRS))
    assert not stale, f"unbuildable.json lists pairs no longer in the mappings: {stale}"
    assert set(CHECKED) | set(LISTED) == set(PAIRS)
    for pair, reason in LISTED.items():
        assert reason.strip() and "\n" not in reason, pair
    assert len(CHECKED) >= 0.8 * len(PAIRS), f"only {len(CHECKED)} of {len(PAIRS)} pairs are checked"


@pytest.mark.parametrize("pair", ["causal_lm:llama", "seq2seq_lm:t5", "image_classification:convnext"])
def test_the_tiny_builder_makes_small_models(pair):
    n = sum(p.numel() for p in build(pair).parameters())
    assert 0 < n < PARAM_LIMIT / 10, (pair, n)


@pytest.mark.parametrize("pair", [p for p in CHECKED if p not in FULL])
def test_pair_is_built_tiny(pair):
    build(pair)  # raises past the parameter limit


@pytest.mark.slow
@pytest.mark.parametrize("pair", [p for p in CHECKED if p in FULL])
def test_family_is_built_tiny_planned_and_steps_exactly(pair):
    check_pair(pair)


@pytest.mark.slow
@pytest.mark.parametrize("pair", sorted(LISTED))
def test_listed_pair_still_fails_for_its_reason(pair):
    reason = failure(pair, full=pair in FULL)
    assert reason is not None, f"{pair} passes now: regenerate unbuildable.json (python -m tests.zoo.make_unbuildable)"
    assert reason.split(":")[0] == LISTED[pair].split(":")[0], (reason, LISTED[pair])


def test_torchvision_is_still_unavailable():
    """torchvision's classifiers join the zoo once it imports beside the pinned torch (see TORCHVISION_REASON)."""
    done = subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True, text=True)
    assert done.returncode != 0, "torchvision imports now: add its classifiers to the zoo"
