"""``python -m attnzoo ...``: the ``attnzoo`` command line, also as one process of a torchrun
launch (``torchrun --nproc_per_node=N -m attnzoo timm train.py ...``)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
