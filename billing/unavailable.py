"""The database errors that mean "the store is down now", as opposed to a bug in a query.

Billing keeps serving through an outage on what it last read (budgets, prices) and meters into its
journal; only these errors take that path, anything else still fails loudly.
"""

from __future__ import annotations

from sqlalchemy import exc

UNAVAILABLE_ERRORS = (exc.OperationalError, exc.InterfaceError, exc.DisconnectionError, exc.TimeoutError)
