"""The processor: images and videos -> pixel_values, grid_thw, as transformers makes them.

Separate from the tower because it is a second part of a release (preprocessor_config.json,
transformers' processor classes) that needs only the tower's geometry, and from the engines
because it runs on the host, before either.
"""
