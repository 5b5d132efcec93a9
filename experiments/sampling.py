"""The result grid of a layer-wise run: Figure 2 drawn from capsule space, as PNG and NumPy."""

import numpy as np

from poecaps.experiments import figures
from poecaps.experiments.configs import LayerwiseConfig
from poecaps.experiments.runs import RunDir, read_settings
from poecaps.experiments.trained import load_pipeline
from poecaps.samplers import CapsuleSampler
from poecaps.samplers.capsule import DOMAINS
from poecaps.validation import check_choice, check_integer, check_seed


def sample_run(run_dir, rows=None, domain=None, seed=0):
    """Draw the run's result grid and write `samples.png` and `samples.npz`.

    `samples.npz` holds `images [rows, J, H, W, C]` in [0, 1], the `draws
    [rows, J, D]`, and the `domain` and `seed`. `rows` and `domain` default
    to the run's `sample_rows` and `sample_domain`.

    Returns:
        dict with the paths `png` and `npz` and the images' `shape`.
    """
    # checked before the run is read and its models loaded
    rows, seed = check_integer(rows, "rows", allow_none=True), check_seed(seed)
    if domain is not None:
        check_choice(domain, "domain", DOMAINS)
    run = RunDir(run_dir, create=False)
    config = read_settings(run, LayerwiseConfig)
    rows = config.sample_rows if rows is None else rows
    domain = config.sample_domain if domain is None else domain
    pipeline = load_pipeline(run, config)
    run.record_environment("sample")
    result = CapsuleSampler(pipeline, seed=seed).sample(rows, domain=domain)
    npz = run.file("samples.npz")
    np.savez(npz, images=result["images"], draws=result["draws"], domain=domain, seed=seed)
    png = run.file("samples.png")
    shown = result["images"][:min(rows, 8)]
    figures.image_grid(shown, png, title=f"Samples from capsule space ({domain} domain, {len(shown)} of "
                                         f"{rows} rows): one column per capsule",
                       column_labels=range(shown.shape[1]))
    return {"png": png, "npz": npz, "shape": tuple(result["images"].shape)}
