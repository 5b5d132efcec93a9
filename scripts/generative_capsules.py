"""Learn a generative capsule layer on a trained CapsNet run's primary capsules: figures and samples.

`python scripts/generative_capsules.py --help` lists the flags.
"""

from poecaps.experiments.commands import generative_capsules

if __name__ == "__main__":
    generative_capsules()
