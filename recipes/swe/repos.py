"""Task repositories on disk: `<repos dir>/<owner>__<name>` git repositories (SWE-bench's naming).

Locally the builder makes them from an sdist; on a bigger machine the real SWE-bench repositories
are cloned there under the same names. Commits are written with a fixed author, committer and date,
so the same trees give the same shas on every machine.
"""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
import tempfile
from pathlib import Path

from agentstream.recipes.swe.settings import SweSettings, from_environment
from agentstream.schemas.errors import ServiceError

FIXED = {"GIT_AUTHOR_NAME": "agentstream", "GIT_AUTHOR_EMAIL": "tasks@agentstream.invalid",
         "GIT_COMMITTER_NAME": "agentstream", "GIT_COMMITTER_EMAIL": "tasks@agentstream.invalid",
         "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000", "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000"}


class RepoError(ServiceError):
    """A repository, commit or patch that is not there or does not fit."""


def default_repos_dir() -> Path:
    """AGENTSTREAM_SWE_REPOS, else $AGENTSTREAM_HOME/swe/repos: the folder the harness checks tasks out of."""
    return from_environment(SweSettings).repos


def default_envs_dir() -> Path:
    """AGENTSTREAM_SWE_ENVS, else $AGENTSTREAM_HOME/swe/envs."""
    return from_environment(SweSettings).envs


def slug(repo: str) -> str:
    return repo.replace("/", "__")


def repo_path(repos_dir: Path, repo: str) -> Path:
    return repos_dir / slug(repo)


def git(repo: Path, *args: str, input: bytes | None = None, env: dict[str, str] | None = None,
        check: bool = True) -> subprocess.CompletedProcess[bytes]:
    full_env = {**os.environ, **FIXED, "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(repo), **(env or {})}
    done = subprocess.run(["git", "-C", str(repo), *args], input=input, capture_output=True, env=full_env)
    if check and done.returncode:
        raise RepoError(f"git {' '.join(args[:3])} in {repo}: {done.stderr.decode(errors='replace').strip()}")
    return done


def has_commit(repo: Path, commit: str) -> bool:
    return git(repo, "cat-file", "-e", f"{commit}^{{commit}}", check=False).returncode == 0


def checkout(repo: Path, commit: str, dest: Path) -> None:
    """The tree of `commit` written into `dest` (no .git: the agent's workspace holds no history)."""
    archive = git(repo, "archive", "--format=tar", commit).stdout
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")


def read(repo: Path, commit: str, path: str) -> str:
    return git(repo, "show", f"{commit}:{path}").stdout.decode()


def check_patches(repo: Path, commit: str, *patches: str) -> str | None:
    """Why the patches do not apply, in order, onto `commit`, or None (checked on a scratch index)."""
    with tempfile.TemporaryDirectory() as scratch:
        env = {"GIT_INDEX_FILE": str(Path(scratch) / "index")}
        git(repo, "read-tree", commit, env=env)
        for index, patch in enumerate(patches):
            if not patch.strip():
                continue
            done = git(repo, "apply", "--cached", "-", input=patch.encode(), env=env, check=False)
            if done.returncode:
                return f"patch {index + 1} does not apply: {done.stderr.decode(errors='replace').strip()[:300]}"
    return None


def commit_files(repo: Path, parent: str, files: dict[str, str | None], message: str, ref: str | None = None) -> str:
    """A commit on `parent` with `files` replaced (None: removed), made on a scratch index, no checkout."""
    with tempfile.TemporaryDirectory() as scratch:
        env = {"GIT_INDEX_FILE": str(Path(scratch) / "index")}
        git(repo, "read-tree", parent, env=env)
        for path, text in sorted(files.items()):
            if text is None:
                git(repo, "update-index", "--force-remove", "--", path, env=env)
                continue
            blob = git(repo, "hash-object", "-w", "--stdin", input=text.encode()).stdout.decode().strip()
            git(repo, "update-index", "--add", "--cacheinfo", f"100644,{blob},{path}", env=env)
        tree = git(repo, "write-tree", env=env).stdout.decode().strip()
    sha = git(repo, "commit-tree", tree, "-p", parent, "-m", message).stdout.decode().strip()
    if ref:
        git(repo, "update-ref", ref, sha)
    return sha


def diff(repo: Path, old: str, new: str, *paths: str) -> str:
    return git(repo, "diff", "--no-color", "--no-ext-diff", "--full-index", old, new, "--", *paths).stdout.decode()
