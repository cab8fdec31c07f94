"""A version manifest's JSON, reusing the encoded tensor table while the layout is unchanged.

A run publishes the same specs every version, so the manifest's ``"tensors"`` table (names,
shapes, offsets; a LoRA version: a packed entry with a few hundred part names) is the same
list each time (the publisher reuses its layout plan); only the small fields change (version,
bucket checksums, path, time). Encoding the table is most of ``json.dumps(manifest)`` and
about a tenth of a LoRA version's publish, so it is encoded once per plan and spliced into the
JSON of the rest. The text decodes to exactly ``manifest``: subscribers parse and validate it
like any other (:meth:`~streamrl.weights.layout.Layout.check`).
"""
from __future__ import annotations

import json
from typing import Any


class ManifestJSON:
    """Encodes manifests; the ``"tensors"`` value is encoded once per list object.

    The cache is keyed by the identity of the list (held here, so its id cannot be reused):
    the publisher hands the same list for an unchanged plan and a new one when specs change.
    Callers must not mutate a table after it was encoded.

    Examples:
        >>> enc = ManifestJSON()
        >>> table = [{"name": "w", "shape": [2]}]
        >>> json.loads(enc.encode({"version": 1, "tensors": table})) == {"version": 1, "tensors": table}
        True
    """

    def __init__(self):
        self._table: list | None = None
        self._table_json = ""

    def encode(self, manifest: dict[str, Any]) -> str:
        """``manifest`` as JSON (``json.loads`` of it equals ``manifest``)."""
        table = manifest.get("tensors")
        if not isinstance(table, list):
            return json.dumps(manifest)
        if table is not self._table:
            self._table, self._table_json = table, json.dumps(table)
        rest = json.dumps({k: v for k, v in manifest.items() if k != "tensors"})
        # '{"tensors": <table>, <rest's fields>}'; rest is "{}" when the table is all there is
        return '{"tensors": ' + self._table_json + (", " + rest[1:] if rest != "{}" else "}")
