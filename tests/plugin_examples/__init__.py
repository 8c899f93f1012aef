"""Plugins that live outside the package, as a researcher's fork would hold them: a loss
(`scaled_loss`) and a domain (`parity_domain`). tests/test_plugins.py runs the tiny pipeline
with them, named by `--config.plugins` as docs/walkthrough.md says."""
