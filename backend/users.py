"""Who is asking, and what they may see: the users of a shared server (issue 25, item 2).

Identities come from the credentials a server starts with:

- ``--auth USER:PASS`` (one login, as before): USER, an admin;
- ``--auth-file FILE``: one ``user:HASH`` a line, HASH a bcrypt (``$2b$...``) or scrypt
  (``$scrypt$ln=14,r=8,p=1$SALT$HASH``, PHC form, base64 without padding) hash; plain-text passwords
  are refused, naming the file and line. ``python app.py hash-password NAME`` writes such a line;
- ``--api-key KEY`` (an unnamed key, as before): the name ``api``, an admin; ``--api-key NAME=KEY``,
  repeatable: a key acting as NAME (a key named like a file user acts as that user, from scripts);
- ``--admin NAME`` (repeatable): these users or key names see everyone's work.

The one rule (``sees``): a job, its preview, its result file and its place in the gallery belong to the
identity that submitted it; only that identity and admins can read, preview, cancel or delete it. A
server with one credential is single-user: its only identity is an admin, so it behaves as before.
Pure Python, no torch, no web framework.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from .errors import InvalidParameter

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
MAX_FILE_BYTES = 1 << 20  # an auth file: 1 MiB (about 10,000 users)
MAX_USERS = 10_000
MAX_PASSWORD = 1024  # characters of a password checked (longer ones are refused before any hashing)
# scrypt: the default cost (2**14, r=8: 16 MiB and about 50 ms a check) and the most a file may ask for
SCRYPT_LN, SCRYPT_R, SCRYPT_P = 14, 8, 1
SCRYPT_MAX_LN, SCRYPT_MAX_R, SCRYPT_MAX_P = 20, 16, 4
BCRYPT = re.compile(r"\$2[aby]\$(\d\d)\$[./A-Za-z0-9]{53}")
SCRYPT = re.compile(r"\$scrypt\$ln=(\d{1,2}),r=(\d{1,2}),p=(\d{1,2})\$([A-Za-z0-9+/]{11,88})\$([A-Za-z0-9+/]{22,88})")
API_USER = "api"  # the name an unnamed --api-key acts as


@dataclass(frozen=True)
class User:
    """A signed-in identity: its name (what its jobs are stamped with) and whether it sees everyone's."""

    name: str
    admin: bool = False


NOBODY = User("", admin=False)  # what a request no credential vouches for acts as: it sees nothing


def sees(user: User | None, owner: str | None) -> bool:
    """Whether ``user`` may read, preview, cancel or delete work owned by ``owner``. ``None`` is the
    server's own code (the CLI, ``Omni``, a server with no credential): everything."""
    return user is None or user.admin or (bool(user.name) and owner is not None
                                          and hmac.compare_digest(owner.encode(), user.name.encode()))


def listing_owner(user: User | None) -> str | None:
    """The owner whose jobs a listing keeps for ``user`` (None: everyone's, for admins and the server's code)."""
    return None if user is None or user.admin else user.name


# -- password hashes ---------------------------------------------------------------------------------
def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)


def hash_password(password: str, *, ln: int = SCRYPT_LN) -> str:
    """An scrypt hash in PHC form (``$scrypt$ln=14,r=8,p=1$SALT$HASH``), for an --auth-file line."""
    if not password:
        raise InvalidParameter("a password must not be empty", param="password")
    if len(password) > MAX_PASSWORD:
        raise InvalidParameter(f"a password is at most {MAX_PASSWORD} characters", param="password")
    salt = secrets.token_bytes(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, n=1 << ln, r=SCRYPT_R, p=SCRYPT_P, dklen=32,
                            maxmem=_maxmem(ln, SCRYPT_R))
    return f"$scrypt$ln={ln},r={SCRYPT_R},p={SCRYPT_P}${_b64(salt)}${_b64(digest)}"


def _maxmem(ln: int, r: int) -> int:
    return 128 * r * (1 << ln) * 2 + (1 << 20)


def check_hash(text: str) -> str | None:
    """Why ``text`` is not a hash this server checks (None: it is one). Costs are bounded here, so a
    file cannot make each login take minutes."""
    if BCRYPT.fullmatch(text):
        cost = int(text[4:6])
        return None if 4 <= cost <= 16 else f"a bcrypt cost of {cost} (4 to 16 are checked)"
    m = SCRYPT.fullmatch(text)
    if m:
        ln, r, p = (int(g) for g in m.groups()[:3])
        if not (1 <= ln <= SCRYPT_MAX_LN and 1 <= r <= SCRYPT_MAX_R and 1 <= p <= SCRYPT_MAX_P):
            return (f"scrypt parameters ln={ln},r={r},p={p} (at most ln={SCRYPT_MAX_LN}, r={SCRYPT_MAX_R}, "
                    f"p={SCRYPT_MAX_P})")
        try:
            _unb64(m.group(4)), _unb64(m.group(5))
        except (binascii.Error, ValueError):
            return "an scrypt hash whose salt or digest is not base64"
        return None
    if text.startswith("$"):
        return "a hash of a kind this server does not check (bcrypt $2b$... or scrypt $scrypt$...)"
    return "a plain-text password (write a bcrypt or scrypt hash: python app.py hash-password NAME)"


def verify_password(password: str, hashed: str) -> bool:
    """Whether ``password`` matches ``hashed`` (a hash ``check_hash`` accepted)."""
    if not password or len(password) > MAX_PASSWORD:
        return False
    if hashed.startswith("$2"):
        import bcrypt

        raw = password.encode()
        if len(raw) > 72:  # bcrypt reads 72 bytes; bcrypt>=5 refuses more: such a password never matches
            return False
        return bcrypt.checkpw(raw, hashed.encode())
    m = SCRYPT.fullmatch(hashed)
    if m is None:
        return False
    ln, r, p = (int(g) for g in m.groups()[:3])
    salt, want = _unb64(m.group(4)), _unb64(m.group(5))
    got = hashlib.scrypt(password.encode(), salt=salt, n=1 << ln, r=r, p=p, dklen=len(want), maxmem=_maxmem(ln, r))
    return hmac.compare_digest(got, want)


def read_auth_file(path) -> dict[str, str]:
    """``user:HASH`` lines (blank lines and ``#`` comments skipped) -> {user: hash}. A bad line stops the
    start with one error naming the file and the line (never its text: it may hold a password)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise InvalidParameter(f"--auth-file {path}: cannot be read ({exc.strerror})", param="auth_file") from None
    if len(raw) > MAX_FILE_BYTES:
        raise InvalidParameter(f"--auth-file {path}: over {MAX_FILE_BYTES} bytes", param="auth_file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidParameter(f"--auth-file {path}: not UTF-8 text", param="auth_file") from None
    users: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"--auth-file {path}, line {number}"
        name, sep, hashed = line.partition(":")
        if not sep or not NAME.fullmatch(name):
            raise InvalidParameter(f"{where}: not USER:HASH with a plain user name (letters, digits, _.@-; at most "
                                   "64 characters)", param="auth_file")
        why = check_hash(hashed.strip())
        if why:
            raise InvalidParameter(f"{where} (user {name}): {why}", param="auth_file")
        if name in users:
            raise InvalidParameter(f"{where}: user {name} is listed twice", param="auth_file")
        users[name] = hashed.strip()
        if len(users) > MAX_USERS:
            raise InvalidParameter(f"--auth-file {path}: more than {MAX_USERS} users", param="auth_file")
    if not users:
        raise InvalidParameter(f"--auth-file {path}: no USER:HASH line", param="auth_file")
    return users


def parse_key(value: str) -> tuple[str, str]:
    """An --api-key value -> (name, key): ``NAME=KEY`` names the key, anything else is an unnamed key
    (acting as ``api``)."""
    if value is None or not str(value).strip():
        raise InvalidParameter("--api-key must not be empty", param="api_key")
    name, sep, key = str(value).partition("=")
    if sep and key and NAME.fullmatch(name):
        return name, key
    return API_USER, str(value)


class Verified:
    """Successful password checks remembered (a digest of user and password, never the password), so a
    client sending HTTP Basic on every request pays the slow hash once; at most ``size`` kept."""

    def __init__(self, size: int = 256):
        self.size = size
        self._seen: OrderedDict[bytes, str] = OrderedDict()
        self._pepper = secrets.token_bytes(16)

    def _key(self, user: str, password: str) -> bytes:
        return hashlib.sha256(self._pepper + user.encode() + b"\0" + password.encode()).digest()

    def known(self, user: str, password: str, hashed: str) -> bool:
        key = self._key(user, password)
        if self._seen.get(key) == hashed:
            self._seen.move_to_end(key)
            return True
        return False

    def remember(self, user: str, password: str, hashed: str) -> None:
        self._seen[self._key(user, password)] = hashed
        while len(self._seen) > self.size:
            self._seen.popitem(last=False)
