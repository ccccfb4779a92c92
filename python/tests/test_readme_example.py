"""Every README example runs as written: each python block of README.md is
an example file of python/examples (or a listed fragment), and each is run
from the README's text as ``python script.py``, with nothing patched and no
argument or environment the README does not give (readme_examples.py says
what a run's machine is). The Ray example also runs on the three-node
cluster of test_ray.py; the TransferQueue one runs in python/tests_tq
(scripts/test-tq), whose environment has TransferQueue."""

import importlib.util

import pytest
from readme_examples import EXAMPLES, FRAGMENTS, ROOT, blocks, readme_block, run_example

needs_ray = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None,
    reason="Ray is not installed (pip install 'stowage-rl[ray]')",
)


def readme_example() -> str:
    return readme_block("## From Python")


def test_every_python_block_of_the_readme_is_an_example_file_or_a_listed_fragment():
    files = {name: (ROOT / "python/examples" / name).read_text() for name in EXAMPLES.values()}
    assert sorted(p.name for p in (ROOT / "python/examples").glob("*.py")) == sorted(files)
    seen = []
    for heading, code in blocks("python"):
        if code.splitlines()[0] in FRAGMENTS:
            continue
        assert heading in EXAMPLES, (
            f"a python block under {heading!r} is neither an example file nor a listed "
            f"fragment:\n{code[:400]}"
        )
        assert code == files[EXAMPLES[heading]], (
            f"the block under {heading!r} differs from python/examples/{EXAMPLES[heading]}"
        )
        seen.append(heading)
    assert sorted(seen) == sorted(EXAMPLES), seen


def test_readme_example_is_the_example_file():
    assert readme_example() == (ROOT / "python/examples/grpo_step.py").read_text()


def test_readme_ray_example_is_the_example_file():
    assert (
        readme_block("## On a Ray cluster") == (ROOT / "python/examples/ray_units.py").read_text()
    )


def test_readme_example_runs_as_written():
    run = run_example(readme_example(), "grpo_step.py", timeout=300)
    assert run.returncode == 0, run.explain()
    assert "GRPO step done" in run.stdout, run.explain()


@needs_ray
@pytest.mark.parametrize("ray_cpus", [None, 2], ids=["fresh-machine", "2-cpu-ray"])
def test_readme_ray_example_runs_as_written(ray_cpus):
    """On a fresh machine, its ray.init() starts a local Ray with this
    host's CPUs (2 on CI); on a machine where a 2-CPU Ray runs, it joins
    that one, whatever this host has."""
    run = run_example(
        readme_block("## On a Ray cluster"), "ray_units.py", timeout=300, ray_cpus=ray_cpus
    )
    assert run.returncode == 0, run.explain()
    assert "Ray example done" in run.stdout, run.explain()
