"""Where the React hook app's bundle is built (gitignored), for the builder and the test server."""

from pathlib import Path

HOOK_DIST = Path(__file__).resolve().parent / "js" / "hook" / "dist"
