"""The glmvit-cupy command: what a newcomer runs, and every user mistake as one clean line."""

from __future__ import annotations

import subprocess
import sys
import numpy as np
import pytest
from PIL import Image

from glmvit_cupy import GlmVit
from helpers import assert_same_rows, photo_like


def run(*args: str) -> subprocess.CompletedProcess:
    """The installed console script's code path, in a fresh process (real exit status)."""
    return subprocess.run([sys.executable, "-c", "import cli; cli.main()", *args],
                          capture_output=True, text=True)


def assert_clean_failure(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("glmvit-cupy: error: "), proc.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])


@pytest.fixture(scope="module")
def pngs(tmp_path_factory):
    root = tmp_path_factory.mktemp("img")
    paths = []
    for i, (h, w) in enumerate([(120, 90), (56, 56)]):
        paths.append(root / f"img{i}.png")
        Image.fromarray(photo_like(h, w, seed=i)).save(paths[-1])
    return paths


def test_newcomer_flow_make_checkpoint_then_encode(tmp_path, pngs):
    made = run("make-checkpoint", str(tmp_path / "ckpt"), "--geometry", "tiny", "--seed", "3")
    assert made.returncode == 0, made.stderr
    out = tmp_path / "emb.npy"
    proc = run("encode", str(pngs[0]), "--model", str(tmp_path / "ckpt"), "--out", str(out), "--backend", "numpy")
    assert proc.returncode == 0, proc.stderr
    emb = np.load(out)
    expected = GlmVit.from_pretrained(tmp_path / "ckpt", backend="numpy").encode(pngs[0], dtype="float32")[0].pooler_output
    assert emb.dtype == np.float32 and np.array_equal(emb, expected)


def test_make_checkpoint_again_needs_force_and_never_touches_other_directories(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert run("make-checkpoint", str(ckpt), "--geometry", "tiny").returncode == 0
    before = sorted(p.name for p in ckpt.iterdir())
    assert_clean_failure(run("make-checkpoint", str(ckpt), "--geometry", "tiny"), "already holds a checkpoint", "--force")
    again = run("make-checkpoint", str(ckpt), "--geometry", "tiny", "--seed", "5", "--force")
    assert again.returncode == 0 and "seed 5" in again.stdout, again.stderr
    assert sorted(p.name for p in ckpt.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # the replaced one is gone, no temporary left
    other = tmp_path / "photos"
    other.mkdir()
    (other / "a.jpg").write_bytes(b"x")
    assert_clean_failure(run("make-checkpoint", str(other), "--geometry", "tiny", "--force"), "nor a checkpoint")
    assert [p.name for p in other.iterdir()] == ["a.jpg"]


def test_auto_without_a_gpu_says_so(tmp_path, tiny_ckpt, pngs):
    from glmvit_cupy.model import gpu_available

    if gpu_available()[0]:
        pytest.skip("this machine has a GPU")
    proc = run("encode", str(pngs[0]), "--model", str(tiny_ckpt), "--out", str(tmp_path / "a.npy"))
    assert proc.returncode == 0, proc.stderr
    assert "running the NumPy backend" in proc.stderr
    assert_clean_failure(run("bench", "--model", str(tiny_ckpt)), "bench needs a CUDA GPU")


def test_npz_with_several_images_and_both_outputs(tmp_path, tiny_ckpt, pngs):
    out = tmp_path / "emb.npz"
    proc = run("encode", *map(str, pngs), "--model", str(tiny_ckpt), "--out", str(out),
               "--backend", "numpy", "--output", "both")
    assert proc.returncode == 0, proc.stderr
    data = np.load(out)
    assert set(data.files) == {"pooler_output", "last_hidden_state", "grid_thw", "offsets"}
    results = GlmVit.from_pretrained(tiny_ckpt, backend="numpy").encode(pngs, output="both", dtype="float32")
    assert data["grid_thw"].tolist() == [r.grid_thw[0].tolist() for r in results]
    lengths = [len(r.pooler_output) for r in results]
    assert data["offsets"].tolist() == [0, lengths[0], sum(lengths)]
    assert np.array_equal(data["pooler_output"], np.concatenate([r.pooler_output for r in results]))
    assert np.array_equal(data["last_hidden_state"], np.concatenate([r.last_hidden_state for r in results]))


def test_a_repeated_input_gives_a_result_per_mention(tmp_path, tiny_ckpt, pngs):
    """--out and the library keep one result per mention, in position (a collection run, whose
    records are keyed by file, keeps one)."""
    out = tmp_path / "rep.npz"
    order = [pngs[0], pngs[1], pngs[0]]
    proc = run("encode", *map(str, order), "--model", str(tiny_ckpt), "--out", str(out), "--backend", "numpy")
    assert proc.returncode == 0, proc.stderr
    data = np.load(out)
    results = GlmVit.from_pretrained(tiny_ckpt, backend="numpy").encode(order, dtype="float32")
    assert len(results) == 3 and len(data["grid_thw"]) == 3
    rows = [data["pooler_output"][a:b] for a, b in zip(data["offsets"][:-1], data["offsets"][1:])]
    for r, o in zip(rows, results):
        assert_same_rows(r, o.pooler_output)
    assert_same_rows(rows[0], rows[2])
    assert not np.array_equal(data["grid_thw"][0], data["grid_thw"][1])


def test_last_hidden_only(tmp_path, tiny_ckpt, pngs):
    out = tmp_path / "lh.npy"
    assert run("encode", str(pngs[1]), "--model", str(tiny_ckpt), "--out", str(out), "--backend", "numpy",
               "--output", "last_hidden").returncode == 0
    ref = GlmVit.from_pretrained(tiny_ckpt, backend="numpy").encode(pngs[1], output="last_hidden", dtype="float32")[0].last_hidden_state
    assert np.array_equal(np.load(out), ref)


def test_user_mistakes_are_one_line(tmp_path, tiny_ckpt, pngs):
    model = ["--model", str(tiny_ckpt), "--backend", "numpy"]
    assert_clean_failure(run("encode", str(tmp_path / "none.png"), *model, "--out", str(tmp_path / "o.npy")),
                         "none.png", "no such file or directory")
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    assert_clean_failure(run("encode", str(tmp_path / "bad.png"), *model, "--out", str(tmp_path / "o.npy")),
                         "bad.png")
    blob = pngs[0].read_bytes()
    (tmp_path / "cut.png").write_bytes(blob[:len(blob) // 3])
    assert_clean_failure(run("encode", str(tmp_path / "cut.png"), *model, "--out", str(tmp_path / "o.npy")),
                         "cut.png")
    assert_clean_failure(run("encode", *map(str, pngs), *model, "--out", str(tmp_path / "o.npy")),
                         "several images", ".npz")
    assert_clean_failure(run("encode", str(pngs[0]), *model, "--out", str(tmp_path / "no" / "dir" / "o.npy")),
                         "does not exist")
    assert_clean_failure(run("encode", str(pngs[0]), *model, "--out", str(pngs[0]) + "/o.npy"), "o.npy")
    assert_clean_failure(run("encode", str(pngs[0]), *model, "--out", str(tmp_path / "o.txt")), ".npy or .npz")
    assert_clean_failure(run("encode", str(pngs[0]), "--model", str(tmp_path), "--out", str(tmp_path / "o.npy")),
                         "config.json")
    assert not list(tmp_path.glob("o.*")) and not list(tmp_path.glob(".o.*"))


def test_text_only_and_broken_checkpoints(tmp_path, pngs):
    from glmvit_cupy.tower.synthetic import write_checkpoint

    ckpt = write_checkpoint(tmp_path / "c", "tiny", seed=4, export="vision-only")
    (ckpt / "config.json").write_text('{"model_type": "glm5_next", "text_config": {}}')
    assert_clean_failure(run("info", "--model", str(ckpt)), "text-only")
    (ckpt / "config.json").write_text('{"model_type": "glm5_next_vision", "depth": 3}')
    assert_clean_failure(run("encode", str(pngs[0]), "--model", str(ckpt), "--out", str(tmp_path / "o.npy")),
                         "14 missing", "visual.blocks.2.norm1.weight")


def test_failed_run_leaves_an_existing_output_untouched(tmp_path, tiny_ckpt, pngs):
    out = tmp_path / "keep.npy"
    out.write_bytes(b"precious")
    proc = run("encode", str(pngs[0]), str(tmp_path / "missing.png"), "--model", str(tiny_ckpt),
               "--out", str(tmp_path / "keep.npz"), "--backend", "numpy")
    assert_clean_failure(proc, "missing.png")
    proc = run("encode", str(tmp_path / "missing.png"), "--model", str(tiny_ckpt), "--out", str(out),
               "--backend", "numpy")
    assert_clean_failure(proc, "missing.png")
    assert out.read_bytes() == b"precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.npy"]


def test_info_reads_headers_only(tiny_ckpt):
    proc = run("info", "--model", str(tiny_ckpt))
    assert proc.returncode == 0, proc.stderr
    assert "39 BF16" in proc.stdout and "model-00001-of-00003.safetensors" in proc.stdout
    assert "1 other shard(s) not opened" in proc.stdout and "p_max" in proc.stdout


# Each command's --help: the opening of its description and one of its examples.
HELP = {
    "encode": ("Encode images and videos (INPUTS: files, directories, quoted glob patterns, .tar shards; videos by "
               "their extension, .mp4 .mkv .webm .mov .avi) into embeddings.",
               "glmvit-cupy encode photo.jpg --model ckpt --out emb.npy"),
    "info": ("Show the tower bound from a checkpoint (headers only; no tensor data is read)",
             "glmvit-cupy info --model ckpt"),
    "extract": ("Write the tower of SRC as a vision-only checkpoint in the new directory DST.",
                "glmvit-cupy extract zai-org/GLM-5.3-Flash glm53-vision"),
    "make-checkpoint": ("Write a checkpoint in the released form with random weights into DIRECTORY.",
                        "glmvit-cupy make-checkpoint ckpt --geometry tiny"),
    "bench": ("Time the GPU engine: median ms, TFLOP/s, % of cuBLAS's peak, scratch, stages.",
              "glmvit-cupy bench --model ckpt"),
    "serve": ("Serve embeddings over HTTP (the [serve] extra).",
              "glmvit-cupy serve --model ckpt"),
}


def test_help_explains_each_command():
    """The command's own --help, for every command: what it does, examples, and a line of help
    for each option (whitespace aside: click rewraps paragraphs to the terminal)."""
    import click

    from glmvit_cupy import cli

    top = run("--help")
    assert top.returncode == 0 and "Run the GLM-5.3-Flash vision tower without a framework." in top.stdout
    assert sorted(cli.main.commands) == sorted(HELP)
    for command, (description, example) in HELP.items():
        proc = run(command, "--help")
        text = " ".join(proc.stdout.split())
        assert proc.returncode == 0 and description in text and f"Examples: {example}" in text, (command, text)
        for option in cli.main.commands[command].params:
            if isinstance(option, click.Option):
                assert option.help and option.opts[0] in text, (command, option.name)


def test_a_decompression_bomb_is_one_line(tmp_path, tiny_ckpt):
    from helpers import bomb_png

    bomb = bomb_png(tmp_path / "bomb.png", 30000, 30000)
    proc = run("encode", str(bomb), "--model", str(tiny_ckpt), "--out", str(tmp_path / "o.npy"), "--backend", "numpy")
    assert_clean_failure(proc, "bomb.png", "900,000,000 pixels", "MAX_IMAGE_PIXELS")
    assert not list(tmp_path.glob("*.npy")) and not list(tmp_path.glob(".o.*"))


def test_out_of_host_memory_names_an_option_that_helps(capsys):
    """A MemoryError on the CPU backend: one line naming --max-image-tokens, which shrinks what
    the NumPy forward holds (--max-pixels alone cannot shrink a single image)."""
    from glmvit_cupy import cli

    @cli.user_errors
    def command() -> None:
        np.empty(1 << 62, dtype=np.uint8)  # a real MemoryError (NumPy's _ArrayMemoryError)

    with pytest.raises(SystemExit) as info:
        command()
    err = capsys.readouterr().err.strip()
    assert info.value.code == 1 and "\n" not in err
    assert err.startswith("glmvit-cupy: error: out of host memory: try a smaller --max-image-tokens")
