"""Train the routing network once per router and print one table comparing them.

`python scripts/compare_routing.py --help` lists the flags and the rows.
"""

from poecaps.experiments.commands import compare_routing

if __name__ == "__main__":
    compare_routing()
