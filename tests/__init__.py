"""The test suite (a package, so tests import helpers as `tests.support.X`)."""
