"""``luopan`` CLI entry point: the app (luopan.cli.app) with every command module registered on it.

Commands by concern: inspect (ls, show, diff, du), read (verify, export), maintain (init, prune, pin, unpin, gc,
locks, unlock), artifact (artifact commit/ls/log/checkout/verify/pin/unpin/prune), folders (artifact status/diff),
lineage (show, link), tier (replicate,
cold), plan, keys (key gen, sign). The repository comes from ``-r/--repo`` (before or after the command)
or ``LUOPAN_REPO``. Exit codes: luopan.cli.app.EXIT_CODES.
"""

from __future__ import annotations

from . import inspect, read, maintain, artifact, tier, plan, keys, channel  # noqa: F401,I001  (each registers its commands on app, in --help order)
from . import folders  # noqa: F401,I001  (luopan artifact status|diff)
from . import patch  # noqa: F401,I001  (luopan patch create|apply)
from . import index  # noqa: F401,I001  (luopan index ls|rollback)
from . import doctor  # noqa: F401,I001  (luopan doctor)
from . import stats  # noqa: F401,I001  (luopan stats|check|rm|latest)
from . import report  # noqa: F401,I001  (luopan report)
from . import lineage  # noqa: F401,I001  (luopan lineage [show] NAME@V, lineage link RUN@STEP NAME@V)
from .app import app


def main() -> None:
    app()


if __name__ == "__main__":
    main()
