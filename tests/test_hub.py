"""Repo ids resolve in the local Hugging Face cache exactly as huggingface_hub resolves them
offline: the cache is laid out here with huggingface_hub's own writers (blobs, refs, snapshots
of relative symlinks), and every lookup is checked against snapshot_download(local_files_only)
and try_to_load_from_cache."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from glmvit_cupy import GlmVit, GlmVitError
from glmvit_cupy.hub import resolve_model
from glmvit_cupy.processor.preprocess import PREPROCESSOR_FILE
from glmvit_cupy.tower.checkpoint import bind_checkpoint
from glmvit_cupy.tower.synthetic import write_checkpoint

hub = pytest.importorskip("huggingface_hub")
from huggingface_hub.errors import LocalEntryNotFoundError  # noqa: E402
from huggingface_hub.file_download import (  # noqa: E402
    _cache_commit_hash_for_specific_revision, _create_symlink, _get_pointer_path, repo_folder_name)

REPO = "zai-org/GLM-5.3-Flash"
COMMITS = ["a" * 40, "0123456789abcdef0123456789abcdef01234567", "f" * 40]
SHARDS = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


def cache_repo(cache: Path, repo: str, source: Path, commit: str, refs: tuple[str, ...] = ("main",),
               files: list[str] | None = None) -> Path:
    """Put `files` of `source` into the cache as huggingface_hub does after a download: the bytes
    in blobs/, a relative symlink in snapshots/<commit>/, the ref's commit in refs/."""
    storage = cache / repo_folder_name(repo_id=repo, repo_type="model")
    for name in files if files is not None else sorted(p.name for p in source.iterdir()):
        data = (source / name).read_bytes()
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        pointer = Path(_get_pointer_path(str(storage), commit, name))
        pointer.parent.mkdir(parents=True, exist_ok=True)
        _create_symlink(str(blob), str(pointer), new_blob=False)
        assert not os.path.isabs(os.readlink(pointer))
    for ref in refs:
        _cache_commit_hash_for_specific_revision(str(storage), ref, commit)
    if not (source / PREPROCESSOR_FILE).exists():  # what hf_hub_download records on the Hub's 404
        (storage / ".no_exist" / commit).mkdir(parents=True, exist_ok=True)
        (storage / ".no_exist" / commit / PREPROCESSOR_FILE).touch()
    return storage


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    root = tmp_path / "hf" / "hub"
    root.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    return root


@pytest.fixture(scope="module")
def full_ckpt(tmp_path_factory):
    """The released form: three shards, the tower in the first two, text-stack decoys only in
    the third."""
    return write_checkpoint(tmp_path_factory.mktemp("src") / "full", "tiny", seed=21)


def same_tower(a, b) -> bool:
    return a.location.entries.keys() == b.location.entries.keys() and all(
        np.array_equal(a.raw(n), b.raw(n)) for n in a.location.entries)


def theirs(repo: str, revision: str | None, cache: Path) -> Path:
    return Path(hub.snapshot_download(repo, revision=revision, local_files_only=True, cache_dir=cache))


def test_refs_commits_and_revisions_resolve_as_huggingface_hub(cache, full_ckpt, tmp_path):
    other = write_checkpoint(tmp_path / "other", "tiny", seed=22, export="vision-only")
    cache_repo(cache, REPO, full_ckpt, COMMITS[0], refs=("main",))
    cache_repo(cache, REPO, other, COMMITS[1], refs=("v1.0",))
    cache_repo(cache, REPO, full_ckpt, COMMITS[2], refs=())  # reachable by its hash only
    for ref, commit in [(REPO, 0), (f"{REPO}@main", 0), (f"{REPO}@v1.0", 1), (f"{REPO}@{COMMITS[2]}", 2)]:
        revision = ref.partition("@")[2] or None
        ours = resolve_model(ref)
        assert ours == theirs(REPO, revision, cache) and ours.name == COMMITS[commit]
        for name in os.listdir(ours):
            assert str(ours / name) == hub.try_to_load_from_cache(REPO, name, cache_dir=cache, revision=revision)
    assert same_tower(bind_checkpoint(resolve_model(f"{REPO}@v1.0")), bind_checkpoint(other))
    assert same_tower(bind_checkpoint(resolve_model(REPO)), bind_checkpoint(full_ckpt))
    assert GlmVit.from_pretrained(f"{REPO}@v1.0", backend="numpy").geometry == bind_checkpoint(other).location.geometry


def test_what_is_not_cached_fails_for_both(cache, full_ckpt):
    storage = cache_repo(cache, REPO, full_ckpt, COMMITS[0])
    cases = [
        ("other-org/absent", None, "no such directory, nor a repo in the local Hugging Face cache"),
        (REPO, "nope", "revision 'nope' is not in the local Hugging Face cache: no " + str(storage / "refs" / "nope")),
        (REPO, COMMITS[1], f"commit {COMMITS[1]}) has no snapshot in the local Hugging Face cache"),
    ]
    (storage / "refs" / "main").unlink()  # a snapshot is there, but no ref names it: no fallback
    cases.append((REPO, None, "revision 'main' is not in the local Hugging Face cache"))
    for repo, revision, message in cases:
        with pytest.raises(LocalEntryNotFoundError):
            theirs(repo, revision, cache)
        with pytest.raises(GlmVitError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
            resolve_model(repo + (f"@{revision}" if revision else ""))
        assert "\n" not in str(info.value) and "hf download" in str(info.value)


def test_a_partial_snapshot_names_only_the_towers_missing_shards(cache, full_ckpt):
    cache_repo(cache, REPO, full_ckpt, COMMITS[0], files=["config.json", "model.safetensors.index.json"])
    with pytest.raises(GlmVitError, match=rf"lacks 2 file\(s\) the model needs; fetch them: hf download {REPO} "
                                          rf"{SHARDS[0]} {SHARDS[1]}$"):
        resolve_model(REPO)
    cache_repo(cache, REPO, full_ckpt, COMMITS[0], files=[SHARDS[0]])
    with pytest.raises(GlmVitError, match=rf"hf download {REPO} --revision main {SHARDS[1]}$"):
        resolve_model(f"{REPO}@main")
    cache_repo(cache, REPO, full_ckpt, COMMITS[0], files=[SHARDS[1]])  # the text-only shard stays absent
    assert bind_checkpoint(resolve_model(REPO)).location.shards == [resolve_model(REPO) / s for s in SHARDS[:2]]


def test_the_processor_config_is_known_absent_or_fetched(cache, full_ckpt, tmp_path):
    """No preprocessor_config.json in the snapshot is fine only where the cache records the repo
    has none (try_to_load_from_cache's _CACHED_NO_EXIST); where it says nothing (None), fetch it."""
    storage = cache_repo(cache, REPO, full_ckpt, COMMITS[0])
    assert hub.try_to_load_from_cache(REPO, PREPROCESSOR_FILE, cache_dir=cache) is hub._CACHED_NO_EXIST
    resolve_model(REPO)
    (storage / ".no_exist" / COMMITS[0] / PREPROCESSOR_FILE).unlink()
    assert hub.try_to_load_from_cache(REPO, PREPROCESSOR_FILE, cache_dir=cache) is None
    with pytest.raises(GlmVitError, match=rf"lacks 1 file\(s\) the model needs; fetch them: hf download {REPO} "
                                          rf"{PREPROCESSOR_FILE}$"):
        resolve_model(REPO)
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / PREPROCESSOR_FILE).write_text('{"max_image_tokens": 99}')
    cache_repo(cache, REPO, tmp_path / "p", COMMITS[0])
    assert GlmVit.from_pretrained(REPO, backend="numpy").processor.max_image_tokens == 99


@pytest.mark.parametrize("text", ["../ckpt", "org/na--me", "org/name.git", "org/-name", "a/b/c", "org/café", "org/x@"])
def test_a_directory_wins_and_a_non_id_is_refused(tmp_path, monkeypatch, full_ckpt, text):
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    monkeypatch.chdir(full_ckpt.parent)
    assert resolve_model(full_ckpt.name) == Path(full_ckpt.name)
    repo = text.partition("@")[0]
    if repo != "org/x":
        with pytest.raises(HFValidationError):
            validate_repo_id(repo)
    with pytest.raises(GlmVitError, match="not a directory, nor a Hugging Face repo id"):
        resolve_model(text)


ENVIRONMENTS = [
    {},
    {"XDG_CACHE_HOME": "{tmp}/xdg"},
    {"XDG_CACHE_HOME": "{tmp}/xdg", "HF_HOME": "{tmp}/home"},
    {"HF_HOME": "~/hfhome", "HUGGINGFACE_HUB_CACHE": "{tmp}/legacy"},
    {"HF_HOME": "{tmp}/home", "HUGGINGFACE_HUB_CACHE": "{tmp}/legacy", "HF_HUB_CACHE": "$MYROOT/new"},
    {"HF_HOME": "$MYROOT/x"},
]


@pytest.mark.parametrize("env", ENVIRONMENTS, ids=lambda e: "+".join(e) or "none")
def test_cache_root_precedence_equals_huggingface_hubs(tmp_path, env):
    environ = {k: v for k, v in os.environ.items()
               if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")}
    environ.update({k: v.format(tmp=tmp_path) for k, v in env.items()}, HOME=str(tmp_path / "user"),
                   MYROOT=str(tmp_path / "var"), PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    code = ("from pathlib import Path; from huggingface_hub import constants; from glmvit_cupy.hub import cache_root;"
            "print(Path(constants.HF_HUB_CACHE).expanduser().resolve()); print(cache_root()[0])")
    out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True)
    hf, ours = out.stdout.split()
    assert hf == ours and ours.startswith(str(tmp_path)), out.stdout


def test_cli_takes_a_repo_id(cache, full_ckpt):
    from test_cli import assert_clean_failure, run

    cache_repo(cache, REPO, full_ckpt, COMMITS[0], files=["config.json", "model.safetensors.index.json", SHARDS[0]])
    assert_clean_failure(run("info", "--model", REPO), f"hf download {REPO} {SHARDS[1]}")
    cache_repo(cache, REPO, full_ckpt, COMMITS[0], files=[SHARDS[1]])
    proc = run("info", "--model", REPO)
    assert proc.returncode == 0, proc.stderr
    assert f"snapshots/{COMMITS[0]} ({REPO}, cached)" in proc.stdout and "39 BF16" in proc.stdout
