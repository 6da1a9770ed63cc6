from pathlib import Path

import lance_ray


def test_lance_ray_module_is_ours_not_the_unrelated_pypi_package():
    repo = Path(__file__).resolve().parents[1]
    assert Path(lance_ray.__file__).resolve().parent == repo / "lance_ray"
    assert hasattr(lance_ray, "StreamingDataset")
