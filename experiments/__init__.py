"""The experiment layer: presets, run directories, the pipelines and the evaluation of a run."""
