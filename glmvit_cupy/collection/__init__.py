"""Collections on disk: sources, the streaming pipeline, staging, resumable shards.

Separate because it moves many inputs through one engine and computes nothing of the tower
itself: the tower, the processor and the GPU engine know nothing of it.
"""
