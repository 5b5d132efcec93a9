"""Draw the Figure 2 grid from a trained layer-wise run: RUN/samples.png and RUN/samples.npz.

`python scripts/sample.py --help` lists the flags.
"""

from poecaps.experiments.commands import sample

if __name__ == "__main__":
    sample()
