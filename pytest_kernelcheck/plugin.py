"""pytest wiring for pytest-kernelcheck; placeholder until the plugin lands."""
pytest_plugins = ["pytest_kernelcheck.plugin_ab"]
