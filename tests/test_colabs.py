"""The Colab notebooks run top to bottom (tiny setting, so notebooks never rot) and are
committed without outputs."""
import os

import nbclient
import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLABS = os.path.join(ROOT, "colabs")
NAMES = ("01_quickstart.ipynb", "02_mopd_loss.ipynb", "03_sampling_and_teachers.ipynb",
         "04_sharding.ipynb")


def test_every_notebook_is_listed():
  assert sorted(f for f in os.listdir(COLABS) if f.endswith(".ipynb")) == list(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_committed_without_outputs(name):
  nb = nbformat.read(os.path.join(COLABS, name), as_version=4)
  nbformat.validate(nb)
  for i, cell in enumerate(nb.cells):
    if cell.cell_type == "code":
      assert not cell.outputs and cell.execution_count is None, (
          f"{name} cell {i} has outputs; strip them before committing (e.g. "
          f"`jupyter nbconvert --clear-output --inplace colabs/{name}`)")


@pytest.mark.parametrize("name", NAMES)
def test_runs_top_to_bottom(name, tmp_path, monkeypatch):
  # The kernel inherits this environment: the tiny setting, a fresh workdir, and not the 8
  # simulated devices of conftest.py (01-03 use one device; 04 asks for 8 itself).
  monkeypatch.setenv("MOPD_COLAB_TINY", "1")
  monkeypatch.setenv("MOPD_COLAB_WORKDIR", str(tmp_path / "workdir"))
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  nb = nbformat.read(os.path.join(COLABS, name), as_version=4)
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": COLABS}})
  client.execute()  # raises CellExecutionError naming the failing cell
