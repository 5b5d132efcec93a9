"""Kiefer et al.'s routing-as-inference toy (appendix B): the six final hidden states and the figure.

`python scripts/toy_routing.py --help` lists the flags.
"""

from poecaps.experiments.commands import toy_routing

if __name__ == "__main__":
    toy_routing()
