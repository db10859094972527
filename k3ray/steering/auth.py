"""Bearer-token auth of both steering apps and the files keys live in.

`BearerAuth(key)` is one FastAPI dependency: a request without `Authorization: Bearer <key>` (compared in constant
time) gets 401 with one body on both apps, readable by the control CLI (`detail`) and by OpenAI clients (`error`).
A training job's key is generated per job and written 0600 (`new_token`, `write_private`); a serving endpoint's comes
from `--api-key-file` or $K3RAY_API_KEY (`read_api_key`), and without one it is open.
"""
import hmac
import os
import secrets
from pathlib import Path
from typing import Optional

from fastapi import Depends, HTTPException, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from k3ray.steering.protocol import error_body

API_KEY_ENV = "K3RAY_API_KEY"
_BEARER = HTTPBearer(auto_error=False, description="a training job's runs/<job>/api_token, or the key `k3ray serve` "
                                                   "was given")


class Unauthorized(HTTPException):
    def __init__(self, why: str):
        super().__init__(401, f"{why}: send Authorization: Bearer <key> (a training job's api_token file, or the key "
                              f"`k3ray serve` was given)", headers={"WWW-Authenticate": "Bearer"})


async def answer_unauthorized(request: Request, err: Unauthorized) -> JSONResponse:
    """The app's handler for `Unauthorized` (routers cannot hold handlers; `steering_app` installs it)."""
    return JSONResponse(error_body(err.detail, 401, "invalid_api_key"), status_code=401, headers=err.headers)


class BearerAuth:
    """The dependency guarding every route but /health and /healthz; `key` None leaves them open."""

    def __init__(self, key: str | None):
        self.key = None if key is None else key.encode()

    def __call__(self, creds: Optional[HTTPAuthorizationCredentials] = Depends(_BEARER)) -> None:
        if self.key is None:
            return
        given = "" if creds is None else creds.credentials.strip()
        if not given:
            raise Unauthorized("no API key given")
        if not hmac.compare_digest(given.encode(), self.key):
            raise Unauthorized("invalid API key")


def new_token() -> str:
    return secrets.token_urlsafe(32)


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` readable by the owner only (0600), creating parent directories."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def read_api_key(path: str | None) -> str | None:
    """A serving endpoint's API key: the first line of `path`, else $K3RAY_API_KEY, else None. ValueError names
    what is wrong (an unreadable or empty file)."""
    if path:
        try:
            key = Path(path).read_text().strip()
        except OSError as err:
            raise ValueError(f"--api-key-file {path}: cannot read it ({err.strerror})") from None
        if not key:
            raise ValueError(f"--api-key-file {path}: empty")
        return key
    return os.environ.get(API_KEY_ENV) or None
