"""The claim examples run as written, each from its document's text as
``python NAME`` (readme_examples.run_example: nothing patched, no argument
or environment the document does not give, every process stopped by its
pid, bounded):

- the README's "Streaming GRPO across processes"
  (python/examples/grpo_stream.py; test_readme_example.py checks the block
  is that file): numpy only, so it runs wherever these tests do;
- docs/nemo-rl.md's "How a NeMo-RL job switches"
  (examples/nemo_rl_switch.py): needs ray, torch and tensordict, so it runs
  where they are installed (the NeMo-RL tests' environment) and is skipped
  elsewhere.
"""

import importlib.util
import re

import pytest
from readme_examples import ROOT, readme_block, run_example

GRPO_STREAM = "## Streaming GRPO across processes"
NEMO_RL_DOC = ROOT / "docs/nemo-rl.md"
NEMO_RL_SWITCH = "## How a NeMo-RL job switches"

missing = [m for m in ("ray", "torch", "tensordict") if importlib.util.find_spec(m) is None]
needs_nemo_rl_stack = pytest.mark.skipif(
    bool(missing), reason=f"needs {', '.join(missing)} (pip install 'stowage-rl[ray,nemo-rl]')"
)


def doc_block(path, heading: str) -> str:
    """The first python block of the section `heading` of the document at `path`."""
    text = path.read_text()
    assert heading in text, f"no {heading!r} section in {path.name}"
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    found = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert found, f"no python block under {heading!r} in {path.name}"
    return found[0]


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


def test_nemo_rl_switch_doc_block_is_the_example_file():
    assert (
        doc_block(NEMO_RL_DOC, NEMO_RL_SWITCH) == (ROOT / "examples/nemo_rl_switch.py").read_text()
    )


@needs_nemo_rl_stack
@pytest.mark.parametrize("ray_cpus", [None, 2], ids=["fresh-machine", "2-cpu-ray"])
def test_nemo_rl_switch_runs_as_written(ray_cpus):
    """Its ray.init() starts a local Ray (this host's CPUs), or joins a
    2-CPU one, as on CI's machines."""
    run = run_example(
        doc_block(NEMO_RL_DOC, NEMO_RL_SWITCH),
        "nemo_rl_switch.py",
        timeout=300,
        ray_cpus=ray_cpus,
    )
    assert run.returncode == 0, run.explain()
    assert run.stdout.endswith("NeMo-RL switch done\n"), run.explain()
