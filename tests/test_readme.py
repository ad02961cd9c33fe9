"""README.md's Python examples, run as written (in order, in one namespace, as a reader would paste them), so an
example cannot drift from the code."""

import re
from pathlib import Path

import pytest

import decoders

pytestmark = pytest.mark.real_model  # the examples load zoo:smollm2-135m

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_the_readme_has_python_examples():
    assert len(python_blocks(README.read_text())) >= 4


def test_every_python_example_in_the_readme_runs():
    namespace: dict = {}
    try:
        for number, block in enumerate(python_blocks(README.read_text()), 1):
            try:
                exec(compile(block, f"README.md python block {number}", "exec"), namespace)
            except Exception as error:  # name the block, so a failure points at the example
                raise AssertionError(f"README.md's python block {number} failed: {error!r}\n{block}") from error
    finally:
        decoders.unregister("echo")  # the "Write your own" example registers it
