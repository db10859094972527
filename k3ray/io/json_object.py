"""A JSON object read from a file, every way it can be wrong named in one line (the checkpoint's manifest, a
Hugging Face folder's config and index)."""
from __future__ import annotations

import json
from pathlib import Path


def read_json_object(path: Path, error: type[Exception], missing: str = "missing") -> dict:
    """The JSON object in `path`; `error` with "PATH: why" where the file is absent (`missing` says what that
    means), unreadable, not JSON, or not an object."""
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise error(f"{path}: {missing}") from None
    except (OSError, ValueError) as e:
        raise error(f"{path}: unreadable or not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise error(f"{path}: expected a JSON object, got {type(doc).__name__}")
    return doc
