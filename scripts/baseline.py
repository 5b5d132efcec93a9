"""Train and evaluate a supervised capsule baseline (CapsNet or matrix capsules).

`python scripts/baseline.py --help` lists the flags, the presets and every setting.
"""

from poecaps.experiments.commands import baseline

if __name__ == "__main__":
    baseline()
