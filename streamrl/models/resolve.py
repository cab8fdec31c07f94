"""Where ``model.path`` points: a local Hugging Face folder, or a hub id found in the local cache.

Runs are offline (CPU and GPU machines have no hub access), so a hub id such as
``HuggingFaceTB/SmolLM2-135M-Instruct`` (optionally ``@revision``) is looked up only in the
local Hugging Face cache (``HF_HUB_CACHE`` / ``HF_HOME``) with huggingface_hub's
``try_to_load_from_cache``; nothing is downloaded. Anything that does not resolve raises a
one-line :class:`~streamrl.config.ConfigError` naming the field, at ``--dry-run`` already.

Examples:
    >>> resolve_model_path("models/smol").name
    'smol'
"""
from __future__ import annotations

import re
from pathlib import Path

from streamrl.errors import ConfigError

# owner/name[@revision], the hub's own spelling rules (letters, digits, '-', '_', '.').
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*)(?:@(?P<rev>[\w./-]+))?")


def looks_like_hub_id(spec: str) -> bool:
    """``owner/name`` (or ``owner/name@rev``) that is not a relative or absolute path."""
    return bool(_HUB_ID.fullmatch(spec)) and not spec.startswith((".", "/", "~"))


def _check_folder(folder: Path, spec: str, field: str) -> Path:
    if not folder.is_dir():
        raise ConfigError(f"config field '{field}' = {spec!r}: {str(folder)!r} is a file, not a model folder")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"config field '{field}' = {spec!r}: folder {str(folder)!r} has no config.json "
                          f"(not a Hugging Face model folder)")
    return folder.resolve()


def resolve_model_path(spec: str, field: str = "model.path") -> Path:
    """The local folder of ``spec``: an existing folder with ``config.json``, or the cached
    snapshot of a hub id. Raises :class:`ConfigError` naming ``field`` otherwise.

    Args:
        spec: a folder path, or a hub id ``owner/name[@revision]``.
        field: the config field the value came from (for the error message).
    """
    if not spec:
        raise ConfigError(f"config field '{field}' is empty: no model folder to resolve")
    local = Path(spec).expanduser()
    if local.exists():
        return _check_folder(local, spec, field)
    m = _HUB_ID.fullmatch(spec)
    if m is None or not looks_like_hub_id(spec):
        raise ConfigError(f"config field '{field}' = {spec!r}: no such folder")
    from huggingface_hub import constants, try_to_load_from_cache  # noqa: PLC0415 (only for hub ids)

    found = try_to_load_from_cache(m["repo"], "config.json", revision=m["rev"])
    if isinstance(found, str):
        return _check_folder(Path(found).parent, spec, field)
    raise ConfigError(f"config field '{field}' = {spec!r}: no such folder, and hub id {m['repo']!r}"
                      f"{' at ' + m['rev'] if m['rev'] else ''} is not in the local Hugging Face cache "
                      f"({constants.HF_HUB_CACHE}); runs are offline: download it first "
                      f"(`hf download {m['repo']}`) or pass a folder")
