"""The video oracle: transformers 5.23's own Glm5NextVideoProcessor and Glm5NextModel.get_video_features,
float32 on the CPU, run in the oracle venv (torch 2.14.1 + torchvision 0.29.1, which the processor
imports; see README.md, Tests). tests/test_video.py runs it in a subprocess:

    python tests/video_oracle.py JOB.json OUT_DIR

JOB.json: {"text_config": {...}, "cases": [{"name", "model", and "path" (a video file) or
"frames" (an .npy [T, H, W, 3] uint8 of frames given as they are)}]}. For each case OUT_DIR/NAME.npz
holds pixel_values_videos, video_grid_thw, pooler_output and last_hidden_state, and for a file
frames_indices, timestamps (of each temporal group, as the processor's prompt writes them), fps
and total_num_frames. Nothing of glmvit_cupy is imported here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextModel
from transformers.models.glm5_next.video_processing_glm5_next import Glm5NextVideoProcessor
from transformers.video_utils import VideoMetadata, load_video

PREFIX = "model.visual."


def processor_for(model_dir: Path) -> Glm5NextVideoProcessor:
    """As transformers loads it: the checkpoint's processor/video/image processor config, or the
    class defaults where the directory has none (from_pretrained raises then)."""
    try:
        return Glm5NextVideoProcessor.from_pretrained(model_dir)
    except OSError:
        return Glm5NextVideoProcessor()


def model_for(model_dir: Path, text_config: dict) -> Glm5NextModel:
    vision = json.loads((model_dir / "config.json").read_text())["vision_config"]
    model = Glm5NextModel(Glm5NextConfig(text_config=text_config, vision_config=vision)).eval()
    state = {}
    for shard in model_dir.glob("*.safetensors"):
        state.update({k[len(PREFIX):]: v for k, v in load_file(shard).items() if k.startswith(PREFIX)})
    model.visual.load_state_dict(state, strict=True)
    return model.float()


def decode_all(path: str) -> tuple[np.ndarray, VideoMetadata]:
    """Every frame and the header's metadata, by transformers' PyAV loader. A header without a
    frame count (Matroska, WebM) gives that loader nothing to decode; there the frames are
    decoded with PyAV directly and counted, the metadata built as the loader builds it."""
    import av

    with av.open(path) as container:
        stream = container.streams.video[0]
        total, rate = stream.frames, stream.average_rate
        if total == 0:
            frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
            return frames, VideoMetadata(total_num_frames=len(frames), fps=float(rate),
                                         duration=float(len(frames) / rate), video_backend="pyav")
    return load_video(path, backend="pyav", sample_indices_fn=lambda metadata, **_: np.arange(metadata.total_num_frames))


def main(job_path: str, out_dir: str) -> None:
    job = json.loads(Path(job_path).read_text())
    models = {}
    for case in job["cases"]:
        model_dir = Path(case["model"])
        processor = processor_for(model_dir)
        if "path" in case:
            video, metadata = decode_all(case["path"])
            metadata.frames_indices = None
            out = processor(videos=[video], video_metadata=[metadata], return_metadata=True, return_tensors="pt")
            sampled = out["video_metadata"][0]
            if sampled.frames_indices is None:  # do_sample_frames false: every frame, as load_video gives them
                sampled.frames_indices = np.arange(len(video))
            extra = dict(frames_indices=np.asarray(sampled.frames_indices), timestamps=np.asarray(sampled.timestamps[::2]),
                         fps=sampled.fps, total_num_frames=sampled.total_num_frames)
        else:
            out = processor(videos=[np.load(case["frames"])], do_sample_frames=False, return_tensors="pt")
            extra = {}
        if model_dir not in models:
            models[model_dir] = model_for(model_dir, job["text_config"])
        with torch.no_grad():
            features = models[model_dir].get_video_features(out["pixel_values_videos"], out["video_grid_thw"])
        np.savez(Path(out_dir) / f"{case['name']}.npz", pixel_values_videos=out["pixel_values_videos"].numpy(),
                 video_grid_thw=out["video_grid_thw"].numpy(),
                 pooler_output=torch.cat(features.pooler_output).numpy(),
                 last_hidden_state=features.last_hidden_state.numpy(), **extra)


if __name__ == "__main__":
    main(*sys.argv[1:])
