"""A version manifest's JSON, with its tensor table stored once, by content, not in every version.

A run publishes the same specs every version, so the manifest's ``"tensors"`` table (names,
shapes, offsets; a LoRA version: a packed entry with a few hundred part names, 14.5 KB of JSON)
is the same list each time (the publisher reuses its layout plan); only the small fields change
(version, bucket checksums, path, time). Encoding and sending the table was most of a LoRA
version's manifest cost, so it is encoded once per plan and stored under a content-addressed key
(the SHA-256 of its JSON, ``Keys.weights_table``); each version's manifest names it instead,
``"tensors_ref": <digest>``.

Who keeps the table in Redis: the coordinator's ``publish_version`` script refuses (atomically,
nothing written) a manifest whose table key is missing, so the coordinator stores the table and
runs the script again: on the first version of a layout and after Redis lost its state. The
learner's re-assertion after a Redis restart writes the table with the last manifest.

Readers (``Coordinator.manifest``) fetch a table once per digest, check that its text hashes to
the digest, and cache it: the manifest they return has the table back under ``"tensors"``, so
subscribers validate it like any other (:meth:`~streamrl.weights.layout.Layout.check`).
Manifests with the table inline (``"tensors"``) are read as they are.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

TABLE_REF = "tensors_ref"  # manifest field: the digest of its tensor table


@dataclass(frozen=True)
class Table:
    """A tensor table's JSON ``text`` and ``digest`` (SHA-256 of the UTF-8 text, hex)."""

    digest: str
    text: str

    @classmethod
    def of(cls, text: str) -> "Table":
        return cls(hashlib.sha256(text.encode()).hexdigest(), text)


def decode_table(digest: Any, text: str) -> list:
    """The tensor table stored under ``digest``; raises ValueError when the text does not hash to
    the digest (a corrupted or foreign key) or is not a JSON list."""
    if not isinstance(digest, str) or Table.of(text).digest != digest:
        raise ValueError(f"weights manifest field {TABLE_REF!r} = {str(digest)[:80]!r}: the stored tensor table "
                         f"does not hash to it")
    table = json.loads(text)
    if not isinstance(table, list):
        raise ValueError(f"weights tensor table {digest[:16]}...: expected a JSON list, got {type(table).__name__}")
    return table


class ManifestJSON:
    """Encodes manifests with the ``"tensors"`` table replaced by its digest; the table is encoded
    and hashed once per list object.

    The cache is keyed by the identity of the list (held here, so its id cannot be reused):
    the publisher hands the same list for an unchanged plan and a new one when specs change.
    Callers must not mutate a table after it was encoded.

    Examples:
        >>> enc = ManifestJSON()
        >>> table = [{"name": "w", "shape": [2]}]
        >>> text, ref = enc.encode({"version": 1, "tensors": table})
        >>> json.loads(text) == {"version": 1, TABLE_REF: ref.digest} and decode_table(ref.digest, ref.text) == table
        True
    """

    def __init__(self):
        self._table: list | None = None
        self._ref: Table | None = None

    def encode(self, manifest: dict[str, Any]) -> tuple[str, Table | None]:
        """(``manifest`` as JSON with ``"tensors"`` replaced by ``"tensors_ref"``, the table), or
        (``manifest`` as JSON, None) when it has no table."""
        table = manifest.get("tensors")
        if not isinstance(table, list):
            return json.dumps(manifest), None
        if table is not self._table:
            self._table, self._ref = table, Table.of(json.dumps(table))
        rest = {k: v for k, v in manifest.items() if k != "tensors"}
        rest[TABLE_REF] = self._ref.digest
        return json.dumps(rest), self._ref
