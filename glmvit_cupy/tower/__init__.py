"""The tower: its shape, its weights, its checkpoints, its math in float32 NumPy.

Separate because everything else stands on it and it stands on nothing but the package's
base: it knows no processor, no GPU and no collection, so what the tower is and computes reads
without them.
"""
