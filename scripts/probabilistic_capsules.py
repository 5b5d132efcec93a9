"""Train the probabilistic capsule model and its VAE baseline; refine at test time, probe, draw.

`python scripts/probabilistic_capsules.py --help` lists the flags.
"""

from poecaps.experiments.commands import probabilistic_capsules

if __name__ == "__main__":
    probabilistic_capsules()
