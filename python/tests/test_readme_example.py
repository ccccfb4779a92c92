"""The README's Python example runs as written."""
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## From Python", 1)[1]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "no python block under 'From Python'"
    return blocks[0]


def test_readme_example_is_the_example_file():
    assert readme_example() == (ROOT / "python/examples/grpo_step.py").read_text()


def test_readme_example_runs_as_written(tmp_path):
    script = tmp_path / "grpo_step.py"
    script.write_text(readme_example())
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "GRPO step done" in done.stdout
