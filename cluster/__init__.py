"""The Trio shell: wire codec, node server, client library, worker agent, leases, routing, CLI.

Drivers only: every scheduling decision is delegated to ``engine``. The CLI alone loads ``sim``
and ``bench`` lazily, for ``tickwheel sim`` and ``tickwheel bench``.
"""
