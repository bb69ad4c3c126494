"""opgate's benchmark suite: what the proxy costs, next to direct, kubectl proxy and nginx.

Run with ``python -m bench`` (``--quick`` for a smoke run); see ``bench/README.md``. Not a test
package: pytest's ``testpaths`` is ``tests`` only, and nothing here is named ``test_*``.
"""
