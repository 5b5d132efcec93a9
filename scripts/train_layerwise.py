"""Train the products of expert capsules layer by layer, draw the result grid and evaluate (the main job).

`python scripts/train_layerwise.py --help` lists the flags, the presets and every setting.
"""

from poecaps.experiments.commands import train_layerwise

if __name__ == "__main__":
    train_layerwise()
