"""`python -m torch_cubridge ...`: the same entry point as the `cubridge` command."""
from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
