"""A model reference -> a local checkpoint directory: a directory as given, or a Hugging Face repo
id (`org/name`, `org/name@revision`) found in the local Hugging Face cache, never the network.

Separate from `checkpoint` because it is about where a checkpoint lives, not what is in it, and
because its rules are huggingface_hub's, mirrored here without importing it (it is not a
dependency; the tests check these rules against it):
- the cache root is HF_HUB_CACHE, else HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub, HF_HOME
  defaulting to $XDG_CACHE_HOME/huggingface, then ~/.cache/huggingface (`constants.py`);
- a repo lives in `models--org--name` (`repo_folder_name`); a 40-hex revision names
  `snapshots/<commit>` directly; any other revision (default "main") is the file
  `refs/<revision>`, whose text is the commit hash, read as is (`snapshot_download` with
  `local_files_only=True`); there is no fallback to another snapshot.
Like transformers, a reference that is an existing directory is that directory.

Unlike `snapshot_download`, a snapshot holding only some of the repo's files is used as it is:
the tower needs config.json, the shard index and the shards holding the tower (about 1 GiB of
a full checkpoint of hundreds), and the processor its preprocessor_config.json unless the cache
records that the repo has none (`.no_exist`, as `try_to_load_from_cache` reads it). When some
are missing the error says which, as an `hf download` command to paste.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import GlmVitError
from .processor.preprocess import PREPROCESSOR_FILE
from .tower.checkpoint import INDEX_FILE, SINGLE_FILE, probe_prefix, tensor_names, tower_tensor_names
from .tower.geometry import CONFIG_FILE

# huggingface_hub's validate_repo_id, with the namespace required (a bare name is a directory).
REPO_ID = re.compile(r"\b[\w\-.]{1,96}\b/\b[\w\-.]{1,96}\b", re.ASCII)
COMMIT_HASH = re.compile(r"[0-9a-f]{40}")  # huggingface_hub's REGEX_COMMIT_HASH
DEFAULT_REVISION = "main"
# What to fetch before the shards are known (the index then names the tower's).
FIRST_FETCH = [CONFIG_FILE, PREPROCESSOR_FILE, INDEX_FILE]


def is_repo_id(text: str) -> bool:
    return (REPO_ID.fullmatch(text) is not None and "--" not in text and ".." not in text
            and not text.endswith(".git"))


def cache_root() -> tuple[Path, str]:
    """(the hub cache directory, the setting it came from), with constants.py's precedence and
    its ~ and $VAR expansion; resolved as snapshot_download resolves it."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        if var in os.environ:
            break
    else:
        var = "~/.cache/huggingface/hub"
    home = os.path.expandvars(os.path.expanduser(os.getenv(
        "HF_HOME", os.path.join(os.getenv("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache")),
                                "huggingface"))))
    legacy = os.getenv("HUGGINGFACE_HUB_CACHE", os.path.join(home, "hub"))
    root = os.path.expandvars(os.path.expanduser(os.getenv("HF_HUB_CACHE", legacy)))
    return Path(root).expanduser().resolve(), var


def _hf_download(repo: str, revision: str | None, files: list[str]) -> str:
    return " ".join(["hf download", repo, *([f"--revision {revision}"] if revision else []), *files])


def snapshot_dir(repo: str, revision: str | None = None) -> Path:
    """The cached snapshot directory of `repo` at `revision` (default main); a one-line error
    naming the path looked at when it is not there."""
    root, setting = cache_root()
    storage = root / ("models--" + repo.replace("/", "--"))
    rev = revision or DEFAULT_REVISION
    fetch = _hf_download(repo, revision, FIRST_FETCH)
    if not storage.is_dir():
        raise GlmVitError(f"{repo}: no such directory, nor a repo in the local Hugging Face cache: no "
                          f"{storage} (cache from {setting}); fetch its config and shard index: {fetch}")
    if COMMIT_HASH.fullmatch(rev):
        commit = rev
    else:
        ref = storage / "refs" / rev
        try:
            commit = ref.read_text()
        except FileNotFoundError:
            raise GlmVitError(f"{repo}: revision {rev!r} is not in the local Hugging Face cache: no {ref}; "
                              f"fetch it: {fetch}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise GlmVitError(f"{ref}: cannot read the cached ref: {exc}") from None
    snapshot = storage / "snapshots" / commit
    if not snapshot.is_dir():
        raise GlmVitError(f"{repo}: revision {rev!r} (commit {commit}) has no snapshot in the local "
                          f"Hugging Face cache: no {snapshot}; fetch it: {fetch}")
    return snapshot


def missing_tower_files(directory: Path) -> list[str]:
    """The files of `directory` the tower needs that are absent: config.json and, from the shard
    index (no shard opened), only the shards holding tower tensors."""
    missing = [] if (directory / CONFIG_FILE).is_file() else [CONFIG_FILE]
    if (directory / INDEX_FILE).is_file():
        names = tensor_names(directory)
        shards = {names[n] for n in tower_tensor_names(names, probe_prefix(names, directory))}
        missing += sorted(s.name for s in shards if not s.is_file())
    return missing


def resolve_model(model: str | os.PathLike) -> Path:
    """A directory, or the cached snapshot of a repo id whose tower files are all present."""
    path = Path(model)
    if path.is_dir():
        return path
    repo, at, revision = str(model).partition("@")
    if not is_repo_id(repo) or (at and not revision):
        raise GlmVitError(f"{model}: not a directory, nor a Hugging Face repo id (org/name or "
                          "org/name@revision)")
    snapshot = snapshot_dir(repo, revision or None)
    if not (snapshot / INDEX_FILE).is_file() and not (snapshot / SINGLE_FILE).is_file():
        raise GlmVitError(f"{repo}: the cached snapshot {snapshot} has neither {INDEX_FILE} nor "
                          f"{SINGLE_FILE}; fetch the one the repo has: {_hf_download(repo, revision, FIRST_FETCH)}"
                          f" (or {SINGLE_FILE})")
    missing = missing_tower_files(snapshot)
    # The processor's settings: absent for sure only where huggingface_hub recorded the Hub
    # saying so (.no_exist, try_to_load_from_cache's _CACHED_NO_EXIST); else never fetched.
    no_exist = snapshot.parent.parent / ".no_exist" / snapshot.name / PREPROCESSOR_FILE
    if not (snapshot / PREPROCESSOR_FILE).is_file() and not no_exist.is_file():
        missing.append(PREPROCESSOR_FILE)
    if missing:
        raise GlmVitError(f"{repo}: the cached snapshot {snapshot} lacks {len(missing)} file(s) the "
                          f"model needs; fetch them: {_hf_download(repo, revision, missing)}")
    return snapshot
