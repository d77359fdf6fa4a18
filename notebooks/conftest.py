"""nbval runs a notebook's cells in order in one kernel, so under pytest-xdist the cells of one notebook must reach
one worker: with `--dist loadgroup` (the README's command) each notebook is one group, and every other test is
sent on its own."""
import pytest


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.xdist_group(item.path.name))
