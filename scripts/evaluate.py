"""Evaluate a trained layer-wise run: write RUN/eval.json and print it.

`python scripts/evaluate.py --help` lists the flags.
"""

from poecaps.experiments.commands import evaluate

if __name__ == "__main__":
    evaluate()
