"""glmvit-cupy: the GLM-5.3-Flash vision tower (`Glm5NextVisionModel`) without a framework.

Modules, one concern each, by layer (tests/test_packaging.py holds this list to the files):

The model and its checkpoints
  errors      GlmVitError and the other exceptions users see
  geometry    GlmVitGeometry, read from config.json and validated once
  weights     the weight tree: every tensor's name and shape, the deferred bias
  hub         a model reference -> a directory (Hugging Face repo ids from the local cache)
  checkpoint  binding the tower's BF16 tensors (and only those) out of safetensors shards
  extract     the tower alone as a vision-only checkpoint transformers loads
  writer      writing safetensors files and whole directories atomically
  synthetic   writing checkpoints in the released form with random weights (tests, benchmarks, demos)
The math and the processor
  bf16        BF16 as 16-bit patterns: the only place they are computed or become values
  preprocess  images -> pixel_values, grid_thw (transformers' Glm5NextImageProcessorPil), and
              the processor's preprocessor_config.json
  video       videos -> pixel_values, grid_thw, timestamps (transformers' Glm5NextVideoProcessor,
              decoded with PyAV: the optional [video] extra)
  layout      positions, attention segments, RoPE frequencies (shared by both backends)
  reference   the float32 NumPy forward: the readable statement of the math
The GPU engine
  engine      the CuPy forward: cuBLAS BF16 GEMMs + the kernels in cuda_src/
  scratch     GlmVitScratch, the engine's preallocated device buffers
  kernels     loading cuda_src/*.cu as CuPy RawModules and launching them
  kernel_source  the CUDA sources as text, with our headers pasted in, and their constants
  flash       flash attention's host side: tiles, launch sizes, the work list
  gemm_swiglu the fused gate|up GEMM + SwiGLU's host side: its tiles, read from its source
  cublas      the cuBLAS GEMM wrapper (graph-capturable)
  faults      GPU faults as one line, where they happen when asked
  benchmark   FLOP counts, CUDA-event timings, cuBLAS ceilings (glmvit-cupy bench)
  outputs     GlmVitOutput and Timing, what the library hands back, and its output options' check
  model       GlmVit: from_pretrained / forward / encode / encode_iter over either backend
Collections, processes and serving
  sources     command-line inputs (files, directories, patterns, lists, tar shards) -> sources
  pipeline    the streaming pipeline: decode workers, packing, in-order results, collection runs
  clips       a video in a collection run: its sampled frames streamed from a decode worker, under a
              budget of frames decoded ahead
  workers     the processes the package starts: its own entry point, gone when their parent is
  batcher     one image a request, from many threads or coroutines, packed into shared forwards
  staging     batches of uint8 canvases to an engine and back: pinned buffers, a copy stream
  shards      the resumable output directory (safetensors shards + jsonl metadata), read_embeddings
  progress    the bar / log lines of a collection run
  devices     every GPU of a host: engine processes behind one pipeline (encode --devices)
  ray         many hosts: Ray Data decode tasks, engine actors and a shard sink (the optional [ray] extra;
              imported by nothing here)
  serve       the HTTP embedding server, `glmvit-cupy serve` (the optional [serve] extra; imported by nothing here)
  encoder_cache  the server's results by the sha256 of image bytes: LRU by bytes, single flight
  device_base64  base64 on the GPU, for the server's base64 answers
The command line
  cli         `glmvit-cupy` (click): encode, serve, info, bench, extract, make-checkpoint (the
              repository's top-level cli.py runs it from a checkout)
"""

from .errors import GlmVitError, InputError, Overloaded, RequestTimeout
from .geometry import GlmVitGeometry, load_geometry
from .model import GlmVit
from .outputs import GlmVitOutput
from .preprocess import preprocess
from .shards import read_embeddings

__all__ = ["GlmVit", "GlmVitError", "GlmVitGeometry", "GlmVitOutput", "InputError", "Overloaded", "RequestTimeout",
           "load_geometry", "preprocess", "read_embeddings"]
__version__ = "0.1.0"
