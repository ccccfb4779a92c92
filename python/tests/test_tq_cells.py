"""The TransferQueue backend's pickled cells (stowage._tq_cells), without
TransferQueue: a cell is unpickled only after its HMAC tag, under a key
derived from the plane's secret, was checked for its place. The end-to-end
attacks (another process writing a unit's rows) are in
python/tests_tq/test_tq_security.py."""

from __future__ import annotations

import hashlib
import hmac
import pickle

import numpy as np
import pytest

import stowage
from stowage import _tq_cells as cells

SECRET = b"py-tq-cells-secret-0123456789abcdef"
KEY = cells.cell_key_of(SECRET)
PLACE = ("transfer_queue", "train", 7, "prompt")


class _WritesAFile:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_the_native_client_derives_the_cell_key_and_never_hands_out_the_secret(monkeypatch):
    monkeypatch.delenv("STOWAGE_SECRET", raising=False)
    with stowage.local(units=1, memory="16MiB", secret=SECRET) as dp:
        key = dp._client.cell_key()
    assert key == hmac.new(SECRET, b"stowage tq cell key v1", hashlib.sha256).digest() == KEY
    assert len(key) == 32 and SECRET not in key
    # (A client without a secret has no key: test_tq_security.py's
    # insecure plane.)


def test_a_sealed_cell_opens_at_its_own_place():
    value = {"text": "hello", "n": [1, 2, 3]}
    cell = cells.seal(KEY, *PLACE, value)
    assert cell.dtype == np.uint8 and cell.tobytes().startswith(cells.MAGIC)
    assert cells.open_cell(KEY, *PLACE, cell) == value


@pytest.mark.parametrize(
    "place",
    [
        ("other_ns", "train", 7, "prompt"),
        ("transfer_queue", "eval", 7, "prompt"),
        ("transfer_queue", "train", 8, "prompt"),
        ("transfer_queue", "train", "7", "prompt"),
        ("transfer_queue", "train", 7, "response"),
    ],
)
def test_a_cell_moved_to_another_place_is_refused(place):
    cell = cells.seal(KEY, *PLACE, "secret answer")
    with pytest.raises(cells.UntrustedCell, match="its tag is wrong"):
        cells.open_cell(KEY, *place, cell)


def test_changed_or_forged_cells_are_refused_and_never_unpickled(tmp_path):
    target = tmp_path / "written-by-the-pickle"
    evil = pickle.dumps(_WritesAFile(str(target)), protocol=5)
    good = cells.seal(KEY, *PLACE, "fine").tobytes()
    forged = [
        cells.MAGIC_INSECURE + evil,  # the format of stowage before tags
        cells.MAGIC + bytes(32) + evil,  # a made-up tag
        good[: len(cells.MAGIC) + cells.TAG_LEN] + evil,  # a good tag, another pickle
        cells.seal(
            cells.cell_key_of(b"another-secret-0123456789"), *PLACE, _WritesAFile(str(target))
        ),
        evil,  # no head
        cells.MAGIC + evil[:10],  # shorter than a tag
    ]
    for raw in forged:
        arr = raw if isinstance(raw, np.ndarray) else np.frombuffer(raw, np.uint8)
        with pytest.raises(cells.UntrustedCell, match="refusing to unpickle"):
            cells.open_cell(KEY, *PLACE, arr)
    assert not target.exists()
    # One flipped bit anywhere: refused.
    for i in range(0, len(good), 7):
        bad = bytearray(good)
        bad[i] ^= 1
        with pytest.raises(cells.UntrustedCell):
            cells.open_cell(KEY, *PLACE, np.frombuffer(bytes(bad), np.uint8))


def test_the_tag_is_checked_on_the_bytes_that_are_unpickled():
    # The cell is copied once; a view that changes afterwards does not matter.
    buf = np.frombuffer(bytearray(cells.seal(KEY, *PLACE, "first").tobytes()), np.uint8)
    value = cells.open_cell(KEY, *PLACE, buf)
    assert value == "first"


def test_without_a_key_cells_need_the_insecure_option(tmp_path):
    with pytest.raises(cells.UntrustedCell, match=r"backend\.Stowage\.insecure_pickles"):
        cells.seal(None, *PLACE, "x")
    with pytest.raises(cells.UntrustedCell, match=r"backend\.Stowage\.insecure_pickles"):
        cells.open_cell(
            None, *PLACE, np.frombuffer(cells.MAGIC_INSECURE + pickle.dumps("x"), np.uint8)
        )
    cell = cells.seal(None, *PLACE, "x", insecure=True)
    assert cell.tobytes().startswith(cells.MAGIC_INSECURE)
    assert cells.open_cell(None, *PLACE, cell, insecure=True) == "x"
    # A tagged cell on a client without the secret: refused, not unpickled.
    with pytest.raises(cells.UntrustedCell, match="give it the secret"):
        cells.open_cell(None, *PLACE, cells.seal(KEY, *PLACE, "x"), insecure=True)
    # And an untagged cell on a client with a key, whatever the option says.
    with pytest.raises(cells.UntrustedCell, match="carries no tag"):
        cells.open_cell(KEY, *PLACE, cell, insecure=True)


def test_retag_moves_a_cell_to_another_key_only_if_it_verifies():
    old = cells.cell_key_of(b"the-old-secret-0123456789")
    cell = cells.seal(old, "old_ns", "train", 7, "prompt", [1, 2]).tobytes()
    assert cells.retag(cell, KEY, "old_ns", KEY, *PLACE) is None
    new = cells.retag(cell, old, "old_ns", KEY, *PLACE)
    assert new is not None
    assert cells.open_cell(KEY, *PLACE, np.frombuffer(new, np.uint8)) == [1, 2]
    with pytest.raises(cells.UntrustedCell):
        cells.open_cell(KEY, *PLACE, np.frombuffer(cell, np.uint8))


def test_is_cell_recognizes_the_heads_only_of_uint8_vectors():
    assert cells.is_cell(cells.seal(KEY, *PLACE, 1))
    assert cells.is_cell(cells.seal(None, *PLACE, 1, insecure=True))
    assert not cells.is_cell(np.zeros(64, np.uint8))
    assert not cells.is_cell(np.frombuffer(cells.MAGIC + bytes(40), np.uint8).astype(np.int8))
    assert not cells.is_cell(np.frombuffer(cells.MAGIC + bytes(40), np.uint8).reshape(8, 6))
