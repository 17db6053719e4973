"""``python -m tabby_bench bench ...``: the same as the ``tabby`` command."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
