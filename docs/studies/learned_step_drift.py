"""The learned-router benchmark's spread: poecaps' step and the reference's, timed in turn, round by round.

Usage: python docs/studies/learned_step_drift.py [--router connectionist] [--rounds 30] [--seed 0]

`bench/learned_step.py` times poecaps' step (best of 3 after 2 warm-up
steps) and then, in a second block, the reference's. This builds the same
two steps (same sizes, weights, data and check of the reference against
poecaps), warms each up twice, then runs them in turn for `--rounds` rounds
and prints each round: both wall times, their ratio (reference / poecaps),
and per CPU the share of the round the kernel counted busy and stolen
(`/proc/stat`; left out where it does not exist). A closing line gives the
fastest and slowest round of each step and the ratio's range and median.

Whether a spread between runs comes from the code (a step that changes
speed as it trains) or from the machine (stretches in which it is slower)
shows in the rounds: the same steps, one after the other, in one process.
"""

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import numpy as np
from common import machine
from learned_step import poecaps_run, reference_run


def cpu_ticks():
    """`{cpu: (busy, steal)}` clock ticks since boot from /proc/stat ({} where it does not exist)."""
    if not os.path.exists("/proc/stat"):
        return {}
    ticks = {}
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name != "cpu":
                user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
                ticks[name] = (user + nice + system + irq + softirq, steal)
    return ticks


def shares(before, after, seconds):
    """Per CPU, `busy/steal` as percentages of `seconds` (USER_HZ ticks)."""
    hz = os.sysconf("SC_CLK_TCK")
    return " ".join(f"{cpu} {100 * (after[cpu][0] - before[cpu][0]) / hz / seconds:.0f}/"
                    f"{100 * (after[cpu][1] - before[cpu][1]) / hz / seconds:.0f}%" for cpu in sorted(after))


def steps(router, batch, seed):
    """poecaps' XLA training step and the reference's, as `bench/learned_step.py` builds and checks them."""
    rng = np.random.default_rng(seed)
    images = rng.uniform(size=(batch, 28, 28, 1)).astype("float32")
    labels = rng.integers(0, 10, size=batch)
    return poecaps_run(router, images, labels, seed), reference_run(router, images, labels, seed)


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--router", choices=["similarity", "connectionist"], default="connectionist")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.rounds < 1 or args.batch < 1:
        p.error("--rounds and --batch must be at least 1")
    print(f"machine: {machine()}", flush=True)
    run, ref_run = steps(args.router, args.batch, args.seed)
    for _ in range(2):
        run(), ref_run()
    rows = []
    for i in range(args.rounds):
        before, start = cpu_ticks(), time.perf_counter()
        seconds, ref_seconds = timed(run), timed(ref_run)
        load = shares(before, cpu_ticks(), time.perf_counter() - start) if before else "n/a"
        rows.append((seconds, ref_seconds))
        print(f"round {i:2d}: poecaps {seconds * 1e3:7.1f} ms, reference {ref_seconds * 1e3:7.1f} ms, "
              f"ratio {ref_seconds / seconds:.2f}; CPU busy/steal {load}", flush=True)
    mine, ref = zip(*rows)
    ratios = [r / s for s, r in rows]
    print(f"{args.router}: poecaps {min(mine) * 1e3:.1f}-{max(mine) * 1e3:.1f} ms, reference "
          f"{min(ref) * 1e3:.1f}-{max(ref) * 1e3:.1f} ms; ratio {min(ratios):.2f}-{max(ratios):.2f}, "
          f"median {statistics.median(ratios):.2f}, over {args.rounds} rounds", flush=True)


if __name__ == "__main__":
    main()
