"""``headrace bench``: throughput of the schedulers against the ideal bound of their latency model.

``scenario`` (TOML scenarios), ``harness`` (runs and figures), ``ideal`` (the bound), ``floor``
(the bare-asyncio floor for engine overhead), ``report`` (table, JSON, PNG), ``page``
(RESULTS.md), ``cli`` (the subcommand).
"""
