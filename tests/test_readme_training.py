"""The README's standalone training examples (pipeline and data-parallel splits, a folder of text, a sweep), pasted
into bash in a fresh folder, with a few training steps where they set none (test_front_door.shortened): each exits 0. The README's other examples run in
tests/test_front_door.py (test_the_readme_examples_on_the_main_jobs_run_dir_run_verbatim); this file holds these so
that pytest-xdist (--dist loadfile) can run the two halves on two workers."""

from __future__ import annotations

import pytest
from test_front_door import readme_examples, run_verbatim, shortened, standalone_training


@pytest.mark.slow
def test_the_readme_training_examples_run_verbatim_in_a_fresh_folder(tmp_path):
    lines = [line for line in readme_examples() if standalone_training(line)]
    assert len(lines) >= 4 and any(" -m " in line for line in lines)  # the sweep among them
    run_verbatim([shortened(line) for line in lines], tmp_path)
