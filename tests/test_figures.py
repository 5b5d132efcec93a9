"""Figures: the image grid's mosaic against a hand-placed case, and the PNG it writes."""

import matplotlib.image
import numpy as np
import pytest

from poecaps.errors import InputError
from poecaps.experiments import figures


def test_mosaic_places_each_cell_after_the_cells_and_gaps_before_it():
    images = np.zeros((2, 3, 2, 2, 1), dtype="float32")
    for r in range(2):
        for c in range(3):
            images[r, c] = 0.1 * (3 * r + c)       # cell (r, c) is filled with 0.1 (3 r + c)
    images[1, 2, 0, 0, 0] = 7.0                    # clipped to 1
    tiled = figures.mosaic(images, gap=1, fill=0.5)
    assert tiled.shape == (2 * 3 - 1, 3 * 3 - 1, 1)
    expected = np.full((5, 8), 0.5, dtype="float32")
    for r in range(2):
        for c in range(3):
            expected[3 * r:3 * r + 2, 3 * c:3 * c + 2] = 0.1 * (3 * r + c)
    expected[3, 6] = 1.0
    np.testing.assert_array_equal(tiled[..., 0], expected)


def test_mosaic_keeps_colour_channels_and_refuses_other_shapes():
    images = np.random.default_rng(0).uniform(size=(1, 2, 3, 4, 3))
    tiled = figures.mosaic(images, gap=2)
    np.testing.assert_allclose(tiled[:, 6:], images[0, 1], rtol=1e-6)
    np.testing.assert_array_equal(tiled[:, 4:6], 1.0)
    with pytest.raises(InputError, match=r"\[rows, cols, H, W, C\]"):
        figures.mosaic(images[0])


@pytest.mark.parametrize("images, settings, message", [
    ((1, 2, 3, 4, 1), {"gap": -1}, r"^gap must be an integer >= 0. Received: gap=-1$"),
    ((1, 2, 3, 4, 1), {"gap": 2.5}, r"^gap must be an integer >= 0. Received: gap=2.5$"),
    ((1, 2, 3, 4, 1), {"fill": float("nan")}, r"^fill must be a finite number >= 0 and <= 1. Received: fill=nan$"),
    ((1, 2, 3, 4, 1), {"fill": 2.0}, r"fill=2.0$"),
    ((0, 2, 3, 4, 1), {}, r"^images must be \[rows, cols, H, W, C\], no axis empty. Received: shape=\(0, 2, 3, 4, 1\)$"),
])
def test_mosaic_refuses_gaps_fills_and_grids_it_cannot_draw(images, settings, message):
    """Before, a gap of -1 overlapped the cells (each one's last rows overwritten by the next), 2.5 and an empty
    grid failed in NumPy's words, and a NaN or out-of-range fill was drawn as it was (NaN gaps)."""
    with pytest.raises(InputError, match=message):
        figures.mosaic(np.zeros(images, "float32"), **settings)


def test_image_grid_takes_one_label_per_column_and_row(tmp_path):
    """Before, Matplotlib refused another count ('The number of FixedLocator locations (3) ... does not match the
    number of labels (2)') after the figure was made, which stayed open."""
    images = np.zeros((2, 3, 4, 4, 1))
    with pytest.raises(InputError, match=r"^column_labels must hold one label per column, 3\. Received: 2 labels$"):
        figures.image_grid(images, tmp_path / "a.png", column_labels=range(2))
    with pytest.raises(InputError, match=r"^row_labels must hold one label per row, 2\. Received: 1 label$"):
        figures.image_grid(images, tmp_path / "a.png", row_labels=["a"])
    assert not (tmp_path / "a.png").exists()


def test_image_grid_writes_a_png_of_its_figure_size(tmp_path):
    images = np.random.default_rng(0).uniform(size=(3, 5, 28, 28, 1))
    path = tmp_path / "grid.png"
    figures.image_grid(images, path, title="t", column_labels=range(5), row_labels=["a", "b", "c"])
    written = matplotlib.image.imread(path)
    assert written.shape[:2] == (round((3 * 0.8 + 0.4) * 100), 5 * 0.8 * 100)     # figsize x dpi 100


def test_line_panels_plots_a_dict_at_its_keys_and_a_sequence_at_its_index(tmp_path, monkeypatch):
    import matplotlib.axes

    drawn = []
    original = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda self, *args, **kwargs: drawn.append(args) or original(self, *args, **kwargs))
    path = tmp_path / "curves.png"
    figures.line_panels([[("a", {"per epoch": {1: 5.0, 3: 7.0}, "per step": [2.0, 4.0, 8.0]}), ("b", {"c": [1.0]})]],
                        path, xlabel="epoch")
    assert [list(map(list, args)) for args in drawn] == [[[1, 3], [5.0, 7.0]], [[2.0, 4.0, 8.0]], [[1.0]]]
    assert matplotlib.image.imread(path).shape[:2] == (240, 640)      # one row of two 3.2 x 2.4 panels, dpi 100


def test_training_curves_scale_each_metric_by_its_largest_finite_value(tmp_path, monkeypatch):
    """Before, one infinite value set the scale (every other point 0) and an all-NaN metric a NaN scale, and a
    file with no records failed in matplotlib ("Number of columns must be a positive integer, not 0")."""
    import json

    import matplotlib.axes

    drawn = []
    original = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda self, *args, **kwargs: drawn.append((args, kwargs["label"]))
                        or original(self, *args, **kwargs))
    records = [{"stage": "encoder", "epoch": 0, "loss": float("inf"), "gap": float("nan")},
               {"stage": "encoder", "epoch": 1, "loss": -4.0, "gap": float("nan")},
               {"stage": "encoder", "epoch": 2, "loss": 2.0, "gap": float("nan")}]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert figures.training_curves(metrics, tmp_path / "curves.png") and (tmp_path / "curves.png").exists()
    (x, loss), label = drawn[0]
    assert list(x) == [1, 2, 3] and label == "loss (/4)"
    np.testing.assert_array_equal(loss, [np.nan, -1.0, 0.5])
    (_, gap), label = drawn[1]
    assert label == "gap (/1)" and np.isnan(gap).all()
    metrics.write_text("")
    assert not figures.training_curves(metrics, tmp_path / "none.png") and not (tmp_path / "none.png").exists()
