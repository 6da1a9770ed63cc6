from pathlib import Path

import lance_ray


def test_lance_ray_module_is_ours_not_the_unrelated_pypi_package():
    repo = Path(__file__).resolve().parents[1]
    assert Path(lance_ray.__file__).resolve().parent == repo / "lance_ray"
    assert hasattr(lance_ray, "StreamingDataset")


def test_the_wheel_holds_lance_ray_and_its_license_and_nothing_of_jobs_or_tests(tmp_path):
    import subprocess
    import sys
    import zipfile

    repo = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path), str(repo)], check=True,
                   timeout=300)
    [wheel] = tmp_path.glob("lance_ray_streaming-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"lance_ray"}
    assert "lance_ray/testing/tables.py" in names  # the public testing helpers ship
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE")
               for n in names), names
