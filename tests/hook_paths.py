"""Where the React apps' bundles are built (gitignored), for the builder and the test server: the
`agents` hook app (tests/js/hook) and the AI SDK `useChat` app (tests/js/usechat)."""

from pathlib import Path

HOOK_DIST = Path(__file__).resolve().parent / "js" / "hook" / "dist"
USECHAT_DIST = Path(__file__).resolve().parent / "js" / "usechat" / "dist"
