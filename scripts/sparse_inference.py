"""Sparse iterative inference on a trained CapsNet run without routing: measured and drawn.

`python scripts/sparse_inference.py --help` lists the flags.
"""

from poecaps.experiments.commands import sparse_inference

if __name__ == "__main__":
    sparse_inference()
