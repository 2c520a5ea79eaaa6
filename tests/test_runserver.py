"""daphne's app is installed for `manage.py runserver` only (thinkproject/settings.py).

It makes runserver serve the ASGI application, the chat socket included; in any other process it only
costs the start (twisted and autobahn, about 0.2 s of a worker's): a cold recovery waits for a worker's
start (bench/worker_start.py).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEY = "qX3v9-fR2mL8kZ1pT6wN4yB7hJ0cD5sG-aE2uI9oQ3rV8tY1xW6zM4nK7bP0lF5jH"


def demo_env() -> dict[str, str]:
    from django.conf import settings

    db = settings.DATABASES["default"]
    url = f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/postgres"  # runserver looks at migrations
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "THINK_TEST"))}
    return {
        **env,
        "DJANGO_SETTINGS_MODULE": "thinkproject.settings",
        "DJANGO_SECRET_KEY": KEY,
        "DATABASE_URL": url,
    }


def test_other_processes_do_without_daphnes_app() -> None:
    probe = "import sys, django; django.setup(); from django.conf import settings; "
    probe += "print('daphne' in settings.INSTALLED_APPS, 'twisted' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=demo_env(), capture_output=True, text=True, timeout=60
    )
    assert done.stdout.split() == ["False", "False"], done.stderr


def test_runserver_serves_the_asgi_application() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "manage.py", "runserver", f"127.0.0.1:{port}", "--noreload", "--skip-checks"],
        cwd=ROOT,
        env=demo_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        lines: list[str] = []
        assert server.stdout is not None
        while time.monotonic() < deadline:
            line = server.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "development server at" in line:
                break
        assert any("ASGI/Daphne" in line for line in lines), "".join(lines)
    finally:
        server.kill()
        server.wait(10)
