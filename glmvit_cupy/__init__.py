"""glmvit-cupy: the GLM-5.3-Flash vision tower (`Glm5NextVisionModel`) without a framework.

The package by layer, from the ground up: a module imports only from its own folder and from what
stands above it here, so a folder or a file knows nothing of what comes after it (tests/test_packaging.py
holds this map to the files, to each folder's docstring and to every import):

glmvit_cupy/
  errors            GlmVitError and the other exceptions users see
  bf16              BF16 as 16-bit patterns: the only place they are computed or become values
  workers           the processes the package starts: its own entry point, gone when their parent is
  tower/            The tower: its shape, its weights, its checkpoints, its math in float32 NumPy
    geometry        GlmVitGeometry, read from config.json and validated once
    weights         the weight tree: every tensor's name and shape, the deferred bias
    checkpoint      binding the tower's BF16 tensors (and only those) out of safetensors shards
    writer          writing safetensors files and whole directories atomically
    synthetic       checkpoints in the released form with random weights (tests, benchmarks, demos)
    layout          positions, attention segments, RoPE frequencies (shared by both backends)
    reference       the float32 NumPy forward: the readable statement of the math
  processor/        The processor: images and videos -> pixel_values, grid_thw, as transformers makes them
    preprocess      images (transformers' Glm5NextImageProcessorPil) and preprocessor_config.json
    video           videos, with timestamps (transformers' Glm5NextVideoProcessor), decoded with PyAV:
                    the optional [video] extra
  gpu/              The GPU engine: the CuPy forward and what it needs: buffers, kernels, faults, timings
    faults          GPU faults as one line, where they happen when asked
    kernel_source   the CUDA sources as text, with our headers pasted in, and their constants
    flash           flash attention's host side: tiles, launch sizes, the work list
    gemm_swiglu     the fused gate|up GEMM + SwiGLU's host side: its tiles, read from its source
    cublas          the cuBLAS GEMM wrapper (graph-capturable)
    kernels         loading cuda_src/*.cu as CuPy RawModules and launching them
    scratch         GlmVitScratch, the engine's preallocated device buffers
    engine          the CuPy forward: cuBLAS BF16 GEMMs + the kernels in cuda_src/
    benchmark       FLOP counts, CUDA-event timings, cuBLAS ceilings (glmvit-cupy bench)
    device_base64   base64 on the GPU, for the server's base64 answers
  collection/       Collections on disk: sources, the streaming pipeline, staging, resumable shards
    sources         command-line inputs (files, directories, patterns, lists, tar shards) -> sources
    clips           a video in a collection run: its sampled frames streamed from a decode worker,
                    under a budget of frames decoded ahead
    staging         batches of uint8 canvases to an engine and back: pinned buffers, a copy stream
    shards          the resumable output directory (safetensors shards + jsonl metadata), read_embeddings
    pipeline        the streaming pipeline: decode workers, packing, in-order results, collection runs
    progress        the bar / log lines of a collection run
  hub               a model reference -> a directory (Hugging Face repo ids from the local cache)
  extract           the tower alone as a vision-only checkpoint transformers loads
  outputs           GlmVitOutput and Timing, what the library hands back, and its output options' check
  batcher           one image a request, from many threads or coroutines, packed into shared forwards
  model             GlmVit: from_pretrained / forward / encode / encode_iter over either backend
  deploy/           GlmVit in many processes and hosts, and as an HTTP service
    encoder_cache   the server's results by the sha256 of image bytes: LRU by bytes, single flight
    devices         every GPU of a host: engine processes behind one pipeline (encode --devices)
    ray             many hosts: Ray Data decode tasks, engine actors and a shard sink (the optional
                    [ray] extra; imported by nothing here)
    handoff         the server's engine and HTTP front processes' contract: messages, memfd slots
    front           an HTTP front process of the server: routes, a request's Python, its images' decode
                    (the optional [serve] extra; imported by nothing here but serve)
    serve           the HTTP embedding server, `glmvit-cupy serve`: its engine process, which starts
                    the fronts (the optional [serve] extra; imported by nothing here)
  cli               `glmvit-cupy` (click): encode, serve, info, bench, extract, make-checkpoint (the
                    repository's top-level cli.py runs it from a checkout)
"""

from .collection.shards import read_embeddings
from .errors import GlmVitError, InputError, Overloaded, RequestTimeout
from .model import GlmVit
from .outputs import GlmVitOutput
from .processor.preprocess import preprocess
from .tower.geometry import GlmVitGeometry, load_geometry

__all__ = ["GlmVit", "GlmVitError", "GlmVitGeometry", "GlmVitOutput", "InputError", "Overloaded", "RequestTimeout",
           "load_geometry", "preprocess", "read_embeddings"]
__version__ = "0.1.0"
