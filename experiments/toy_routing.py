"""Appendix B's toy, run and drawn: hidden states of the 3-3-1 network over 500 steps, 2 readings x 3 penalties."""

import os

from poecaps import inference
from poecaps.experiments import figures
from poecaps.experiments.configs import ToyRoutingConfig
from poecaps.experiments.runs import RunDir


def toy_routing(run_dir, steps=500, learning_rate=0.01):
    """Run the six settings from a fresh start each; write `run_dir/toy_routing.png`; return the final states.

    Returns `{"output_only": {"none": [x1, x2, x3], "l1": ..., "l2": ...}, "full": {...}}`. The
    settings are checked (`configs.ToyRoutingConfig`) before anything is written.
    """
    ToyRoutingConfig(steps=steps, learning_rate=learning_rate)
    RunDir(run_dir, create="later")          # a file where the folder should be is refused before the runs
    finals, panels = {}, []
    for reading in inference.READINGS:
        row = []
        for penalty in inference.PENALTIES:
            trajectory, _ = inference.toy_states(penalty, reading, steps=steps, learning_rate=learning_rate)
            trajectory = trajectory.numpy()
            finals.setdefault(reading, {})[penalty] = [float(x) for x in trajectory[-1]]
            row.append((f"{reading.replace('_', '-')}, {penalty}",
                        {f"x{k + 1}": trajectory[:, k] for k in range(3)}))
        panels.append(row)
    os.makedirs(run_dir, exist_ok=True)      # only once there is something to write
    figures.line_panels(panels, os.path.join(run_dir, "toy_routing.png"), ylabel="hidden state",
                        title="Kiefer et al. appendix B: hidden states from x = u = (-1, 5, 2), target 2, "
                              f"SGD {learning_rate}")
    return finals
