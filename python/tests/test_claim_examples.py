"""The claim examples run as written, each from its document's text as
``python NAME`` (readme_examples.run_example: nothing patched, no argument
or environment the document does not give, every process stopped by its
pid, bounded):

- the README's "Streaming GRPO across processes"
  (python/examples/grpo_stream.py; test_readme_example.py checks the block
  is that file): numpy only, so it runs wherever these tests do.
"""

import re

from readme_examples import readme_block, run_example

GRPO_STREAM = "## Streaming GRPO across processes"


def test_readme_grpo_stream_runs_as_written():
    run = run_example(readme_block(GRPO_STREAM), "grpo_stream.py", timeout=300)
    assert run.returncode == 0, run.explain()
    assert run.stdout.endswith("GRPO stream done\n"), run.explain()
    # What the example says it did, checked against what it was set up to do.
    ranks = re.findall(
        r"^trainer rank (\d+): (\d+) groups, (\d+) samples, (\d+) steps$", run.stdout, re.M
    )
    assert sorted(int(r[0]) for r in ranks) == [0, 1], run.explain()
    groups = sum(int(r[1]) for r in ranks)
    samples = sum(int(r[2]) for r in ranks)
    assert (groups, samples) == (12, 48), run.explain()
    for _, g, s, steps in ranks:
        assert int(s) == 4 * int(g), run.explain()  # whole groups of 4 only
        assert 1 <= int(steps) <= int(g), run.explain()
    assert "48 samples (12 groups of 4), each rewarded and trained once" in run.stdout
