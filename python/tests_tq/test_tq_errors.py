"""Every exception stowage.tq raises of its own is a stowage.Error (issue
22), and stays the RuntimeError it was, so that callers who caught it that
way keep working."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "transfer_queue",
    reason="transferqueue is not installed: these tests need `pip install 'stowage-rl[tq]'` "
    "(scripts/test-tq runs them in a venv that has it)",
)

import stowage
import stowage.tq


@pytest.mark.parametrize("cls", ["RowsLost", "CheckpointRefused", "UntrustedCell"])
def test_tq_exceptions_are_stowage_errors(cls):
    c = getattr(stowage.tq, cls)
    assert issubclass(c, stowage.Error)
    assert issubclass(c, RuntimeError)


def test_rows_lost_carries_its_rows_and_catches_as_a_stowage_error():
    with pytest.raises(stowage.Error) as e:
        raise stowage.tq.RowsLost("train", [3, 4], 1, "get_data")
    assert e.value.partition == "train"
    assert e.value.global_indexes == [3, 4]
    assert e.value.unit == 1
    assert e.value.retryable is False
    assert "storage unit 1 is gone" in str(e.value)
