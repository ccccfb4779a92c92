"""The stowage config file (TOML): units, placement, listen addresses,
auth, timeouts and client defaults. docs/config.md lists every key with
its default; examples/stowage.toml is a complete file.

    import stowage.config

    cfg = stowage.config.load("/etc/stowage.toml")
    cfg["units"]["memory"]        # bytes (int)
    cfg["timeouts"]["op"]         # seconds (float)
    cfg["placement"]["clusters"]  # "all" or a list of names

A file that cannot be read, is not TOML, has an unknown key (a typo) or a
value out of range raises :class:`stowage.InvalidRequest`; its message
names the file, the position and the dotted key, which are also its
``file`` and ``key`` attributes.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Union

from . import _native

__all__ = ["load", "resolve_listen_host"]


def load(
    path: Optional[Union[str, "os.PathLike[str]"]] = None, text: Optional[str] = None
) -> Dict[str, Dict[str, Any]]:
    """The config at ``path``, or in ``text``, or (neither) the defaults.

    Returns a dict of sections (``units``, ``placement``, ``listen``,
    ``auth``, ``timeouts``, ``client``, ``metrics``), each a dict with every key of the
    section: what the file sets, the default otherwise, ``None`` for keys
    without a default (``units.count``, ``units.disk``, the optional paths,
    ``client.wait_for_memory``). Sizes are ints (bytes), durations floats
    (seconds), paths strs.
    """
    return _native.load_config(None if path is None else os.fspath(path), text)


def resolve_listen_host(host: str) -> str:
    """The address to bind for a ``listen.host`` value: the address itself,
    or for ``"node-ip"`` this node's own address as other nodes reach it
    (127.0.0.1 when there is no route)."""
    return _native.resolve_listen_host(host)
