"""The README's Python examples run as written (the Ray one runs in
test_ray.py, on that module's local Ray cluster)."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def readme_block(heading: str) -> str:
    """The first python block of the README section under `heading`."""
    text = (ROOT / "README.md").read_text()
    assert heading in text, f"no {heading!r} section in README.md"
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, f"no python block under {heading!r}"
    return blocks[0]


def readme_example() -> str:
    return readme_block("## From Python")


def test_readme_example_is_the_example_file():
    assert readme_example() == (ROOT / "python/examples/grpo_step.py").read_text()


def test_readme_ray_example_is_the_example_file():
    assert (
        readme_block("## On a Ray cluster") == (ROOT / "python/examples/ray_units.py").read_text()
    )


def test_readme_example_runs_as_written(tmp_path):
    script = tmp_path / "grpo_step.py"
    script.write_text(readme_example())
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "GRPO step done" in done.stdout
