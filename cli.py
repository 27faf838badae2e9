"""`python cli.py ...` from a checkout: the `glmvit-cupy` command (glmvit_cupy/cli.py).

The command's code lives inside the package so that an install adds one top-level name,
`glmvit_cupy`, and not a module called `cli` to every environment it goes into.
"""

from glmvit_cupy.cli import main

if __name__ == "__main__":
    main()
